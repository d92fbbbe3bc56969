"""flexattn.dlpack on host arrays: destination passing through numpy views, the same
numbers as flexattn.flex_attention (the reference), and destination checks."""

import numpy as np
import pytest

import flexattn
from flexattn import mods
from flexattn.dlpack import flex_attention_into


def _inputs(seed, dtype=np.float32, B=2, Hq=4, Hkv=2, Q=19, KV=23, D=8):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in ((B, Hq, Q, D), (B, Hkv, KV, D), (B, Hkv, KV, D))]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_writes_the_reference_into_the_given_arrays(dtype):
    q, k, v = _inputs(0, dtype)
    kw = dict(score=mods.alibi(np.linspace(0.1, 0.8, 4).astype(np.float32)), mask=mods.sliding_window(7),
              enable_gqa=True, scale=0.3)
    out = np.full(q.shape, np.nan, dtype)
    lse = np.full(q.shape[:3], np.nan, dtype)
    assert flex_attention_into(q, k, v, out, lse, **kw) is None
    want, want_lse = flexattn.flex_attention(q, k, v, return_lse=True, **kw)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)


def test_block_mask_and_score_mod_function():
    q, k, v = _inputs(1, B=1, Hq=2, Hkv=2, Q=32, KV=32)
    bm = flexattn.create_block_mask(mods.causal(), None, None, 32, 32, BLOCK_SIZE=8)
    out, lse = np.empty_like(q), np.empty(q.shape[:3], np.float32)
    flex_attention_into(q, k, v, out, lse, score_mod=lambda s, b, h, qi, ki: s * 0.5, block_mask=bm)
    want = flexattn.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * 0.5, block_mask=bm)
    np.testing.assert_array_equal(out, want)


def test_destinations_are_checked():
    q, k, v = _inputs(2)
    lse = np.empty(q.shape[:3], np.float32)
    with pytest.raises(ValueError, match="out must be float32"):
        flex_attention_into(q, k, v, np.empty(q.shape, np.float64), lse, enable_gqa=True)
    with pytest.raises(ValueError, match="lse must be float32"):
        flex_attention_into(q, k, v, np.empty_like(q), np.empty(q.shape[:2], np.float32), enable_gqa=True)
