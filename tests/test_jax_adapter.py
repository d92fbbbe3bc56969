"""flexattn.jax on CPU: forward vs the reference, jit, grad (vs reference and finite
differences), captured jax arrays as operands, a jitted training step."""

import contextlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import flexattn  # noqa: E402
import flexattn.jax as fj  # noqa: E402
from flexattn import mods, reference  # noqa: E402
from flexattn.core import AttentionSpec  # noqa: E402

B, Hq, Hkv, S, D = 2, 4, 2, 24, 8


def _x64():
    """float64 context for finite differences (jax.enable_x64 in new jax, experimental before)."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64  # pragma: no cover - older jax

    return enable_x64()


def _qkv(seed=0, dtype=jnp.float32, hkv=Hkv):
    rng = np.random.default_rng(seed)
    shapes = [(B, Hq, S, D), (B, hkv, S + 5, D), (B, hkv, S + 5, D)]
    return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]


def _np(*xs):
    return [np.asarray(x, np.float64) for x in xs]


@pytest.mark.parametrize("jit", [False, True])
def test_forward_and_lse_match_reference(jit):
    q, k, v = _qkv()
    doc = jnp.asarray(np.repeat([0, 1, 2], [10, 10, 9]), jnp.int32)  # an int jax capture
    slopes = jnp.asarray(np.linspace(0.1, 0.8, Hq), jnp.float32)

    def f(q, k, v, doc, slopes):
        mask = mods.document(doc) & mods.causal(offset=5)
        return fj.flex_attention(q, k, v, score_mod=mods.alibi(slopes) >> mods.softcap(3.0), mask=mask,
                                 enable_gqa=True, return_lse=True)

    out, lse = (jax.jit(f) if jit else f)(q, k, v, doc, slopes)
    assert out.dtype == jnp.float32 and lse.dtype == jnp.float32 and out.shape == q.shape
    spec = AttentionSpec.from_args(score=mods.alibi(np.asarray(slopes)) >> mods.softcap(3.0), enable_gqa=True,
                                   mask=mods.document(np.asarray(doc)) & mods.causal(offset=5))
    want, want_lse = reference.forward(*_np(q, k, v), spec)
    np.testing.assert_allclose(out, want, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(lse, want_lse, atol=1e-5, rtol=1e-6)


def test_block_mask_and_bfloat16():
    q, k, v = _qkv(1, jnp.bfloat16, hkv=Hq)
    bm = fj.create_block_mask(mods.sliding_window(6), None, None, S, S + 5, BLOCK_SIZE=8)
    out = jax.jit(lambda q, k, v: fj.flex_attention(q, k, v, block_mask=bm))(q, k, v)
    assert out.dtype == jnp.bfloat16
    want, _ = reference.forward(*_np(q, k, v), AttentionSpec.from_args(block_mask=bm))
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=2e-2)


def test_grad_matches_reference_backward_including_captured_buffers():
    q, k, v = _qkv(2)
    table = jnp.asarray(np.random.default_rng(3).standard_normal((Hq, 9)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(4).standard_normal((B, Hq, S, D)), jnp.float32)

    def loss(q, k, v, table):
        out, lse = fj.flex_attention(q, k, v, score=mods.relative_bias(table), mask=mods.causal(offset=5),
                                     enable_gqa=True, return_lse=True)
        return (out * w).sum() + (lse ** 2).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, table)
    spec = AttentionSpec.from_args(score=mods.relative_bias(np.asarray(table)), mask=mods.causal(offset=5), enable_gqa=True)
    qn, kn, vn = _np(q, k, v)
    _, lse = reference.forward(qn, kn, vn, spec)
    want = reference.backward(qn, kn, vn, np.asarray(w, np.float64), 2 * lse, spec)
    d_table = next(d for d in want.d_captures if d is not None)
    for got, ref in zip(grads, (want.dq, want.dk, want.dv, d_table)):
        np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-4)


def test_grad_matches_finite_differences_float64():
    with _x64():
        rng = np.random.default_rng(5)
        q, k, v = (jnp.asarray(rng.standard_normal((1, 2, 6, 4))) for _ in range(3))
        slopes = jnp.asarray(rng.uniform(0.2, 0.9, 2))
        assert q.dtype == jnp.float64

        def loss(q, k, v, slopes):
            out, lse = fj.flex_attention(q, k, v, score_mod=mods.alibi(slopes) >> mods.softcap(2.0),
                                         mask=mods.sliding_window(3), return_lse=True)
            return jnp.sum(jnp.sin(out)) + 0.3 * jnp.sum(lse)

        args = [q, k, v, slopes]
        grads = jax.grad(loss, argnums=(0, 1, 2, 3))(*args)
        eps = 1e-6
        for i, (arg, grad) in enumerate(zip(args, grads)):
            flat = np.asarray(arg).ravel()
            for j in np.random.default_rng(i).choice(flat.size, size=min(6, flat.size), replace=False):
                up, down = flat.copy(), flat.copy()
                up[j] += eps
                down[j] -= eps
                plus = loss(*[jnp.asarray(up.reshape(arg.shape)) if n == i else a for n, a in enumerate(args)])
                minus = loss(*[jnp.asarray(down.reshape(arg.shape)) if n == i else a for n, a in enumerate(args)])
                fd = (float(plus) - float(minus)) / (2 * eps)
                assert abs(fd - float(np.asarray(grad).ravel()[j])) < 1e-6, (i, j)


def test_int_captures_get_zero_cotangents_under_grad():
    q, k, v = _qkv(6, hkv=Hq)
    offsets = jnp.asarray([0, 3], jnp.int32)

    def loss(q, offsets):
        score = flexattn.score_mod(lambda s, b, h, qi, ki: s - 0.1 * ((qi + offsets[b]) - ki))
        return fj.flex_attention(q, k, v, score_mod=score).sum()

    dq = jax.jit(jax.grad(loss))(q, offsets)
    assert dq.shape == q.shape and bool(jnp.isfinite(dq).all())


def test_jitted_training_step_updates_a_captured_bias():
    q, k, v = _qkv(7, hkv=Hq)
    target = jnp.asarray(np.random.default_rng(8).standard_normal((B, Hq, S, D)), jnp.float32)
    bias = jnp.zeros((Hq, S, S + 5), jnp.float32)

    def loss(bias):
        score = flexattn.score_mod(lambda s, b, h, qi, ki: s + bias[h, qi, ki])  # captures a tracer
        out = fj.flex_attention(q, k, v, score_mod=score, mask=mods.causal(offset=5))
        return jnp.mean((out - target) ** 2)

    @jax.jit
    def step(bias):
        value, grad = jax.value_and_grad(loss)(bias)
        return bias - 50.0 * grad, value

    losses = []
    for _ in range(4):
        bias, value = step(bias)
        losses.append(float(value))
    assert losses[-1] < losses[0]
    assert float(jnp.abs(bias).sum()) > 0
    # the bias moved only where keys are visible (causal with offset 5)
    visible = np.tril(np.ones((S, S + 5), bool), k=5)
    assert np.all(np.asarray(bias)[:, ~visible] == 0)


def test_rejects_non_jax_inputs():
    q, k, v = _qkv(9, hkv=Hq)
    with pytest.raises(TypeError, match="q must be a jax array"):
        fj.flex_attention(np.asarray(q), k, v)
    with pytest.raises(ValueError, match="enable_gqa"):
        fj.flex_attention(q, k[:, :2], v[:, :2])


# --- the GPU path's plumbing, on CPU arrays -------------------------------------------------------
# flexattn.jax runs the kernels through cutlass.jax.cutlass_call, whose lowering needs a CUDA
# platform. With the CPU platform routed to the kernel path and only cutlass_call faked (a
# pure_callback that plays the compiled entry: it reads its arrays at the launch description's
# positions and writes the reference's results), everything else is real: planning while tracing,
# constant operands for host arrays, operand/result layout and specs, the backward's workspace
# results and zeroed gradient aliases, symbolic zeros. A second fixture compiles the real entries
# through cutlass.jax's own compile path (sm_90a, no GPU needed).

Dk = 64  # the kernels' head dims are 64/128


def _hook_mods(launch, arrays):
    """The launch's score and mask mods with their captures read from the entry's arrays."""
    hook = launch.config.mods
    values = [np.asarray(arrays[s[1]]) if s[0] == "array" else s[1] for s in launch.args]
    n_score = len(hook._score.captures) if hook._score is not None else 0
    score = hook._score.with_captures(tuple(values[:n_score])) if hook._score is not None else None
    mask = hook._mask.with_captures(tuple(values[n_score:])) if hook._mask is not None else None
    return score, mask


def _spec_of(launch, arrays, shape, side):
    from flexattn.blockmask import BlockMask

    score, mask = _hook_mods(launch, arrays)
    cfg = launch.config
    if cfg.causal:
        return AttentionSpec(score, mods.causal(), None, launch.scale, True)
    if not cfg.block_sparse:
        return AttentionSpec(score, mask, None, launch.scale, True)
    lists = [np.asarray(arrays[i]) for i in launch.lists]
    for x in lists:
        assert x.dtype == np.int32
    Q, KV = shape
    if side == "fwd":
        bm = BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=128, mask_mod=mask, seq_lengths=(Q, KV))
    else:  # the q-side lists: the transposed states
        t = BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=128, seq_lengths=(KV, Q))
        bm = BlockMask(t.block_states().swapaxes(-1, -2), (Q, KV), (128, 128), mask)
    return AttentionSpec(score, None, bm, launch.scale, True)


def _emulate(launch, arrays, log):
    """What the compiled entry does, on host arrays (float64 reference, results in place)."""
    from flexattn.kernels.launch.xla_entry import FILL_VALUES, ForwardLaunch

    for i, kind in launch.fills:  # the entry's fill kernels
        arrays[i][...] = FILL_VALUES[kind]
    f64 = lambda i: np.asarray(arrays[i]).astype(np.float64)  # noqa: E731
    if isinstance(launch, ForwardLaunch):
        iq, ik, iv, io, il = launch.main
        spec = _spec_of(launch, arrays, (arrays[iq].shape[2], arrays[ik].shape[2]), "fwd")
        o, l = reference.forward(f64(iq), f64(ik), f64(iv), spec)
        arrays[io][...] = o
        arrays[il][...] = l
        log["fwd"] += 1
        return
    iq, ik, iv, io, ido, il, idl, idq, idk, idv = launch.main
    spec = _spec_of(launch, arrays, (arrays[iq].shape[2], arrays[ik].shape[2]), "bwd")
    g = reference.backward(f64(iq), f64(ik), f64(iv), f64(ido), None if idl is None else f64(idl), spec)
    for i, x in zip((idq, idk, idv), (g.dq, g.dk, g.dv)):
        arrays[i][...] = x
    for slot, i in zip(launch.config.mods.grad_slots, launch.grads):
        assert not arrays[i].any(), "buffer gradients must start zeroed"
        arrays[i][...] = g.d_captures[slot].reshape(arrays[i].shape)
    log["bwd"].append({"d_lse": idl is not None, "grads": len(launch.grads),
                       "workspace": [tuple(arrays[i].shape) for i in launch.workspace]})


def _fake_cutlass_call(log):
    from cutlass.jax import TensorSpec

    def cutlass_call(fn, *, output_shape_dtype, input_spec, output_spec, compile_options, compile_key, launch,
                     allow_cuda_graph):  # no input_output_aliases: XLA's dynamic-slice fusion loses them
        assert isinstance(allow_cuda_graph, bool)
        assert compile_key == launch.key and hash(launch) == hash(compile_key) and "sm_90a" in compile_options
        log["launches"].append(launch)

        def call(*ops):
            assert len(input_spec) == len(ops) and len(output_spec) == len(output_shape_dtype)
            for x, spec in zip(ops, input_spec):
                assert isinstance(spec, TensorSpec) and len(spec.divisibility) == x.ndim

            def host(*arrays):
                arrays = [np.array(a) for a in arrays]   # the entry's view: inputs, then results
                arrays += [np.full(o.shape, np.nan, o.dtype) for o in output_shape_dtype]  # XLA's: garbage
                _emulate(launch, arrays, log)
                return tuple(arrays[len(ops):])

            return jax.pure_callback(host, tuple(output_shape_dtype), *ops)

        return call

    return cutlass_call


@pytest.fixture
def fake_kernels(monkeypatch):
    pytest.importorskip("cutlass")
    monkeypatch.setattr(fj, "_KERNEL_PLATFORMS", {"gpu", "cuda", "cpu"})
    log = {"fwd": 0, "bwd": [], "launches": []}
    monkeypatch.setattr(fj, "_cutlass_call", lambda: _fake_cutlass_call(log))
    return log


def _kernel_inputs(seed, dtype=jnp.bfloat16, d=Dk):
    rng = np.random.default_rng(seed)
    shapes = [(B, Hq, S, d), (B, Hkv, S + 5, d), (B, Hkv, S + 5, d)]
    return [jnp.asarray(rng.standard_normal(s) * 0.5, dtype) for s in shapes]


def test_kernel_path_plumbing_forward_and_grads(fake_kernels):
    q, k, v = _kernel_inputs(10)
    slopes = jnp.asarray(np.linspace(0.1, 0.8, Hq), jnp.float32)
    table = np.random.default_rng(11).standard_normal((Hq, 9)).astype(np.float32)  # a numpy capture: constant
    doc = jnp.asarray(np.repeat([0, 1, 2], [10, 10, 9]), jnp.int32)  # concrete: the block mask is built from it
    w = jnp.asarray(np.random.default_rng(12).standard_normal((B, Hq, S, Dk)), jnp.float32)

    def loss(q, k, v, slopes):
        out, lse = fj.flex_attention(q, k, v, score=mods.alibi(slopes) >> mods.relative_bias(table),
                                     mask=mods.document(doc) & mods.causal(offset=5), enable_gqa=True,
                                     return_lse=True)
        return (out.astype(jnp.float32) * w).sum() + (lse ** 2).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, slopes)
    assert fake_kernels["fwd"] == 1 and len(fake_kernels["bwd"]) == 1
    assert fake_kernels["bwd"][0]["d_lse"] and fake_kernels["bwd"][0]["grads"] == 1  # slopes only (table fixed)
    spec = AttentionSpec.from_args(score=mods.alibi(np.asarray(slopes)) >> mods.relative_bias(table),
                                   mask=mods.document(np.asarray(doc)) & mods.causal(offset=5), enable_gqa=True)
    qn, kn, vn = _np(q, k, v)
    _, lse = reference.forward(qn, kn, vn, spec)
    want = reference.backward(qn, kn, vn, np.asarray(w, np.float64), 2 * lse, spec)
    for got, ref in zip(grads[:3], (want.dq, want.dk, want.dv)):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, atol=3e-2 * max(1, np.abs(ref).max()))
    np.testing.assert_allclose(grads[3], want.d_captures[0], rtol=2e-3)  # d_out arrives in bf16


def test_kernel_path_plumbing_out_only_loss_and_fixed_buffers(fake_kernels):
    q, k, v = _kernel_inputs(13, jnp.float16)
    slopes = jnp.asarray(np.linspace(0.2, 0.6, Hq), jnp.float32)
    bm = fj.create_block_mask(mods.sliding_window(7), None, None, S, S + 5, BLOCK_SIZE=128)

    def loss(q, k, v):  # slopes are captured, not differentiated; lse is not used
        return fj.flex_attention(q, k, v, score=mods.alibi(slopes), block_mask=bm, enable_gqa=True).astype(
            jnp.float32).sum()

    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert fake_kernels["bwd"][0] == {"d_lse": False, "grads": 0, "workspace": fake_kernels["bwd"][0]["workspace"]}
    spec = AttentionSpec.from_args(score=mods.alibi(np.asarray(slopes)), block_mask=bm, enable_gqa=True)
    qn, kn, vn = _np(q, k, v)
    want = reference.backward(qn, kn, vn, np.ones((B, Hq, S, Dk)), None, spec)
    for got, ref in zip((dq, dk, dv), (want.dq, want.dk, want.dv)):
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, atol=1e-2 * max(1, np.abs(ref).max()))


def test_kernel_path_refuses_before_launch(fake_kernels):
    q, k, v = _kernel_inputs(14)
    with pytest.raises(ValueError, match="does not fit shared memory"):   # float32 at head dim 240: forward only
        jax.grad(lambda q: fj.flex_attention(q, *_kernel_inputs(14, jnp.float32, d=240)[1:], enable_gqa=True).sum())(
            _kernel_inputs(14, jnp.float32, d=240)[0])
    with pytest.raises(ValueError, match="multiples of 16"):
        fj.flex_attention(*_kernel_inputs(14, d=72), enable_gqa=True)
    with pytest.raises(ValueError, match="block_mask="):  # a traced mask capture: no block mask while tracing
        jax.jit(lambda q, doc: fj.flex_attention(q, k, v, mask=mods.document(doc), enable_gqa=True))(
            q, jnp.zeros(S + 5, jnp.int32))
    table = np.zeros((Hq, 9))  # float64: jax without x64 cannot hold it
    with pytest.raises(ValueError, match="x64"):
        fj.flex_attention(q, k, v, score=mods.relative_bias(table), enable_gqa=True)
    assert fake_kernels["fwd"] == 0


def test_kernel_path_takes_block_masks_at_any_block_size(fake_kernels):
    """Block masks at BLOCK_SIZE 8 run on the kernels' 128 x 128 tiles: one from its mask
    alone is rebuilt from the mask; one with lists of its own (some rows attend fewer
    tiles) whose mask reads a jax array is read through a table of its tile states
    (blockmask/coarsen.py: the table a constant operand, the jax capture an operand). Forward
    and gradients match the reference at the original block size."""
    from flexattn.blockmask import BlockMask

    q, k, v = _kernel_inputs(16)
    doc_np = np.repeat([0, 1, 2], [10, 10, 9]).astype(np.int32)
    window = fj.create_block_mask(mods.sliding_window(4), None, None, S, S + 5, BLOCK_SIZE=8)
    fine = fj.create_block_mask(mods.document(doc_np), None, None, S, S + 5, BLOCK_SIZE=8)
    counts = np.maximum(np.asarray(fine.kv_num_blocks) - (np.arange(S // 8) % 2), 0).astype(np.int32)
    listed = BlockMask.from_kv_blocks(counts, fine.kv_indices, fine.full_kv_num_blocks, fine.full_kv_indices,
                                      BLOCK_SIZE=8, mask_mod=mods.document(jnp.asarray(doc_np)), seq_lengths=(S, S + 5))
    for bm, host_bm in ((window, window), (listed, BlockMask.from_kv_blocks(
            counts, fine.kv_indices, fine.full_kv_num_blocks, fine.full_kv_indices, BLOCK_SIZE=8,
            mask_mod=mods.document(doc_np), seq_lengths=(S, S + 5)))):
        def loss(q, k, v):
            return fj.flex_attention(q, k, v, block_mask=bm, enable_gqa=True).astype(jnp.float32).sum()

        dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        launch = fake_kernels["launches"][-2]
        assert launch.config.block_sparse or launch.config.band
        spec = AttentionSpec.from_args(block_mask=host_bm, enable_gqa=True)
        qn, kn, vn = _np(q, k, v)
        want = reference.backward(qn, kn, vn, np.ones((B, Hq, S, Dk)), None, spec)
        for got, ref in zip((dq, dk, dv), (want.dq, want.dk, want.dv)):
            np.testing.assert_allclose(np.asarray(got, np.float64), ref, atol=1e-2 * max(1, np.abs(ref).max()))
    assert fake_kernels["fwd"] == 2 and len(fake_kernels["bwd"]) == 2


@pytest.mark.parametrize("precision, parts", [(None, 2), ("tensorfloat32", 1), ("highest", 2)])
def test_float32_forward_plumbing(fake_kernels, precision, parts):
    """float32 on the GPU path: the forward's launch also writes its tf32 operands (V^T;
    with 3xTF32 Q's and K's parts) into scratch results, as jax.default_matmul_precision
    asks (unset: float32's accuracy); the result is the reference's."""
    q, k, v = _kernel_inputs(15, jnp.float32)
    slopes = jnp.asarray(np.linspace(0.1, 0.8, Hq), jnp.float32)
    with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
        out = fj.flex_attention(q, k, v, score=mods.alibi(slopes), mask=mods.causal(), enable_gqa=True)
    (launch,) = fake_kernels["launches"]
    assert launch.config.dtype == "fp32" and launch.config.operand_parts == parts
    assert len(launch.operands) == (3 if parts == 2 else 1)
    spec = AttentionSpec.from_args(score=mods.alibi(np.asarray(slopes)), mask=mods.causal(), enable_gqa=True)
    want, _ = reference.forward(*_np(q, k, v), spec)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=1e-5)


def _compiling_cutlass_call(keys: list):
    """A stand-in for ``cutlass_call`` that builds and compiles the entry as its wrapper and
    lowering do (cutlass.jax's own compile path, sm_90a, no GPU), appending each call's
    compile-key kind to ``keys``, and returns zeros."""
    from cutlass.jax import compile as cj
    from cutlass.jax.primitive import _resolve_input_spec_flat, _resolve_spec_flat

    def cutlass_call(fn, *, output_shape_dtype, input_spec, output_spec, compile_options, compile_key,
                     allow_cuda_graph, **kwargs):
        def call(*ops):
            outs = list(output_shape_dtype)
            spec = cj.build_function_spec(
                list(ops), jax.tree.structure(tuple(ops)), outs, jax.tree.structure(tuple(outs)),
                _resolve_input_spec_flat(input_spec, ops, list(ops)), _resolve_spec_flat(output_spec, outs),
                {}, compile_options, False, kwargs)
            keys.append(compile_key[0])
            cj.get_or_compile_kernel(fn, spec, compile_key=compile_key)
            return tuple(jnp.zeros(o.shape, o.dtype) for o in outs)

        return call

    return cutlass_call


def test_entries_compile_through_cutlass_jax_once_per_structure(monkeypatch):
    """The real ``kernels.launch.xla_entry`` entries, compiled by cutlass.jax's own compile path
    (what cutlass_call's lowering does on a CUDA platform; sm_90a, no GPU here): forward and
    backward compile once; new captured values, new jitted functions and new traces hit the
    cache through the compile key (no IR generated on lookup)."""
    pytest.importorskip("cutlass")
    from cutlass.jax import compile as cj

    compiles, lookups = [], []
    real_compile = cj.cutlass.cute.compile

    def counting_compile(*a, **kw):
        compiles.append(kw["spec"].kwargs[0][1].key[0])
        return real_compile(*a, **kw)

    cutlass_call = _compiling_cutlass_call(lookups)
    monkeypatch.setattr(cj.cutlass.cute, "compile", counting_compile)
    monkeypatch.setattr(fj, "_KERNEL_PLATFORMS", {"gpu", "cuda", "cpu"})
    monkeypatch.setattr(fj, "_cutlass_call", lambda: cutlass_call)
    q, k, v = _kernel_inputs(20)
    table = np.random.default_rng(21).standard_normal((Hq, 9)).astype(np.float32)
    bm = fj.create_block_mask(mods.sliding_window(7) & mods.causal(offset=5), None, None, S, S + 5, BLOCK_SIZE=128)

    def loss(q, k, v, slopes):
        out, lse = fj.flex_attention(q, k, v, score=mods.alibi(slopes) >> mods.relative_bias(table), block_mask=bm,
                                     enable_gqa=True, return_lse=True)
        return out.astype(jnp.float32).sum() + lse.sum()

    for seed in range(2):  # a new trace each time: eager grad re-traces the custom_vjp
        slopes = jnp.asarray(np.linspace(0.1, 0.8, Hq) * (seed + 1), jnp.float32)
        jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, slopes)
    jax.jit(jax.grad(loss, argnums=(0, 3)))(q, k, v, slopes)  # a new jitted function, fewer gradients wanted
    assert lookups == ["flexattn.fwd", "flexattn.bwd"] * 3
    assert compiles == ["flexattn.fwd", "flexattn.bwd"], compiles


@pytest.mark.parametrize("precision", [None, "tensorfloat32"])
def test_float32_entry_compiles_through_cutlass_jax(monkeypatch, precision):
    """The float32 forward's entry (operand pass, then the tf32 forward; 3xTF32 unless tf32 is
    allowed) compiles through cutlass.jax's own compile path on the CPU (sm_90a)."""
    pytest.importorskip("cutlass")
    keys = []
    cutlass_call = _compiling_cutlass_call(keys)
    monkeypatch.setattr(fj, "_KERNEL_PLATFORMS", {"gpu", "cuda", "cpu"})
    monkeypatch.setattr(fj, "_cutlass_call", lambda: cutlass_call)
    q, k, v = _kernel_inputs(41, jnp.float32)
    with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
        fj.flex_attention(q, k, v, mask=mods.causal(), enable_gqa=True)
    assert keys == ["flexattn.fwd"]


def test_short_query_entry_compiles_through_cutlass_jax(monkeypatch):
    """A short query on the GPU path takes the decode kernel's XLA entry (core/short_query.py):
    compiled by cutlass.jax's own compile path on the CPU (sm_90a), once per structure."""
    pytest.importorskip("cutlass")
    from flexattn.core import xla_path

    keys = []
    cutlass_call = _compiling_cutlass_call(keys)
    monkeypatch.setattr(fj, "_KERNEL_PLATFORMS", {"gpu", "cuda", "cpu"})
    monkeypatch.setattr(fj, "_cutlass_call", lambda: cutlass_call)
    monkeypatch.setattr(xla_path, "_sm_count", lambda q: 132)
    rng = np.random.default_rng(40)
    q = jnp.asarray(rng.standard_normal((2, Hq, 1, Dk)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((2, Hkv, 999, Dk)), jnp.bfloat16) for _ in range(2))
    slopes = jnp.asarray(np.linspace(0.1, 0.8, Hq), jnp.float32)
    for _ in range(2):
        fj.flex_attention(q, k, v, score=mods.alibi(slopes), mask=lambda b, h, q_idx, kv_idx: kv_idx > q_idx + 99,
                          enable_gqa=True)
    assert keys == ["flexattn.decode"] * 2


def test_kernel_path_under_vmap_runs_one_call_per_element(fake_kernels):
    """cutlass_call has no batching rule: under vmap (and nested vmaps) the adapter runs one
    call per element (custom_vmap + lax.map), forward and backward."""
    qs, ks, vs = (jnp.stack([a, b]) for a, b in zip(_kernel_inputs(30), _kernel_inputs(31)))
    slopes = jnp.asarray(np.linspace(0.1, 0.8, Hq), jnp.float32)

    def attend(q, k, v):
        return fj.flex_attention(q, k, v, score=mods.alibi(slopes), mask=mods.causal(), enable_gqa=True)

    def loss(q, k, v, slopes):
        return fj.flex_attention(q, k, v, score=mods.alibi(slopes), mask=mods.causal(), enable_gqa=True).astype(
            jnp.float32).sum()

    outs = jax.jit(jax.vmap(attend))(qs, ks, vs)
    grads = jax.vmap(jax.grad(loss, argnums=(0, 3)), in_axes=(0, 0, 0, None))(qs, ks, vs, slopes)
    assert fake_kernels["fwd"] == 4 and len(fake_kernels["bwd"]) == 2
    nested = jax.jit(jax.vmap(jax.vmap(attend)))(qs[:, None], ks[:, None], vs[:, None])
    np.testing.assert_array_equal(np.asarray(nested[:, 0]), np.asarray(outs))
    spec = AttentionSpec.from_args(score=mods.alibi(np.asarray(slopes)), mask=mods.causal(), enable_gqa=True)
    for i in range(2):
        qn, kn, vn = _np(qs[i], ks[i], vs[i])
        out, _ = reference.forward(qn, kn, vn, spec)
        np.testing.assert_allclose(np.asarray(outs[i], np.float64), out, atol=2e-2)
        want = reference.backward(qn, kn, vn, np.ones(out.shape), None, spec)
        np.testing.assert_allclose(np.asarray(grads[0][i], np.float64), want.dq, atol=3e-2 * max(1, np.abs(want.dq).max()))
        np.testing.assert_allclose(grads[1][i], want.d_captures[0], rtol=2e-3)
