"""GPU: flexattn.jax on the kernels (cutlass_call: an XLA FFI custom call) — forward against
the float64 reference and bitwise against the torch adapter, jax.grad against the reference
backward, a jitted training step without recompiles, repeated and re-jitted calls without
kernel compiles, XLA's stream honoured, loops over layers (lax.scan / lax.map / fori_loop,
forward and gradients) and vmap like single calls. Skipped without a CUDA jax backend.

Every array the kernels write (out/lse, dq/dk/dv) starts NaN-filled (the adapter's
``poison_outputs``: the XLA entry fills them before its kernels), so an element a kernel
fails to write fails the test.
"""

import contextlib
import math
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax = pytest.importorskip("jax")
if jax.default_backend() != "gpu":
    pytest.skip("needs jax with a CUDA backend", allow_module_level=True)
pytest.importorskip("cutlass")
torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402

import flexattn.jax as fj  # noqa: E402
import flexattn.torch as fa  # noqa: E402
from flexattn import mods, reference  # noqa: E402
from flexattn.core import AttentionSpec  # noqa: E402

DTYPES = {"bf16": (jnp.bfloat16, torch.bfloat16), "fp16": (jnp.float16, torch.float16)}


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(fj._KernelBackend, "poison_outputs", True)


def _kernel_compiles() -> int:
    """Entries compiled by cutlass.jax in this process (its in-memory compile cache)."""
    from cutlass.jax import compile as cj

    return len(cj._CUTLASS_COMPILE_CACHE)


def _inputs(seed, dtype, B, Hq, Hkv, Q, KV, D, Dv=None):
    rng = np.random.default_rng(seed)
    host = [(rng.standard_normal(s) * 0.5).astype(np.float32)
            for s in ((B, Hq, Q, D), (B, Hkv, KV, D), (B, Hkv, KV, Dv or D))]
    jx = [jnp.asarray(x, DTYPES[dtype][0]) for x in host]
    exact = [np.asarray(x).astype(np.float64) for x in jx]   # the values the kernel sees
    return jx, exact


def _torch(x, dtype):
    return torch.from_numpy(np.asarray(x).astype(np.float32)).to("cuda", DTYPES[dtype][1])


# (dtype, D, B, Hq, Hkv, Q, KV, variant)
CASES = [
    ("bf16", 64, 2, 4, 2, 333, 333, "causal+alibi"),
    ("fp16", 128, 1, 4, 4, 257, 300, "block_mask"),
    ("bf16", 128, 2, 6, 2, 100, 517, "dense"),
    ("fp16", 64, 2, 4, 1, 200, 200, "documents"),
    # 9 q tiles x 34 heads: two rounds of 132 CTAs, so the band takes tiles by tickets
    # (a zero-filled result of the call)
    ("bf16", 64, 1, 34, 2, 1100, 1100, "window"),
]


def _mods(variant, Q, KV, slopes=None):
    """flex_attention kwargs of a variant (jax captures)."""
    if variant == "causal+alibi":
        return dict(score=mods.alibi(slopes), mask=mods.causal())
    if variant == "block_mask":
        return dict(block_mask=fj.create_block_mask(mods.sliding_window(70) & mods.causal(offset=KV - Q), None, None,
                                                    Q, KV, BLOCK_SIZE=128))
    if variant == "documents":  # mask= with a concrete jax capture: the block mask is built while tracing
        doc = np.repeat(np.arange(4), [37, 80, 60, 23]).astype(np.int32)
        return dict(mask=mods.document(jnp.asarray(doc)) & mods.causal())
    if variant == "window":
        return dict(mask=mods.sliding_window(300))
    return {}


def _on_host(kw):
    """The same kwargs with jax captures as numpy arrays (for torch and the reference)."""
    def host(mod):
        return mod.with_captures(tuple(np.asarray(c) if isinstance(c, jax.Array) else c for c in mod.captures))

    return {n: host(m) if n in ("score", "mask") else m for n, m in kw.items()}


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-D{c[1]}-{c[7]}" for c in CASES])
def test_forward_matches_reference_and_torch_bitwise(case):
    dtype, D, B, Hq, Hkv, Q, KV, variant = case
    (q, k, v), exact = _inputs(CASES.index(case), dtype, B, Hq, Hkv, Q, KV, D)
    slopes = jnp.asarray(np.linspace(0.1, 0.9, Hq), jnp.float32)
    jkw = _mods(variant, Q, KV, slopes)
    hkw = _on_host(jkw)
    f = jax.jit(lambda q, k, v: fj.flex_attention(q, k, v, enable_gqa=True, return_lse=True, **jkw))
    out, lse = f(q, k, v)
    assert out.dtype == DTYPES[dtype][0] and lse.dtype == jnp.float32
    want, want_lse = reference.forward(*exact, AttentionSpec.from_args(enable_gqa=True, **hkw))
    tol = 2e-2 if dtype == "bf16" else 5e-3
    got = np.asarray(out).astype(np.float64)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() < tol
    finite = np.isfinite(want_lse)
    assert np.array_equal(np.isfinite(np.asarray(lse)), finite)
    assert np.abs(np.asarray(lse)[finite] - want_lse[finite]).max() < 2e-3
    t_out, t_lse = fa.flex_attention(*(_torch(x, dtype) for x in (q, k, v)), enable_gqa=True, return_lse=True, **hkw)
    assert np.array_equal(got, t_out.double().cpu().numpy())   # one kernel, one answer
    assert np.array_equal(np.asarray(lse), t_lse.cpu().numpy())


