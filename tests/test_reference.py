"""The numpy reference vs independent implementations (naive numpy, torch autograd, torch flex)."""

import math

import zlib

import numpy as np
import pytest
import torch

import flexattn
from flexattn import AttentionSpec, mods, reference
from flexattn.blockmask import create_block_mask

import naive_attention as naive
from mod_cases import CASES

SHAPES = [  # B, Hq, Hkv, Q, KV, D, Dv
    (1, 1, 1, 1, 1, 8, 8),
    (2, 4, 4, 37, 37, 16, 16),
    (1, 4, 2, 64, 129, 32, 16),   # GQA, Q != KV, odd length, Dv != D
    (2, 6, 1, 130, 70, 8, 8),     # MQA, Q > KV
]


def _inputs(rng, B, Hq, Hkv, Q, KV, D, Dv):
    return (rng.standard_normal((B, Hq, Q, D)), rng.standard_normal((B, Hkv, KV, D)),
            rng.standard_normal((B, Hkv, KV, Dv)))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_matches_torch_naive(case, shape):
    rng = np.random.default_rng(zlib.crc32(repr((case, shape)).encode()))
    B, Hq, Hkv, Q, KV, D, Dv = shape
    q, k, v = _inputs(rng, *shape)
    mask, score, mask_fn, score_fn = CASES[case](rng, B, Hq, Q, KV)
    scale = float(rng.uniform(0.05, 0.5))
    spec = AttentionSpec.from_args(score=score, mask=mask, scale=scale, enable_gqa=Hq != Hkv)
    out, lse = reference.forward(q, k, v, spec)
    want_out, want_lse = naive.attention(*(torch.from_numpy(x) for x in (q, k, v)), score_fn, mask_fn, scale)
    np.testing.assert_allclose(out, want_out.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(lse, want_lse.numpy(), rtol=1e-10, atol=1e-10)
    assert not np.isnan(out).any() and not np.isnan(lse).any()


@pytest.mark.parametrize("case", ["causal", "document", "window_document_alibi_softcap", "prefix_lm"])
def test_block_mask_path_equals_element_mask(case):
    rng = np.random.default_rng(7)
    B, H, Q, KV, D = 2, 2, 150, 150, 16
    q, k, v = _inputs(rng, B, H, H, Q, KV, D, D)
    mask, score, _, _ = CASES[case](rng, B, H, Q, KV)
    bm = create_block_mask(mask, B, None, Q, KV, BLOCK_SIZE=(32, 64))
    a, la = reference.forward(q, k, v, AttentionSpec.from_args(score=score, block_mask=bm))
    b, lb = reference.forward(q, k, v, AttentionSpec.from_args(score=score, mask=mask))
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(la, lb, rtol=1e-12, atol=1e-12)


def test_matches_plain_numpy_softmax():
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, 2, 4, 2, 45, 77, 16, 16)
    m = mods.causal(offset=32)
    out, _ = reference.forward(q, k, v, AttentionSpec.from_args(mask=m, enable_gqa=True))
    allowed = np.arange(45)[:, None] + 32 >= np.arange(77)[None, :]
    np.testing.assert_allclose(out, naive.numpy_attention(q, k, v, allowed), rtol=1e-12, atol=1e-12)


def test_fully_masked_rows_give_zero_and_minus_inf_lse():
    rng = np.random.default_rng(4)
    q, k, v = _inputs(rng, 1, 2, 2, 20, 20, 8, 8)
    lengths = mods.document_from_lengths([5, 7], length=20)  # tokens 12.. are padding
    out, lse = reference.forward(q, k, v, AttentionSpec.from_args(mask=lengths))
    assert np.all(out[:, :, 12:] == 0) and np.all(np.isneginf(lse[:, :, 12:]))
    assert np.isfinite(out).all() and np.isfinite(lse[:, :, :12]).all()
    grads = reference.backward(q, k, v, rng.standard_normal(out.shape), rng.standard_normal(lse.shape),
                               AttentionSpec.from_args(mask=lengths))
    for g in grads[:3]:
        assert np.isfinite(g).all()
    assert np.all(grads.dq[:, :, 12:] == 0)


def test_fully_masked_by_score_mod_minus_inf():
    rng = np.random.default_rng(5)
    q, k, v = _inputs(rng, 1, 1, 1, 6, 6, 4, 4)
    kill = mods.score_mod(lambda s, b, h, qi, ki: torch.where(qi == 2, -math.inf, s))
    out, lse = reference.forward(q, k, v, AttentionSpec.from_args(score=kill))
    assert np.all(out[0, 0, 2] == 0) and np.isneginf(lse[0, 0, 2]) and not np.isnan(out).any()


