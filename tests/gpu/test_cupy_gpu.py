"""GPU: the CuPy adapter (forward and vjp) on the kernels, against the float64 reference
and against the torch adapter (same kernels: same numbers). Skipped without CuPy/CUDA."""

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")

import flexattn.cupy as fc  # noqa: E402
import flexattn.torch as fa  # noqa: E402
from flexattn import mods, reference  # noqa: E402
from flexattn.core import AttentionSpec  # noqa: E402


def _inputs(seed, B=2, Hq=4, Hkv=2, Q=333, KV=300, D=64, Dv=None):
    rng = np.random.default_rng(seed)
    mk = lambda H, S, d: (rng.standard_normal((B, H, S, d)) * 0.5).astype(np.float16)  # noqa: E731
    return mk(Hq, Q, D), mk(Hkv, KV, D), mk(Hkv, KV, Dv or D)


def test_forward_on_a_side_stream_matches_reference_and_torch():
    qh, kh, vh = _inputs(0)
    slopes = np.linspace(0.1, 0.8, 4).astype(np.float32)
    kw = dict(score=mods.alibi(slopes), mask=mods.causal() & mods.sliding_window(90), enable_gqa=True)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        q, k, v = (cupy.asarray(x) for x in (qh, kh, vh))
        x = cupy.ones((4096, 4096), dtype=cupy.float32)
        for _ in range(20):            # ~tens of ms of queued work on this stream ...
            x = (x @ x) * (1.0 / 4096)   # (stays all ones)
        q = q + (x[0, 0] * 0).astype(q.dtype)   # ... that q now depends on
        out, lse = fc.flex_attention(q, k, v, **kw)   # wrong if launched on another stream
    stream.synchronize()
    want, want_lse = reference.forward(qh, kh, vh, AttentionSpec.from_args(**kw))
    assert np.abs(cupy.asnumpy(out).astype(np.float64) - want).max() < 5e-3
    assert np.abs(cupy.asnumpy(lse) - want_lse).max() < 2e-3
    t_out = fa.flex_attention(*(torch.from_numpy(x).cuda() for x in (qh, kh, vh)), **kw)
    assert np.array_equal(cupy.asnumpy(out), t_out.cpu().numpy())   # one kernel, one answer


@pytest.mark.parametrize("D,Dv", [(64, 64), (192, 128), (256, 256)])
def test_vjp_runs_the_backward_kernels(D, Dv):
    """Also beyond head dim 128 (the split-head-dim backward) and with the value head dim
    apart from the query's, through this adapter's plans."""
    qh, kh, vh = _inputs(1, Q=257, KV=257, D=D, Dv=Dv)
    slopes = cupy.asarray(np.linspace(0.2, 0.6, 4).astype(np.float32))
    kw = dict(score=mods.alibi(slopes), mask=mods.causal(), enable_gqa=True)
    q, k, v = (cupy.asarray(x) for x in (qh, kh, vh))
    out, backward = fc.vjp(q, k, v, **kw)
    d_out = cupy.asarray(np.random.default_rng(2).standard_normal(out.shape).astype(np.float16))
    dq, dk, dv, d_caps = backward(d_out)
    cupy.cuda.get_current_stream().synchronize()
    host_kw = dict(kw, score=mods.alibi(cupy.asnumpy(slopes)))
    want = reference.backward(qh, kh, vh, cupy.asnumpy(d_out), None, AttentionSpec.from_args(**host_kw))
    for got, ref in ((dq, want.dq), (dk, want.dk), (dv, want.dv)):
        got = cupy.asnumpy(got).astype(np.float64)
        assert np.abs(got - ref).max() < 2e-2 * max(1.0, np.abs(ref).max())
    slot = [i for i, g in enumerate(d_caps) if g is not None]
    assert len(slot) == 1 and d_caps[slot[0]].shape == slopes.shape
    ref_g = want.d_captures[slot[0]]
    assert np.abs(cupy.asnumpy(d_caps[slot[0]]) - ref_g).max() < 2e-2 * max(1.0, np.abs(ref_g).max())