def test_follows_xla_stream():
    """Inside jit, q depends on tens of ms of queued XLA work: a launch on any other stream
    would read q before it is written."""
    (q, k, v), exact = _inputs(5, "bf16", 2, 4, 4, 256, 256, 64)

    @jax.jit
    def f(q, k, v, x):  # x an argument: XLA cannot fold the chain at compile time
        for _ in range(20):
            x = (x @ x) * (1.0 / 4096)   # stays all ones
        q = q * x[0, 0].astype(q.dtype)   # q now waits for the chain
        return fj.flex_attention(q, k, v, mask=mods.causal())

    out = np.asarray(f(q, k, v, jnp.ones((4096, 4096), jnp.float32))).astype(np.float64)
    want, _ = reference.forward(*exact, AttentionSpec.from_args(mask=mods.causal()))
    assert np.abs(out - want).max() < 2e-2


@pytest.mark.parametrize("dtype,D,Dv,variant", [("bf16", 64, 64, "causal+alibi"), ("fp16", 128, 128, "block_mask"),
                                                ("bf16", 192, 128, "causal+alibi"), ("bf16", 256, 256, "block_mask")])
def test_grad_matches_reference_backward(dtype, D, Dv, variant):
    """Also beyond head dim 128 (the split-head-dim backward), value dims apart."""
    B, Hq, Hkv, Q, KV = 2, 4, 2, 257, 300 if variant == "block_mask" else 257
    (q, k, v), exact = _inputs(7, dtype, B, Hq, Hkv, Q, KV, D, Dv)
    slopes = jnp.asarray(np.linspace(0.2, 0.7, Hq), jnp.float32)
    rng = np.random.default_rng(8)
    w = jnp.asarray(rng.standard_normal((B, Hq, Q, Dv)), jnp.float32)
    u = jnp.asarray(rng.standard_normal((B, Hq, Q)), jnp.float32)

    def loss(q, k, v, slopes):
        jkw = _mods(variant, Q, KV, slopes)
        out, lse = fj.flex_attention(q, k, v, enable_gqa=True, return_lse=True, **jkw)
        return (out.astype(jnp.float32) * w).sum() + (lse * u).sum()

    argnums = (0, 1, 2, 3) if variant == "causal+alibi" else (0, 1, 2)
    grads = jax.jit(jax.grad(loss, argnums=argnums))(q, k, v, slopes)
    spec = AttentionSpec.from_args(enable_gqa=True, **_on_host(_mods(variant, Q, KV, slopes)))
    d_out = np.asarray(w.astype(q.dtype)).astype(np.float64)   # the cotangent arrives in the input dtype
    want = reference.backward(*exact, d_out, np.asarray(u, np.float64), spec)
    for got, ref in zip(grads[:3], (want.dq, want.dk, want.dv)):
        got = np.asarray(got).astype(np.float64)
        assert np.isfinite(got).all()
        assert np.abs(got - ref).max() < 2e-2 * max(1.0, np.abs(ref).max())
    if variant == "causal+alibi":
        d_slopes = next(d for d in want.d_captures if d is not None)
        np.testing.assert_allclose(np.asarray(grads[3]), d_slopes, rtol=1e-2, atol=1e-2 * np.abs(d_slopes).max())