def test_float32_precision_mode_close_to_float64():
    rng = np.random.default_rng(6)
    q, k, v = _inputs(rng, 1, 2, 2, 33, 33, 16, 16)
    spec = AttentionSpec.from_args(score=mods.softcap(5.0), mask=mods.causal())
    o64, l64 = reference.forward(q, k, v, spec)
    o32, l32 = reference.forward(q, k, v, spec, dtype=np.float32)
    assert o32.dtype == np.float32
    np.testing.assert_allclose(o32, o64, atol=1e-5)
    np.testing.assert_allclose(l32, l64, atol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("shape", SHAPES[1:3], ids=lambda s: "x".join(map(str, s)))
def test_backward_matches_torch_autograd(case, shape):
    rng = np.random.default_rng(zlib.crc32(repr(("bwd", case, shape)).encode()))
    B, Hq, Hkv, Q, KV, D, Dv = shape
    q, k, v = _inputs(rng, *shape)
    mask, score, mask_fn, score_fn = CASES[case](rng, B, Hq, Q, KV)
    spec = AttentionSpec.from_args(score=score, mask=mask, enable_gqa=Hq != Hkv)
    d_out = rng.standard_normal((B, Hq, Q, Dv))
    d_lse = rng.standard_normal((B, Hq, Q))
    grads = reference.backward(q, k, v, d_out, d_lse, spec)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out, lse = naive.attention(tq, tk, tv, score_fn, mask_fn)
    loss = (out * torch.from_numpy(d_out)).sum() + torch.where(torch.isfinite(lse), lse * torch.from_numpy(d_lse), 0.0).sum()
    loss.backward()
    for ours, theirs in ((grads.dq, tq.grad), (grads.dk, tk.grad), (grads.dv, tv.grad)):
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("which", ["bias", "relative_bias", "alibi", "read_twice"])
def test_captured_buffer_gradients(which):
    rng = np.random.default_rng(11)
    B, H, Q, KV, D = 2, 3, 19, 23, 8
    q, k, v = _inputs(rng, B, H, H, Q, KV, D, D)
    if which == "bias":
        buf = rng.standard_normal((H, Q, KV))
        fn = lambda s, b, h, qi, ki: s + buf_t[h, qi, ki]  # noqa: E731
        mod_fn = lambda s, b, h, qi, ki: s + buf[h, qi, ki]  # noqa: E731
    elif which == "relative_bias":
        buf = rng.standard_normal((H, 2 * KV + 1))
        fn = lambda s, b, h, qi, ki: s + buf_t[h, qi - ki + KV]  # noqa: E731
        mod_fn = lambda s, b, h, qi, ki: s + buf[h, qi - ki + KV]  # noqa: E731
    elif which == "alibi":
        buf = rng.uniform(0.1, 1.0, size=H)
        fn = lambda s, b, h, qi, ki: s + buf_t[h] * (ki - qi)  # noqa: E731
        mod_fn = lambda s, b, h, qi, ki: s + buf[h] * (ki - qi)  # noqa: E731
    else:
        buf = rng.uniform(0.5, 1.5, size=H)
        fn = lambda s, b, h, qi, ki: s * buf_t[h] + torch.tanh(buf_t[h] * qi)  # noqa: E731
        mod_fn = lambda s, b, h, qi, ki: s * buf[h] + np.tanh(buf[h] * qi)  # noqa: E731
    score = mods.score_mod(mod_fn)
    spec = AttentionSpec.from_args(score=score, mask=mods.causal())
    d_out = rng.standard_normal((B, H, Q, D))
    grads = reference.backward(q, k, v, d_out, None, spec)
    buf_t = torch.tensor(buf, requires_grad=True)
    out, _ = naive.attention(*(torch.from_numpy(x) for x in (q, k, v)), fn, lambda b, h, qi, ki: qi >= ki)
    (out * torch.from_numpy(d_out)).sum().backward()
    (d_buf,) = [g for g in grads.d_captures if g is not None]
    np.testing.assert_allclose(d_buf, buf_t.grad.numpy(), rtol=1e-9, atol=1e-9)


def test_against_torch_flex_attention_cpu():
    from torch.nn.attention.flex_attention import create_block_mask as torch_cbm
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    rng = np.random.default_rng(12)
    for B, H, Q, KV, D in ((2, 4, 128, 256, 16), (1, 2, 100, 77, 8)):
        q, k, v = (torch.from_numpy(x) for x in _inputs(rng, B, H, H, Q, KV, D, D))
        mask, score, mask_fn, score_fn = CASES["window_document_alibi_softcap"](rng, B, H, Q, KV)
        tbm = torch_cbm(mask_fn, B, None, Q, KV, device="cpu", BLOCK_SIZE=32)
        want, want_lse = torch_flex(q, k, v, score_mod=score_fn, block_mask=tbm, return_lse=True)
        out, lse = flexattn.flex_attention(q, k, v, score=score, mask=mask, return_lse=True)
        np.testing.assert_allclose(out, want.numpy(), rtol=1e-10, atol=1e-10)
        finite = np.isfinite(want_lse.numpy())
        np.testing.assert_allclose(lse[finite], want_lse.numpy()[finite], rtol=1e-5, atol=1e-5)


def test_backward_with_stored_output_changes_only_delta():
    """`out=` (the stored low-precision forward output) enters delta alone: the exact
    output reproduces the plain backward, a perturbed one leaves dv untouched and moves
    dq and the buffer gradients by exactly the delta term."""
    rng = np.random.default_rng(12)
    B, H, Q, KV, D = 1, 2, 17, 21, 8
    q, k, v = _inputs(rng, B, H, H, Q, KV, D, D)
    d_out = rng.standard_normal((B, H, Q, D))
    spec = AttentionSpec.from_args(score=mods.alibi(H), mask=mods.causal())
    exact = reference.backward(q, k, v, d_out, None, spec)
    out, _ = reference.forward(q, k, v, spec)
    same = reference.backward(q, k, v, d_out, None, spec, out=out)
    for a, b in zip(exact[:3], same[:3]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    bumped = out + 1e-3 * rng.standard_normal(out.shape)
    moved = reference.backward(q, k, v, d_out, None, spec, out=bumped)
    np.testing.assert_array_equal(moved.dv, exact.dv)
    assert not np.allclose(moved.dq, exact.dq, rtol=1e-9, atol=1e-9)
    (d_exact,) = [g for g in exact.d_captures if g is not None]
    (d_moved,) = [g for g in moved.d_captures if g is not None]
    assert not np.allclose(d_moved, d_exact, rtol=1e-9, atol=1e-9)