def test_float32_vjp_runs_the_float32_backward():
    """float32 arrays: 3xTF32 forward and the float32 backward kernel (bwd/tf32_sync.py),
    slope gradient included, against float64 (max error relative to the largest gradient)."""
    rng = np.random.default_rng(3)
    qh, kh, vh, doh = ((rng.standard_normal(s) * 0.5).astype(np.float32)
                       for s in ((2, 4, 201, 128), (2, 2, 190, 128), (2, 2, 190, 128), (2, 4, 201, 128)))
    slopes = cupy.asarray(np.linspace(0.2, 0.6, 4).astype(np.float32))
    kw = dict(score=mods.alibi(slopes), mask=mods.causal(), enable_gqa=True)
    out, backward = fc.vjp(*(cupy.asarray(x) for x in (qh, kh, vh)), **kw)
    dq, dk, dv, d_caps = backward(cupy.asarray(doh))
    cupy.cuda.get_current_stream().synchronize()
    want = reference.backward(qh, kh, vh, doh, None, AttentionSpec.from_args(**dict(kw, score=mods.alibi(cupy.asnumpy(slopes)))))
    slot = next(i for i, g in enumerate(d_caps) if g is not None)
    for got, ref in ((dq, want.dq), (dk, want.dk), (dv, want.dv), (d_caps[slot], want.d_captures[slot])):
        assert got.dtype == np.float32
        assert np.abs(cupy.asnumpy(got).astype(np.float64) - ref).max() < 1e-4 * np.abs(ref).max()


def test_repeated_calls_take_the_prepared_path_on_the_current_stream():
    fc._PREPARED.clear()
    slopes = np.linspace(0.1, 0.8, 4).astype(np.float32)
    kw = dict(score=mods.alibi(slopes), mask=mods.causal(), enable_gqa=True)
    for i in range(3):
        qh, kh, vh = _inputs(10 + i, Q=200, KV=200)
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            q, k, v = (cupy.asarray(x) for x in (qh, kh, vh))
            x = cupy.ones((2048, 2048), dtype=cupy.float32)
            for _ in range(10):            # queued work the inputs depend on
                x = (x @ x) * (1.0 / 2048)
            q = q + (x[0, 0] * 0).astype(q.dtype)
            out, lse = fc.flex_attention(q, k, v, **kw)
        stream.synchronize()
        want, want_lse = reference.forward(qh, kh, vh, AttentionSpec.from_args(**kw))
        assert np.abs(cupy.asnumpy(out).astype(np.float64) - want).max() < 5e-3, i
        assert np.abs(cupy.asnumpy(lse) - want_lse).max() < 2e-3, i
        assert len(fc._PREPARED) == (1 if i >= 1 else 0)


def test_mods_written_with_cupy_functions():
    """cupy.where / cupy.tanh / cupy.clip in a mod trace as numpy's names do (mods/namespaces.py):
    the same output as the mod written with numpy."""
    qh, kh, vh = _inputs(3, Q=200, KV=200)

    def score_cp(s, b, h, q_idx, kv_idx):
        return cupy.where(q_idx >= kv_idx, 20.0 * cupy.tanh(s / 20.0), cupy.clip(s, -1.0, 1.0))

    def score_np(s, b, h, q_idx, kv_idx):
        return np.where(q_idx >= kv_idx, 20.0 * np.tanh(s / 20.0), np.clip(s, -1.0, 1.0))

    def band_cp(b, h, q_idx, kv_idx):
        return cupy.abs(q_idx - kv_idx) <= 64

    q, k, v = (cupy.asarray(x) for x in (qh, kh, vh))
    out, _ = fc.flex_attention(q, k, v, score_mod=score_cp, mask=band_cp, enable_gqa=True)
    want, _ = reference.forward(qh, kh, vh, AttentionSpec.from_args(
        score=mods.score_mod(score_np), mask=mods.mask_mod(lambda b, h, q_idx, kv_idx: np.abs(q_idx - kv_idx) <= 64),
        enable_gqa=True))
    assert np.abs(cupy.asnumpy(out).astype(np.float64) - want).max() < 5e-3