def test_jitted_training_step_without_recompiles():
    """A tiny attention layer (projections, causal + trainable ALiBi slopes, bf16 kernels)
    trained by SGD inside one jitted step: the loss falls, the slopes move, and after the
    first step no kernel compiles."""
    B, S, E, H, D = 2, 192, 128, 2, 64
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((B, S, E)), jnp.float32)
    target = jnp.asarray(rng.standard_normal((B, S, E)) * 0.5, jnp.float32)
    init = lambda *s: jnp.asarray(rng.standard_normal(s) / math.sqrt(s[0]), jnp.float32)  # noqa: E731
    params = {"wq": init(E, H * D), "wk": init(E, H * D), "wv": init(E, H * D), "wo": init(H * D, E),
              "slopes": jnp.asarray(np.linspace(0.05, 0.3, H), jnp.float32)}

    def heads(t):
        return t.reshape(B, S, H, D).transpose(0, 2, 1, 3).astype(jnp.bfloat16)

    def loss(p):
        q, k, v = (heads(x @ p[n]) for n in ("wq", "wk", "wv"))
        o = fj.flex_attention(q, k, v, score=mods.alibi(p["slopes"]), mask=mods.causal())
        y = o.astype(jnp.float32).transpose(0, 2, 1, 3).reshape(B, S, H * D) @ p["wo"]
        return jnp.mean((y - target) ** 2)

    @jax.jit
    def step(p):
        value, g = jax.value_and_grad(loss)(p)
        return jax.tree_util.tree_map(lambda a, b: a - 0.5 * b, p, g), value

    losses = []
    p = params
    p, value = step(p)
    losses.append(float(value))
    compiled = _kernel_compiles()
    for _ in range(5):
        p, value = step(p)
        losses.append(float(value))
    assert _kernel_compiles() == compiled and step._cache_size() == 1
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0], losses
    assert not np.allclose(np.asarray(p["slopes"]), np.asarray(params["slopes"]))


def test_unsupported_inputs_fail_before_launch():
    (q, k, v), _ = _inputs(11, "bf16", 1, 2, 2, 64, 64, 64)
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    with pytest.raises(ValueError, match="does not fit shared memory"):   # float32 at head dim 240
        jax.grad(lambda q: fj.flex_attention(q, q, q).sum())(jnp.zeros((1, 2, 64, 240), jnp.float32))
    with pytest.raises(ValueError, match="block_mask="):
        jax.jit(lambda q, doc: fj.flex_attention(q, k, v, mask=mods.document(doc)))(q, jnp.zeros(64, jnp.int32))


@pytest.mark.parametrize("precision, tol", [(None, 1e-5), ("tensorfloat32", 8e-3)])
def test_float32_forward_against_reference(precision, tol):
    """float32 inputs: the entry's operand pass and the tf32 forward (3xTF32 unless
    jax.default_matmul_precision allows tf32), NaN-poisoned outputs, against float64."""
    rng = np.random.default_rng(17)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in ((2, 4, 333, 128), (2, 2, 300, 128), (2, 2, 300, 128)))
    slopes = jnp.asarray(np.linspace(0.1, 0.8, 4), jnp.float32)
    with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
        out, lse = jax.jit(lambda q, k, v, s: fj.flex_attention(
            q, k, v, score=mods.alibi(s), mask=mods.causal(), enable_gqa=True, return_lse=True))(q, k, v, slopes)
    spec = AttentionSpec.from_args(score=mods.alibi(np.asarray(slopes)), mask=mods.causal(), enable_gqa=True)
    want, want_lse = reference.forward(np.asarray(q), np.asarray(k), np.asarray(v), spec)
    assert np.abs(np.asarray(out, np.float64) - want).max() < tol
    live = ~np.isneginf(want_lse)
    assert np.abs(np.asarray(lse, np.float64)[live] - want_lse[live]).max() < 10 * tol


@pytest.mark.parametrize("precision, tol", [(None, 1e-4), ("tensorfloat32", 2e-2)])
def test_float32_gradients_against_reference(precision, tol):
    """float32 training under jit: the float32 backward (bwd/tf32_sync.py; 3xTF32 unless
    jax.default_matmul_precision allows tf32) with ALiBi's slope gradient, GQA, causal,
    against the float64 reference (max error relative to the largest gradient)."""
    rng = np.random.default_rng(18)
    q, k, v, do = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                   for s in ((2, 4, 333, 128), (2, 2, 300, 128), (2, 2, 300, 128), (2, 4, 333, 128)))
    slopes = jnp.asarray(np.linspace(0.1, 0.8, 4), jnp.float32)

    def loss(q, k, v, s):
        out = fj.flex_attention(q, k, v, score=mods.alibi(s), mask=mods.causal(), enable_gqa=True)
        return (out * do).sum()

    with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, slopes)
    spec = AttentionSpec.from_args(score=mods.alibi(np.asarray(slopes)), mask=mods.causal(), enable_gqa=True)
    want = reference.backward(np.asarray(q), np.asarray(k), np.asarray(v), np.asarray(do), None, spec)
    slot = next(i for i, g in enumerate(want.d_captures) if g is not None)
    for name, got, ref in zip(("dq", "dk", "dv", "d_slopes"), grads, (want.dq, want.dk, want.dv, want.d_captures[slot])):
        err = np.abs(np.asarray(got, np.float64).reshape(np.shape(ref)) - ref).max() / np.abs(ref).max()
        assert err < tol, f"{precision} {name}: {err:.3g}"


