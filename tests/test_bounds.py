"""CPU: the bounds-checked debug mode (problem/bounds.py) and the always-on block-mask checks."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import flexattn
import flexattn.torch as fa
from flexattn import mods
from flexattn.core.prepared import PreparedCalls
from flexattn.problem import bounds

S = 48
HERE = os.path.abspath(__file__)


def _qkv(B=1, H=4, Q=S, KV=S, D=16):
    return torch.randn(B, H, Q, D), torch.randn(B, H, KV, D), torch.randn(B, H, KV, D)


def _line_of(text: str) -> int:
    """The line of this file holding ``text`` (the read an error must name)."""
    with open(HERE) as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


def test_a_read_past_the_end_names_its_line_and_position():
    bias = torch.randn(4, 2 * S - 2)   # one entry short for q - kv + S - 1

    def relative(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + S - 1]   # the read out of range

    q, k, v = _qkv()
    with flexattn.check_bounds():
        with pytest.raises(IndexError) as err:
            fa.flex_attention(q, k, v, score_mod=relative)
    msg = str(err.value)
    assert f"{HERE}:{_line_of('# the read out of range')} (in relative)" in msg
    assert "score_mod 'relative'" in msg and "shape (4, 94)" in msg and "index 94 along dim 1" in msg
    assert "q=47, kv=0" in msg      # q - kv + S - 1 = 94 first at the last row's first key
    # a table of the right size passes, and the result is the unchecked call's
    good = torch.randn(4, 2 * S - 1)
    fn = lambda score, b, h, q_idx, kv_idx: score + good[h, q_idx - kv_idx + S - 1]  # noqa: E731
    with flexattn.check_bounds():
        checked = fa.flex_attention(q, k, v, score_mod=fn)
    torch.testing.assert_close(checked, fa.flex_attention(q, k, v, score_mod=fn))


def test_negative_indices_are_out_of_range_and_the_mode_is_off_by_default():
    """The kernels do not wrap negative indices (Python and the CPU reference do): the
    debug mode calls them out; without it the call runs."""
    bias = torch.randn(4, S)

    def shifted(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx]

    q, k, v = _qkv()
    assert not bounds.enabled()
    fa.flex_attention(q, k, v, score_mod=shifted)
    with flexattn.check_bounds():
        with pytest.raises(IndexError, match=r"index -1 along dim 1, outside \[0, 48\), at q=0, kv=1"):
            fa.flex_attention(q, k, v, score_mod=shifted)
        # masked to q >= kv the read is still made (scores are modded before masking)
        with pytest.raises(IndexError, match="index -1"):
            fa.flex_attention(q, k, v, score_mod=shifted, mask=mods.causal())
    assert not bounds.enabled()


def test_nested_reads_masks_and_block_masks():
    """A table indexed by another capture (document ids past the table), a mask's reads,
    and a block mask's mask_mod (applied inside its partial tiles)."""
    doc = torch.arange(S) // 10                   # ids 0..4
    weight = torch.randn(4)                      # one short

    def per_document(score, b, h, q_idx, kv_idx):
        return score * weight[doc[q_idx]]

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx + 1]     # kv + 1 = S at the last key

    q, k, v = _qkv()
    with flexattn.check_bounds():
        with pytest.raises(IndexError, match=r"per_document.*shape \(4,\) at index 4 along dim 0.*q=40"):
            fa.flex_attention(q, k, v, score_mod=per_document)
        with pytest.raises(IndexError, match=r"^mask 'same_doc'.*index 48 along dim 0.*kv=47"):
            fa.flex_attention(q, k, v, mask=same_doc)
        bm = fa.create_block_mask(same_doc, None, None, S, S, BLOCK_SIZE=16)
        with pytest.raises(IndexError, match=r"^block_mask.mask_mod 'same_doc'"):
            fa.flex_attention(q, k, v, block_mask=bm)


def test_proven_reads_are_not_enumerated(monkeypatch):
    """Interval analysis settles in-range reads without computing any index."""
    monkeypatch.setattr(bounds, "_first_out_of_range", lambda *a: pytest.fail("enumerated a proven read"))
    table = torch.randn(4, 2 * S - 1)
    q, k, v = _qkv()
    with flexattn.check_bounds():
        fa.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s + table[h, qi - kv + S - 1],
                          mask=mods.causal())


def test_decode_steps_are_checked():
    """fa.decode: mods see true positions (q at the end of each sequence)."""
    lengths = torch.tensor([30, 45])
    k = torch.randn(2, 2, S, 16)
    bias = torch.randn(40)                       # positions reach 44

    def by_position(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx]

    q = torch.randn(2, 4, 1, 16)
    cache = fa.KVCache(k, k.clone(), lengths)
    fa.decode(q, cache, score_mod=lambda s, b, h, qi, kv: s + bias[kv % 40])
    with flexattn.check_bounds():
        with pytest.raises(IndexError, match=r"by_position.*index 44 along dim 0"):
            fa.decode(q, cache, score_mod=by_position)


def test_prepared_calls_decline_while_checking():
    cache = PreparedCalls()
    key, call = ("k",), (mods.causal(), None, None, False, None, None)
    for _ in range(2):
        cache.add(key, call, lambda: (lambda *a: "prepared"))
    assert cache.run(key) == "prepared"
    with flexattn.check_bounds():
        assert cache.run(key) is None
    assert cache.run(key) == "prepared"


def test_environment_switch():
    code = "import flexattn.problem.bounds as b; print(b.enabled())"
    for value, want in (("1", "True"), ("0", "False")):
        env = dict(os.environ, FLEXATTN_CHECK_BOUNDS=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want


def test_switch_and_nesting():
    assert not bounds.enabled()
    flexattn.check_bounds()
    try:
        assert bounds.enabled()
        with flexattn.check_bounds(False):
            assert not bounds.enabled()
        assert bounds.enabled()
    finally:
        flexattn.check_bounds(False)
    assert not bounds.enabled()


def test_user_block_masks_are_checked_always():
    """Always on: counts beyond a list, indices out of range and lists that do not fit the
    call's lengths are errors before any launch (also without the debug mode)."""
    num = np.ones((1, 1, 3), np.int32)
    idx = np.tile(np.arange(3, dtype=np.int32), (1, 1, 3, 1))
    with pytest.raises(ValueError, match="block counts for kv_indices"):
        flexattn.BlockMask.from_kv_blocks(num * 4, idx)
    with pytest.raises(ValueError, match="kv_indices holds block indices outside"):
        flexattn.BlockMask.from_kv_blocks(num, idx + 3)
    q, k, v = _qkv(Q=200, KV=200)
    short = flexattn.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=(128, 64), seq_lengths=(200, 200))
    with pytest.raises(ValueError, match="lists 3 x 3 blocks of 128 x 64, but Q_LEN=200, KV_LEN=200 need 2 x 4"):
        fa.flex_attention(q, k, v, block_mask=short)