def test_repeated_and_rejitted_calls_compile_nothing():
    """A jitted call compiles its entry once; repeated calls run no Python of ours and
    compile nothing; a new jitted function of the same call (new trace, new lowering) and
    new captured values find the compiled entry by its compile key."""
    (q, k, v), exact = _inputs(12, "bf16", 1, 4, 4, 160, 160, 64)
    slopes = jnp.asarray(np.linspace(0.1, 0.9, 4), jnp.float32)

    def attend(q, k, v, slopes):
        return fj.flex_attention(q, k, v, score=mods.alibi(slopes), mask=mods.causal())

    f = jax.jit(attend)
    out = f(q, k, v, slopes)
    before = _kernel_compiles()
    for _ in range(3):
        out = f(q, k, v, slopes)
    assert _kernel_compiles() == before and f._cache_size() == 1
    other = jax.jit(lambda q, k, v, s: attend(q, k, v, s) * 1)(q, k, v, slopes * 2)
    assert _kernel_compiles() == before
    for got, s in ((out, slopes), (other, slopes * 2)):
        spec = AttentionSpec.from_args(score=mods.alibi(np.asarray(s)), mask=mods.causal())
        want, _ = reference.forward(*exact, spec)
        assert np.abs(np.asarray(got).astype(np.float64) - want).max() < 2e-2


def test_vmap_runs_each_element_like_a_single_call():
    """cutlass_call has no batching rule; under vmap the adapter runs one call per element:
    the same kernel, so the same bits as the un-vmapped calls (forward, dK, dV; dQ and the
    buffer gradient up to the order of their fp32 atomics). (Gave zeros while the buffer
    gradients and the tests' poison were results aliased to operands.)"""
    (q, k, v), _ = _inputs(13, "bf16", 1, 4, 2, 130, 130, 64)
    (q2, k2, v2), _ = _inputs(14, "bf16", 1, 4, 2, 130, 130, 64)
    qs, ks, vs = jnp.stack([q, q2]), jnp.stack([k, k2]), jnp.stack([v, v2])
    slopes = jnp.asarray(np.linspace(0.1, 0.9, 4), jnp.float32)

    def loss(q, k, v, slopes):
        out = fj.flex_attention(q, k, v, score=mods.alibi(slopes), mask=mods.causal(), enable_gqa=True)
        return out.astype(jnp.float32).sum()

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    batched = jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), in_axes=(0, 0, 0, None)))(
        qs, ks, vs, slopes)
    for i, args in enumerate(((q, k, v), (q2, k2, v2))):
        value, grads = step(*args, slopes)
        assert abs(float(batched[0][i]) - float(value)) <= 1e-5 * abs(float(value))  # XLA's sums may differ in order
        for j, (got, want) in enumerate(zip(batched[1], grads)):
            got, want = np.asarray(got[i]).astype(np.float64), np.asarray(want).astype(np.float64)
            assert np.abs(want).max() > 0
            if j in (1, 2):  # dK, dV: summed in registers in a fixed order
                assert np.array_equal(got, want)
            else:  # dQ and the slopes' gradient: fp32 atomics in varying order
                np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


def test_scan_over_layers_gradients_match_single_calls():
    """jax.grad through lax.scan over layers, each with its own trainable ALiBi slopes: the
    backward runs inside a scan whose stacked gradients are dynamic-update-slices of the
    custom call's results (the pattern XLA's dynamic-slice fusion rewrites), and every
    layer's dQ, dK, dV and slopes gradient matches a single call's."""
    layers = 3
    (q, k, v), _ = _inputs(18, "bf16", 1, 4, 2, 130, 130, 64)
    qs = jnp.stack([q * (i + 1) for i in range(layers)])
    ks = jnp.stack([k * (1 - 0.2 * i) for i in range(layers)])
    slopes = jnp.asarray(np.stack([np.linspace(0.1, 0.9, 4) * (i + 1) for i in range(layers)]), jnp.float32)

    def layer(q, k, s):
        out = fj.flex_attention(q, k, v, score=mods.alibi(s), mask=mods.causal(), enable_gqa=True)
        return out.astype(jnp.float32).sum()

    single = jax.jit(jax.grad(layer, argnums=(0, 1, 2)))
    want = [single(qs[i], ks[i], slopes[i]) for i in range(layers)]

    def total(qs, ks, slopes):
        return jax.lax.scan(lambda c, xs: (c + layer(*xs), None), jnp.float32(0), (qs, ks, slopes))[0]

    got = jax.jit(jax.grad(total, argnums=(0, 1, 2)))(qs, ks, slopes)
    for i in range(layers):
        for j, name in enumerate(("dq", "dk", "dslopes")):
            g, w = np.asarray(got[j][i]).astype(np.float64), np.asarray(want[i][j]).astype(np.float64)
            assert np.abs(w).max() > 0, (i, name)
            if j == 1:  # dK: summed in registers in a fixed order
                assert np.array_equal(g, w), (i, name)
            else:  # dQ and the slopes' gradient: fp32 atomics in varying order
                np.testing.assert_allclose(g, w, rtol=1e-2, atol=1e-2 * np.abs(w).max(), err_msg=f"layer {i} {name}")


@pytest.mark.parametrize("loop", ["scan", "map", "fori"])
def test_loops_over_layers_match_single_calls(loop):
    """flex_attention inside lax.scan / lax.map / fori_loop bodies (a model scanning over
    its layers) gives each iteration's result, as a direct call does."""
    layers = 3
    (q, k, v), _ = _inputs(17, "bf16", 1, 4, 2, 130, 130, 64)
    qs = jnp.stack([q * (i + 1) for i in range(layers)])

    def attn(x):
        return fj.flex_attention(x, k, v, mask=mods.causal(), enable_gqa=True)

    want = jnp.stack([jax.jit(attn)(qs[i]) for i in range(layers)])
    if loop == "scan":
        got = jax.jit(lambda qs: jax.lax.scan(lambda c, x: (c, attn(x)), 0, qs)[1])(qs)
    elif loop == "map":
        got = jax.jit(lambda qs: jax.lax.map(attn, qs))(qs)
    else:
        def body(i, acc):
            return acc.at[i].set(attn(qs[i]))
        got = jax.jit(lambda: jax.lax.fori_loop(0, layers, body, jnp.zeros_like(want)))()
    assert float(jnp.abs(want).max()) > 0
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


@pytest.mark.parametrize("q_len, KV, variant", [(1, 1000, "dense"), (4, 777, "causal+alibi"), (16, 300, "window")])
def test_short_queries_take_the_decode_kernel(q_len, KV, variant, monkeypatch):
    """A short query (core/short_query.py) runs the decode kernel's XLA entry at
    flex_attention's positions; it matches the reference and the torch adapter's route
    bitwise; its gradient still comes from the backward kernels."""
    from flexattn.core import xla_path

    entries = []
    real = xla_path.decode_entry
    monkeypatch.setattr(xla_path, "decode_entry", lambda: entries.append(1) or real())
    B, Hq, Hkv, D = 2, 8, 2, 128
    (q, k, v), exact = _inputs(q_len + KV, "bf16", B, Hq, Hkv, q_len, KV, D)
    slopes = jnp.asarray(np.linspace(0.1, 0.9, Hq), jnp.float32)
    jkw = {"dense": {}, "causal+alibi": dict(score=mods.alibi(slopes), mask=mods.causal()),
           "window": dict(mask=lambda b, h, q_idx, kv_idx: kv_idx >= KV - 200 + q_idx)}[variant]
    hkw = _on_host({n: (mods.as_mask(m) if n == "mask" else m) for n, m in jkw.items()})
    out, lse = jax.jit(lambda q, k, v: fj.flex_attention(q, k, v, enable_gqa=True, return_lse=True, **jkw))(q, k, v)
    assert entries, "the call did not take the decode kernel"
    want, want_lse = reference.forward(*exact, AttentionSpec.from_args(enable_gqa=True, **hkw))
    got = np.asarray(out).astype(np.float64)
    assert np.abs(got - want).max() < 2e-2
    finite = np.isfinite(want_lse)
    assert np.abs(np.asarray(lse)[finite] - want_lse[finite]).max() < 2e-3
    t_out = fa.flex_attention(*(_torch(x, "bf16") for x in (q, k, v)), enable_gqa=True, **hkw)
    assert np.array_equal(got, t_out.double().cpu().numpy())   # one route, one answer
    grad = jax.grad(lambda q: fj.flex_attention(q, k, v, enable_gqa=True, **jkw).astype(jnp.float32).sum())(q)
    assert np.isfinite(np.asarray(grad).astype(np.float32)).all()
