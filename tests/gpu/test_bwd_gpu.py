"""GPU: the sm90 backward (preprocess + main kernel + postprocess) against the float64
reference `flexattn.reference.backward`, on randomized shapes x mods x dtypes.

O and LSE come from our forward kernel (`kernel_path.forward_into`), the backward config
from the forward's plan (`bwd.plan.config_from_forward`), so the block structure (dense,
built-in causal, block-sparse q-side lists) and the q tile (80 rows for dense non-causal
head dim 128, dQ computed transposed; else 64) are the ones the public path will use;
test_tile_m_80 forces 80 where the planner keeps 64 (relative-bias tables). dq, dk,
dv and the fp32 workspace are NaN-poisoned before every launch: an element the kernels
fail to write fails the test. Buffer gradients (ALiBi slopes, relative-bias tables, dense
biases) are compared too. Skipped without CUDA.
"""

import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")

from flexattn import mods, reference  # noqa: E402
from flexattn.core import AttentionSpec, check_inputs  # noqa: E402
from flexattn.core.kernel_path import Device, ffi_stream_scope, forward_into, use_tvm_ffi  # noqa: E402
from flexattn.kernels.bwd.plan import config_from_forward, workspace_dtypes, workspace_shapes  # noqa: E402
from flexattn.kernels.launch.arguments import ffi_mod_args  # noqa: E402
from flexattn.kernels.launch.backward import BackwardRunner, FfiBackwardRunner  # noqa: E402
from flexattn.kernels.launch.operands import BackwardArrays  # noqa: E402
from flexattn.kernels.emit.mod_emit import runtime_args  # noqa: E402

from mod_cases import CASES  # noqa: E402

# "fp32" and "tf32": float32 inputs on the float32 kernel (bwd/tf32_sync.py), 3xTF32 and
# one tf32 pass.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "tf32": torch.float32}
TF32_PASSES = {"fp32": 3, "tf32": 1}
# Error bounds relative to the largest reference gradient (max-abs) and to its norm.
# bf16/fp16 P and dS feed the GEMMs; dQ, buffer grads accumulate in fp32.
TOL = {"bf16": (4e-2, 1.5e-2), "fp16": (1e-2, 4e-3), "fp32": (1e-4, 2e-5), "tf32": (1.5e-2, 4e-3)}

_RUNNERS = {}


def _device(tf32_passes=3):
    from flexattn.torch.devices import _backward_alloc, _DeviceCopies

    dev = torch.device("cuda")   # alloc: float32's forward operands
    return Device(torch.cuda.current_stream().cuda_stream, _DeviceCopies(dev), alloc=_backward_alloc(dev),
                  tf32_passes=tf32_passes)


# The launch path users get: TVM-FFI where it is installed (kernels/launch/backward.py);
# test_from_dlpack_runner covers the from_dlpack one.
FFI = use_tvm_ffi(stream_scope=True)


def _runner(cfg, ffi=FFI):
    key = (ffi,) + cfg.key()
    if key not in _RUNNERS:
        _RUNNERS[key] = FfiBackwardRunner(cfg) if ffi else BackwardRunner(cfg)
    return _RUNNERS[key]


def _nan(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def _poison(shape, dtype):
    """NaN for float workspaces; -1 for the deterministic mode's integer ones (semaphores,
    fixed-point accumulators: the preprocess must zero them)."""
    if dtype.is_floating_point:
        return _nan(shape, dtype)
    return torch.full(shape, -1, dtype=dtype, device="cuda")


def kernel_backward(q, k, v, do, spec, dlse=None, deterministic=False, ffi=FFI, tile_m=None,
                    cluster_n=None, tf32_passes=3, tile_n=None, **config):
    """Forward kernel for O and LSE, then the backward kernels. -> (dq, dk, dv, grads by
    capture slot (None where no gradient), forward config, out, backward config).
    `deterministic`: the bitwise-repeatable backward (BwdConfig.deterministic); `ffi`:
    launch through TVM-FFI; `tile_m`, `cluster_n`, `tile_n`, `config` (other BwdConfig fields):
    instead of the planner's; `tf32_passes`:
    float32's (the forward's and so the backward's)."""
    dev = _device(tf32_passes)
    shape = check_inputs(q, k, v, spec)
    out = _nan((shape.batch, shape.q_heads, shape.q_len, shape.v_head_dim), q.dtype)
    lse = _nan((shape.batch, shape.q_heads, shape.q_len), torch.float32)
    plan = forward_into(q, k, v, out, lse, shape, spec, dev)
    tile = {} if tile_m is None else {"tile_m": tile_m}
    if cluster_n is not None:
        tile["cluster_n"] = cluster_n
    if tile_n is not None:           # (the planner's otherwise: bwd.plan.with_swapped_layout)
        tile["tile_n"] = tile_n
    tile.update(config)              # other BwdConfig fields (num_stages, do_stages, ds_buffers)
    cfg = config_from_forward(plan.config, deterministic=deterministic, **tile)
    hook = cfg.mods
    args = ffi_mod_args(hook, dev.to_device) if ffi else runtime_args(hook, dev.to_device)
    lists = None
    if cfg.block_sparse:    # (the band structure walks by arithmetic: no lists)
        bm = plan.block_mask
        side = [bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices]
        if cfg.kv_lists:        # the kv-side lists order the dQ adds / count a tile's visitors
            side += [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices]
        lists = tuple(dev.to_device(x) for x in side)
    captures = hook.captures()
    grads = None
    if hook.grad_slots:
        grads = tuple(torch.zeros(tuple(np.shape(captures[s])) or (1,), dtype=torch.float32,
                                  device="cuda") for s in hook.grad_slots)
    dtypes = workspace_dtypes(cfg)
    ws = tuple(_poison(s, getattr(torch, dtypes[n])) for n, s in
               workspace_shapes(cfg, shape.batch, shape.q_heads, shape.q_len).items())
    dq, dk, dv = _nan(q.shape, q.dtype), _nan(k.shape, k.dtype), _nan(v.shape, v.dtype)
    scale = spec.resolved_scale(shape.head_dim)
    if ffi:
        with ffi_stream_scope(q, dev):
            _runner(cfg, True).run(BackwardArrays(q, k, v, out, lse, do, dq, dk, dv, dlse), ws, scale, args, grads,
                                   lists)
    else:
        _runner(cfg, False).run(BackwardArrays(q, k, v, out, lse, do, dq, dk, dv, dlse), ws, scale, args, grads,
                                dev.stream, lists)
    torch.cuda.synchronize()
    by_slot = [None] * len(captures)
    for s, g in zip(hook.grad_slots, grads or ()):
        by_slot[s] = g
    return dq, dk, dv, by_slot, plan.config, out, cfg


def _close(what, got, want, dtype_name):
    got = got.double().cpu().numpy().reshape(np.shape(want))
    assert not np.isnan(got).any(), f"{what}: NaN (unwritten or invalid) elements"
    tol_max, tol_rel = TOL[dtype_name]
    err = np.abs(got - want).max()
    if np.abs(want).max() < 1e-9:
        # A gradient that is zero in exact arithmetic (one key: dS = P (dP - D) = dP - D):
        # the kernel's is the fp32 cancellation of dP and D (~1e-7 of their size), which no
        # relative measure can judge. Bound it absolutely.
        assert err <= 1e-5, f"{what}: {err:.3g} where the exact gradient is 0"
        return
    ref = max(np.abs(want).max(), 1e-6)
    rel = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-12)
    assert err <= tol_max * ref and rel <= tol_rel, f"{what}: max err {err:.3g} (ref {ref:.3g}), rel {rel:.3g}"


def check_case(name, dtype_name, D, B, Hq, Hkv, Q, KV, mask, score, scale=None, layout="bhsd",
               with_dlse=False, seed=0, ffi=FFI, tile_m=None, cluster_n=None, tile_n=None, **config):
    torch.manual_seed(seed)
    dtype = DTYPES[dtype_name]

    def mk(H, S):
        if layout == "bshd":                      # strided [B, S, H, D] storage
            return torch.randn(B, S, H, D, device="cuda", dtype=dtype).transpose(1, 2)
        return torch.randn(B, H, S, D, device="cuda", dtype=dtype)
    q, k, v, do = mk(Hq, Q), mk(Hkv, KV), mk(Hkv, KV), mk(Hq, Q)
    dlse = torch.randn(B, Hq, Q, device="cuda") if with_dlse else None
    spec = AttentionSpec.from_args(score=score, mask=mask, scale=scale, enable_gqa=True)
    dq, dk, dv, grads, _, out, cfg = kernel_backward(q, k, v, do, spec, dlse, ffi=ffi, tile_m=tile_m,
                                                     cluster_n=cluster_n, tile_n=tile_n, **config,
                                                     tf32_passes=TF32_PASSES.get(dtype_name, 1))
    if dtype_name in TF32_PASSES:
        assert (cfg.dtype, cfg.tf32_passes) == ("fp32", TF32_PASSES[dtype_name])
    want = reference.backward(q.cpu(), k.cpu(), v.cpu(), do.cpu(),
                              dlse.cpu() if dlse is not None else None, spec=spec)
    label = f"{name} {dtype_name} D{D} B{B} Hq{Hq} Hkv{Hkv} Q{Q} KV{KV} tile_m {cfg.tile_m}"
    _close(f"{label} dq", dq, want.dq, dtype_name)
    _close(f"{label} dk", dk, want.dk, dtype_name)
    _close(f"{label} dv", dv, want.dv, dtype_name)
    if not any(g is not None for g in want.d_captures):
        return
    # Buffer gradients: against the reference given the kernel's own stored output, as
    # delta = rowsum(dO * O) uses the bf16/fp16 O (see reference.backward's `out`).
    want = reference.backward(q.cpu(), k.cpu(), v.cpu(), do.cpu(),
                              dlse.cpu() if dlse is not None else None, spec=spec,
                              out=out.cpu())
    for slot, ref in enumerate(want.d_captures):
        if ref is None:
            continue
        assert grads[slot] is not None, f"{label}: no kernel gradient for capture {slot}"
        _close(f"{label} d_capture[{slot}]", grads[slot], ref, dtype_name)


# (case, dtype, D, B, Hq, Hkv, Q, KV, layout)
FIXED = [
    ("none", "bf16", 128, 2, 4, 4, 256, 256, "bhsd"),
    ("none", "fp16", 64, 1, 3, 3, 77, 300, "bhsd"),            # Q < KV, odd lengths
    ("causal", "bf16", 128, 2, 8, 2, 1000, 1000, "bhsd"),      # built-in causal, GQA 4:1
    ("causal", "fp16", 128, 1, 4, 1, 129, 513, "bhsd"),        # MQA; kv blocks nobody sees
    ("causal", "bf16", 64, 1, 6, 3, 333, 129, "bshd"),         # Q > KV, strided
    ("sliding_window", "bf16", 128, 1, 4, 2, 700, 700, "bhsd"),  # block-sparse
    ("document", "fp16", 64, 2, 2, 2, 384, 384, "bhsd"),
    ("document_batched", "bf16", 128, 2, 4, 4, 300, 300, "bhsd"),
    ("alibi", "bf16", 128, 1, 8, 8, 300, 300, "bhsd"),         # slope gradients
    ("softcap", "fp16", 64, 2, 4, 2, 511, 257, "bshd"),
    ("relative_bias", "bf16", 64, 2, 4, 2, 250, 250, "bhsd"),  # table gradients (GQA)
    ("causal_relative_bias", "bf16", 128, 1, 4, 2, 777, 900, "bhsd"),  # per-diagonal sums
    ("bias", "fp16", 64, 1, 2, 2, 130, 140, "bhsd"),           # dense bias gradient
    ("causal_softcap", "bf16", 128, 2, 4, 4, 400, 400, "bhsd"),
    ("window_document_alibi_softcap", "bf16", 64, 1, 4, 2, 500, 500, "bhsd"),
    ("prefix_lm", "fp16", 128, 2, 2, 1, 200, 260, "bhsd"),
    ("not_causal_or_prefix", "bf16", 64, 1, 2, 2, 190, 190, "bhsd"),
    ("custom_function", "bf16", 64, 1, 2, 2, 150, 150, "bhsd"),
    ("none", "bf16", 64, 1, 1, 1, 1, 1, "bhsd"),               # one element
    ("causal", "bf16", 128, 1, 2, 2, 3000, 2900, "bhsd"),      # long: many q blocks
    # Dense non-causal head dim 128: the planner's 80-row q tiles (dQ swapped), lengths
    # that are no multiple of 80 (the first "none" and "alibi" above run them too).
    ("none", "bf16", 128, 1, 3, 3, 77, 300, "bhsd"),           # one partial q tile
    ("none", "fp16", 128, 2, 8, 2, 1000, 1000, "bshd"),        # GQA 4:1, strided
    ("none", "bf16", 128, 1, 2, 1, 1, 333, "bhsd"),            # one query row, MQA
    ("softcap", "bf16", 128, 2, 4, 2, 333, 500, "bhsd"),
]


@pytest.mark.parametrize("case", FIXED, ids=lambda c: "-".join(map(str, c)))
def test_fixed(case):
    name, dtype_name, D, B, Hq, Hkv, Q, KV, layout = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    mask, score, _, _ = CASES[name](rng, B, Hq, Q, KV)
    check_case(name, dtype_name, D, B, Hq, Hkv, Q, KV, mask, score, layout=layout,
               seed=FIXED.index(case))


@pytest.mark.parametrize("case", [c for c in FIXED if c[0] in ("window_document_alibi_softcap", "relative_bias")]
                         + [FIXED[4]], ids=lambda c: "-".join(map(str, c)))
def test_from_dlpack_runner(case):
    """The launch path without TVM-FFI (``BackwardRunner``: from_dlpack, explicit stream)."""
    name, dtype_name, D, B, Hq, Hkv, Q, KV, layout = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    mask, score, _, _ = CASES[name](rng, B, Hq, Q, KV)
    check_case(name, dtype_name, D, B, Hq, Hkv, Q, KV, mask, score, layout=layout, ffi=False)


# Where the planner keeps 64 rows, 80 forced: a relative-bias table's gradient (the
# planner keeps 64 for its per-diagonal shared-memory sums; at 80 each thread adds its
# diagonals itself), clamped and unclamped (every distance its own entry), and a dense
# bias. (case, dtype, D, B, Hq, Hkv, Q, KV, layout)
TILE80 = [
    ("relative_bias", "bf16", 128, 2, 4, 2, 333, 250, "bhsd"),
    ("wide_relative_bias", "fp16", 128, 1, 4, 4, 1000, 777, "bshd"),
    ("bias", "bf16", 128, 1, 2, 1, 130, 170, "bhsd"),
    # a band walked by arithmetic in 80-row tiles (both edges partial, GQA, ragged ends)
    ("sliding_window", "bf16", 128, 1, 4, 2, 700, 700, "bhsd"),
    ("sliding_window", "fp16", 128, 2, 8, 2, 1000, 777, "bshd"),
]


def _case_mods(name, rng, B, Hq, Q, KV):
    """(mask, score) of a mod_cases case, or of "wide_relative_bias" or "first_rows"."""
    if name == "wide_relative_bias":           # causal_relative_bias's table, no mask
        _, score, _, _ = CASES["causal_relative_bias"](rng, B, Hq, Q, KV)
        return None, score
    if name == "first_rows":       # rows from 70 on see no key: whole q tiles nobody visits
        return mods.mask_mod(lambda b, h, q, kv: q < 70), None
    mask, score, _, _ = CASES[name](rng, B, Hq, Q, KV)
    return mask, score


def _check_listed(case, cases, **overrides):
    """check_case for `case` of the list `cases`, with backward config `overrides`."""
    name, dtype_name, D, B, Hq, Hkv, Q, KV, layout = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    mask, score = _case_mods(name, rng, B, Hq, Q, KV)
    check_case(name, dtype_name, D, B, Hq, Hkv, Q, KV, mask, score, layout=layout,
               seed=cases.index(case), **overrides)


# Masks that compare q - kv, its abs and its residues with constants: the backward's mask
# takes q unclamped as an AffineIndex (bwd/pointwise.py), rows past Q_LEN included.
CONSTANT_COMPARES = [
    ("integer_division", "bf16", 128, 2, 4, 2, 700, 700, "bhsd"),
    ("integer_division", "fp16", 64, 1, 4, 4, 333, 517, "bshd"),   # Q < KV, ragged q tile
    ("integer_division", "bf16", 128, 1, 2, 1, 901, 300, "bhsd"),  # Q > KV
]


@pytest.mark.parametrize("case", CONSTANT_COMPARES, ids=lambda c: "-".join(map(str, c)))
def test_masks_compared_with_constants(case):
    _check_listed(case, CONSTANT_COMPARES)


@pytest.mark.parametrize("case", TILE80, ids=lambda c: "-".join(map(str, c)))
def test_tile_m_80(case):
    _check_listed(case, TILE80, tile_m=80)


# 128 q rows per visit (head dims up to 64 without a score mod: bwd.plan.choose_tile_m),
# forced here also where the planner keeps 64 (score mods, wider block lists).
TILE128 = [
    ("causal", "bf16", 64, 2, 8, 2, 1000, 1000, "bhsd"),
    ("causal", "fp16", 32, 1, 4, 1, 129, 513, "bhsd"),
    ("none", "bf16", 64, 1, 3, 3, 77, 300, "bhsd"),
    ("document", "fp16", 64, 2, 2, 2, 384, 384, "bhsd"),
    ("softcap", "fp16", 32, 2, 4, 2, 511, 257, "bshd"),
    ("alibi", "bf16", 64, 1, 8, 8, 300, 300, "bhsd"),
    ("sliding_window", "bf16", 32, 1, 4, 2, 700, 700, "bhsd"),
]


@pytest.mark.parametrize("case", TILE128, ids=lambda c: "-".join(map(str, c)))
def test_tile_m_128(case):
    _check_listed(case, TILE128, tile_m=128)


# Head dims beyond 128 (BwdConfig.split_head_dim: 64-key CTAs, the warpgroups splitting
# dK, dV and dQ over the head dim, P^T / dS^T through shared memory; one Q / dO stage at
# 256). (case, dtype, D, B, Hq, Hkv, Q, KV, layout)
WIDE = [
    ("none", "bf16", 256, 1, 4, 2, 300, 333, "bhsd"),
    ("causal", "bf16", 192, 2, 4, 2, 700, 700, "bhsd"),
    ("causal", "fp16", 256, 1, 2, 1, 129, 513, "bshd"),        # MQA, kv blocks nobody sees
    ("sliding_window", "bf16", 256, 1, 4, 2, 700, 650, "bhsd"),  # 64-key CTAs under 128-key blocks
    ("document", "fp16", 192, 2, 2, 2, 384, 390, "bhsd"),
    ("alibi", "bf16", 256, 1, 4, 4, 300, 300, "bhsd"),         # slope gradients
    ("causal_relative_bias", "bf16", 192, 1, 4, 2, 400, 450, "bhsd"),  # per-thread diagonal adds
    ("window_document_alibi_softcap", "bf16", 160, 1, 4, 2, 500, 500, "bhsd"),
    ("softcap", "fp16", 224, 2, 4, 2, 511, 257, "bshd"),
    ("none", "bf16", 144, 1, 1, 1, 1, 1, "bhsd"),              # one element
]


@pytest.mark.parametrize("case", WIDE, ids=lambda c: "-".join(map(str, c)))
def test_head_dims_beyond_128(case):
    _check_listed(case, WIDE)


# The swapped layout (BwdConfig.dkv_swap: dK^T / dV^T), tile_n forced: 96-key CTAs at
# 192/192 (one Q / dO stage here; the planner runs FA4's rings there, 192/128 two stages:
# test_head_dims_gpu) — dense and causal, KV_LEN inside a CTA, GQA / MQA, slope gradients,
# a score mod, one element; 48-key CTAs at 256 (FA4's tile there, not planned: slower).
# "q2do1": two Q stages, one dO stage, one dS^T buffer (FA4's rings at 192/192 and 256;
# not planned until measured). (case..., tile_n, rings)
SWAPPED = [
    ("none", "fp16", 192, 1, 4, 1, 1000, 777, "bhsd", 96, ""),
    ("alibi", "bf16", 192, 2, 4, 2, 300, 300, "bshd", 96, ""),
    ("causal_softcap", "bf16", 192, 1, 4, 2, 97, 97, "bhsd", 96, ""),
    ("causal", "bf16", 192, 1, 2, 2, 1, 1, "bhsd", 96, ""),
    ("causal_softcap", "bf16", 256, 1, 4, 2, 333, 333, "bhsd", 48, ""),
    ("alibi", "fp16", 256, 2, 2, 1, 200, 150, "bshd", 48, ""),
    ("causal_softcap", "bf16", 192, 1, 4, 2, 333, 333, "bhsd", 96, "q2do1"),
    ("none", "fp16", 192, 2, 4, 1, 300, 777, "bshd", 96, "q2do1"),
    ("alibi", "bf16", 256, 1, 4, 2, 200, 250, "bhsd", 48, "q2do1"),
    ("causal", "bf16", 256, 1, 2, 2, 1, 1, "bhsd", 48, "q2do1"),
]
RINGS = {"": {}, "q2do1": dict(num_stages=2, do_stages=1, ds_buffers=1)}


@pytest.mark.parametrize("case", SWAPPED, ids=lambda c: "-".join(map(str, c)))
def test_swapped_layout(case):
    *listed, tile_n, rings = case
    _check_listed(tuple(listed), [tuple(c[:-2]) for c in SWAPPED], tile_n=tile_n, **RINGS[rings])


# Issue 25's head-dim-256 candidates (FA4's choices there; BwdConfig.dkv_rows / tail_order
# and 80-key swapped tiles; the first and third planned, bwd.plan.SWAP_PLANNED; all 12 cases
# passed on the H200, 2026-11-28): (D, Dv, BwdConfig fields)
CANDIDATES_256 = [
    (256, 256, dict(tile_n=48, num_stages=2, do_stages=1, ds_buffers=1, dkv_rows=True, tail_order="dv_first")),
    (256, 128, dict(tile_n=48, num_stages=2, do_stages=1, ds_buffers=1, dkv_rows=True, tail_order="dv_first")),
    (256, 128, dict(tile_n=80, num_stages=2, do_stages=1, ds_buffers=1, dkv_rows=True, tail_order="dv_first")),
    (256, 256, dict(tile_n=64, tail_order="dv_first")),
    (256, 128, dict(tile_n=64, num_stages=2, do_stages=1)),
    (256, 128, dict(tile_n=64, num_stages=2, do_stages=1, tail_order="dv_first")),
    # value head dim 256 beside 128 (the transposed pair)
    (128, 256, dict(tile_n=80, num_stages=2, do_stages=1, ds_buffers=1, dkv_rows=True, tail_order="dv_first")),
    (128, 256, dict(tile_n=48, num_stages=2, do_stages=1, ds_buffers=1, dkv_rows=True, tail_order="dv_first")),
    # FA4's 192/192 layout (96 keys split by warpgroup, one dO stage, dV's GEMM first; planned
    # since session 38: bench_bwd_layouts.py's swap96-q2do1-dvfirst), and at 192/128 (not planned)
    (192, 192, dict(tile_n=96, num_stages=2, do_stages=1, ds_buffers=1, tail_order="dv_first")),
    (192, 192, dict(tile_n=96, num_stages=2, do_stages=1, ds_buffers=1, tail_order="dv_first", p_early=True)),
    (192, 128, dict(tile_n=96, num_stages=2, do_stages=1, ds_buffers=1, tail_order="dv_first")),
]


@pytest.mark.parametrize("D,Dv,fields", CANDIDATES_256, ids=lambda c: str(c).replace(" ", ""))
@pytest.mark.parametrize("name", ["causal_softcap", "alibi"])
def test_head_dim_256_candidates(D, Dv, fields, name):
    """The head-dim-256 backward candidates, forced, against the float64 reference: GQA,
    KV_LEN inside a CTA, q rows past a tile, a score mod (ALiBi: slope gradients)."""
    cfg = _check_wide(name, D, Dv, D * 7 + Dv + fields["tile_n"], **fields)
    assert (cfg.tile_n, cfg.dkv_rows, cfg.tail_order) == (fields["tile_n"], fields.get("dkv_rows", False),
                                                          fields.get("tail_order", "dq_first"))


def _check_wide(name, D, Dv, seed, **fields):
    """One backward with these BwdConfig fields against the float64 reference: bf16, GQA,
    KV_LEN inside a CTA, q rows past a tile, the mods of case ``name``. -> its config."""
    torch.manual_seed(seed)
    B, Hq, Hkv, Q, KV = 1, 4, 2, 300, 333
    q, k = torch.randn(B, Hq, Q, D, device="cuda", dtype=torch.bfloat16), \
        torch.randn(B, Hkv, KV, D, device="cuda", dtype=torch.bfloat16)
    v, do = torch.randn(B, Hkv, KV, Dv, device="cuda", dtype=torch.bfloat16), \
        torch.randn(B, Hq, Q, Dv, device="cuda", dtype=torch.bfloat16)
    mask, score = _case_mods(name, np.random.default_rng(D + Dv), B, Hq, Q, KV)
    spec = AttentionSpec.from_args(score=score, mask=mask, enable_gqa=True)
    dq, dk, dv, _, _, _, cfg = kernel_backward(q, k, v, do, spec, **fields)
    want = reference.backward(q.cpu(), k.cpu(), v.cpu(), do.cpu(), None, spec=spec)
    label = f"{name} {D}/{Dv} {fields}"
    _close(f"{label} dq", dq, want.dq, "bf16")
    _close(f"{label} dk", dk, want.dk, "bf16")
    _close(f"{label} dv", dv, want.dv, "bf16")
    return cfg


@pytest.mark.parametrize("D,Dv", [(192, 128), (128, 192), (192, 64)])
@pytest.mark.parametrize("name", ["causal_softcap", "none"])
def test_swapped_layout_value_head_dims(D, Dv, name):
    """The swapped layout (96-key CTAs, two stages) at value head dims apart from the
    query's, each planned (bwd.plan.SWAP_PLANNED). GQA, KV_LEN inside a CTA, q rows past
    a tile."""
    cfg = _check_wide(name, D, Dv, D * 7 + Dv, tile_n=96)
    assert cfg.dkv_swap and cfg.num_stages == 2


# Idle warpgroups on visits whose mask hides all their keys (BwdConfig.idle_masked_keys:
# planned since session 39 wherever idle_keys_allowed; forced on here): the causal
# diagonal's first visit, a band's edges. GQA / MQA, KV_LEN and Q_LEN inside tiles, score
# mods. (case, dtype, D, B, Hq, Hkv, Q, KV, layout)
IDLE = [
    ("causal", "bf16", 128, 2, 4, 2, 1000, 1000, "bhsd"),
    ("causal", "fp16", 96, 1, 4, 1, 129, 513, "bhsd"),
    ("causal", "bf16", 64, 2, 4, 2, 777, 777, "bhsd"),   # 128-row visits: compiled in, never taken (causal)
    ("sliding_window", "bf16", 64, 1, 2, 1, 900, 900, "bshd"),   # ... taken at the band's edges
    ("causal_softcap", "bf16", 128, 1, 4, 2, 511, 700, "bshd"),
    ("torch_style_causal_softcap", "bf16", 128, 1, 2, 2, 300, 300, "bhsd"),
    ("sliding_window", "bf16", 128, 1, 4, 2, 700, 700, "bhsd"),
    ("band", "fp16", 128, 2, 2, 2, 640, 650, "bhsd"),
]


@pytest.mark.parametrize("case", IDLE, ids=lambda c: "-".join(map(str, c)))
def test_idle_masked_keys(case):
    """Against the float64 reference (check_case), with idle warpgroups forced."""
    _check_listed(case, IDLE, idle_masked_keys=True)


@pytest.mark.parametrize("name,fields", [("causal", dict(deterministic=True)), ("sliding_window", {}),
                                         ("sliding_window", dict(tile_m=80))])
def test_idle_masked_keys_bitwise(name, fields):
    """P and dS are exactly 0 where a warpgroup idles, so dK and dV equal the full step's
    bit for bit, and so does dQ in the deterministic mode (causal; a band there walks block
    lists); elsewhere dQ's adds land in another order. tile_m 80: the transposed dQ."""
    torch.manual_seed(7)
    B, Hq, Hkv, Q, KV, D = 1, 4, 2, 1100, 1100, 128
    q, do = (torch.randn(B, Hq, Q, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, Hkv, KV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = mods.causal() if name == "causal" else mods.sliding_window(300)
    spec = AttentionSpec.from_args(mask=mask, enable_gqa=True)
    *want, _, _, _, cfg = kernel_backward(q, k, v, do, spec, idle_masked_keys=False, **fields)
    *got, _, _, _, idle_cfg = kernel_backward(q, k, v, do, spec, idle_masked_keys=True, **fields)
    assert idle_cfg.idle_masked_keys and not cfg.idle_masked_keys and (cfg.causal or cfg.band)
    for label, a, b in zip(("dq", "dk", "dv"), got[:3], want[:3]):
        if label == "dq" and not fields.get("deterministic"):
            assert (a.float() - b.float()).abs().max() <= 1e-2 * b.float().abs().max(), (name, fields)
        else:
            assert torch.equal(a, b), (name, label, (a.float() - b.float()).abs().max().item())


# Clusters of 2 CTAs (kv blocks 2c, 2c + 1) sharing Q / dO loads by TMA multicast: dense
# only, an even number of 128-key blocks. (case, dtype, D, B, Hq, Hkv, Q, KV, layout)
CLUSTER = [
    ("none", "bf16", 128, 2, 4, 4, 256, 256, "bhsd"),
    ("none", "fp16", 128, 2, 8, 2, 1000, 1000, "bshd"),        # GQA 4:1, 80-row tiles
    ("none", "bf16", 64, 1, 3, 3, 77, 500, "bhsd"),            # 64-row tiles, partial q tile
    ("softcap", "bf16", 128, 2, 4, 2, 333, 500, "bhsd"),
    ("alibi", "bf16", 128, 1, 8, 8, 300, 512, "bhsd"),         # slope gradients
    ("bias", "fp16", 64, 1, 2, 2, 130, 256, "bhsd"),           # dense bias gradient
    ("relative_bias", "bf16", 64, 2, 4, 2, 250, 250, "bhsd"),  # per-diagonal sums
]


@pytest.mark.parametrize("case", CLUSTER, ids=lambda c: "-".join(map(str, c)))
def test_cluster(case):
    _check_listed(case, CLUSTER, cluster_n=2)


# Persistent CTAs (BwdConfig.max_ctas): 3 of them, so each walks many kv tiles (K / V
# reloaded while the previous tile's dK / dV leave through sdQ / sdS — `dkv_staged_apart`;
# through sK / sV, then reloaded, in the split and swapped layouts — the Q / dO ring and the
# dQ writer's handshakes running on across tiles), and an H100's 132. Bands, block lists,
# causal, dense 80-row tiles, GQA, kv tiles nobody visits, per-diagonal sums across tiles,
# head dims beyond 128 (split and swapped layouts). (case..., tile_n or None)
PERSISTENT = [
    ("sliding_window", "bf16", 128, 1, 4, 2, 700, 700, "bhsd", None),
    ("document", "fp16", 64, 2, 2, 2, 384, 384, "bhsd", None),
    ("document_batched", "bf16", 128, 2, 4, 4, 300, 300, "bhsd", None),
    ("causal", "bf16", 128, 2, 8, 2, 1000, 1000, "bhsd", None),
    ("causal", "fp16", 128, 1, 4, 1, 129, 513, "bhsd", None),     # kv blocks nobody sees
    ("none", "fp16", 128, 2, 8, 2, 1000, 1000, "bshd", None),     # 80-row tiles, GQA 4:1
    ("causal_relative_bias", "bf16", 128, 1, 4, 2, 777, 900, "bhsd", None),  # sDiag across tiles
    ("window_document_alibi_softcap", "bf16", 64, 1, 4, 2, 500, 500, "bhsd", None),
    ("sliding_window", "bf16", 256, 1, 4, 2, 700, 650, "bhsd", None),   # split layout
    ("causal_softcap", "bf16", 192, 1, 4, 2, 333, 333, "bhsd", 96),     # swapped layout
]


@pytest.mark.parametrize("ctas", [3, 132])
@pytest.mark.parametrize("case", PERSISTENT, ids=lambda c: "-".join(map(str, c)))
def test_persistent(case, ctas):
    *listed, tile_n = case
    extra = {} if tile_n is None else {"tile_n": tile_n}
    _check_listed(tuple(listed), [tuple(c[:-1]) for c in PERSISTENT], max_ctas=ctas, **extra)


# BwdConfig.dq_finish (the main kernel stores dQ; not planned, measured slower): q tiles no
# CTA visits (the preprocess zeroes their empty rows) — a mask on the first rows only, a band
# whose edges may leave rows empty — a band with Q != KV, head dim 96, GQA; and the default
# postprocess path on the same shapes.
FINISH = [
    ("first_rows", "bf16", 128, 2, 4, 2, 300, 333, "bhsd"),
    ("first_rows", "fp16", 64, 1, 2, 1, 700, 129, "bshd"),
    ("band", "bf16", 128, 2, 4, 2, 500, 420, "bhsd"),
    ("band", "fp16", 64, 1, 4, 4, 333, 700, "bshd"),
    ("sliding_window", "bf16", 128, 1, 8, 2, 1000, 777, "bhsd"),
    ("causal_softcap", "bf16", 96, 1, 4, 2, 400, 400, "bhsd"),
    ("document", "bf16", 128, 2, 4, 2, 640, 640, "bhsd"),
]


@pytest.mark.parametrize("finish", [True, False])
@pytest.mark.parametrize("case", FINISH, ids=lambda c: "-".join(map(str, c)))
def test_dq_finish(case, finish):
    _check_listed(case, FINISH, dq_finish=finish)


# Programmatic dependent launch (BwdConfig.pdl; not planned, measured neutral): the main
# kernel and the postprocess take SMs while the kernel before them drains and wait for it
# before reading its results. A band, block lists, buffer gradients with per-diagonal sums
# and a score mod, each as the default, the deterministic and the persistent kernel.
PDL = [
    ("sliding_window", "bf16", 128, 1, 4, 2, 700, 700, "bhsd"),
    ("document", "fp16", 64, 2, 2, 2, 384, 384, "bhsd"),
    ("causal_relative_bias", "bf16", 128, 1, 4, 2, 777, 900, "bhsd"),
    ("causal_softcap", "bf16", 128, 2, 4, 4, 400, 400, "bshd"),
]


@pytest.mark.parametrize("kind", [{}, {"deterministic": True}, {"max_ctas": 132}],
                         ids=["default", "deterministic", "persistent"])
@pytest.mark.parametrize("case", PDL, ids=lambda c: "-".join(map(str, c)))
def test_pdl(case, kind):
    _check_listed(case, PDL, pdl=True, **kind)


def _random_cases(n, seed=4321):
    """Random shapes for the (mod, dtype, head dim) combinations of FIXED only (so they
    compile nothing FIXED does not): batch, heads and GQA ratio, lengths 1..900 (Q != KV
    in most), layout; test_random adds a random scale to some."""
    rng = np.random.default_rng(seed)
    combos = sorted({(name, dtype_name, D) for name, dtype_name, D, *_ in FIXED})
    out = []
    for _ in range(n):
        name, dtype_name, D = combos[int(rng.integers(len(combos)))]
        hkv = int(rng.choice([1, 2, 3]))
        q_len = int(rng.integers(1, 901))
        kv_len = q_len if rng.random() < 0.3 else int(rng.integers(1, 901))
        out.append((name, dtype_name, D, int(rng.integers(1, 4)),
                    hkv * int(rng.choice([1, 2, 4])), hkv, q_len, kv_len,
                    str(rng.choice(["bhsd", "bshd"]))))
    return out


RANDOM = _random_cases(130)


@pytest.mark.parametrize("i", range(len(RANDOM)), ids=lambda i: "-".join(map(str, RANDOM[i])))
def test_random(i):
    name, dtype_name, D, B, Hq, Hkv, Q, KV, layout = RANDOM[i]
    rng = np.random.default_rng(i)
    mask, score, _, _ = CASES[name](rng, B, Hq, Q, KV)
    scale = float(rng.uniform(0.05, 0.3)) if rng.random() < 0.3 else None
    check_case(name, dtype_name, D, B, Hq, Hkv, Q, KV, mask, score, scale=scale,
               layout=layout, seed=100 + i)


def test_lse_gradient():
    """dLSE enters through delta (preprocess)."""
    rng = np.random.default_rng(7)
    mask, score, _, _ = CASES["causal_softcap"](rng, 1, 2, 300, 300)
    check_case("dlse", "bf16", 128, 1, 2, 2, 300, 300, mask, score, with_dlse=True)


def test_dk_dv_deterministic():
    """dK/dV are summed in registers by one CTA (GQA heads included): bitwise repeatable."""
    torch.manual_seed(3)
    q, do = (torch.randn(1, 8, 500, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, 2, 500, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    spec = AttentionSpec.from_args(mask=mods.causal(), enable_gqa=True)
    first = kernel_backward(q, k, v, do, spec)
    again = kernel_backward(q, k, v, do, spec)
    assert torch.equal(first[1], again[1]) and torch.equal(first[2], again[2])


# Deterministic mode (BwdConfig.deterministic): dQ tiles added in a fixed order per q tile,
# buffer gradients summed exactly in fixed point. (case, dtype, D, B, Hq, Hkv, Q, KV)
DETERMINISTIC = [
    ("causal", "bf16", 128, 2, 8, 2, 1000, 1000),              # built-in causal, GQA 4:1
    ("none", "fp16", 64, 1, 4, 1, 640, 900),                   # dense, MQA, Q < KV
    ("sliding_window", "bf16", 128, 1, 4, 2, 700, 700),        # block-sparse, GQA
    ("window_document_alibi_softcap", "bf16", 64, 2, 4, 2, 500, 500),  # sparse + slope grads
    ("relative_bias", "fp16", 64, 2, 4, 2, 250, 250),          # table grads, GQA
    ("causal_relative_bias", "bf16", 128, 1, 4, 2, 777, 900),  # per-diagonal sums
    ("bias", "fp16", 64, 1, 2, 2, 130, 140),                   # dense bias grads
    ("none", "bf16", 128, 2, 4, 2, 1000, 777),                 # 80-row tiles, GQA
    ("wide_relative_bias", "bf16", 128, 1, 4, 2, 333, 500, 80),  # 80 forced: per-thread adds
    # head dims beyond 128: 64-key CTAs count their turns (block-sparse: two per listed
    # 128-key block, one in the last of KV = 650)
    ("causal", "bf16", 192, 1, 4, 2, 600, 600),
    ("sliding_window", "bf16", 256, 1, 4, 2, 700, 650),
    ("relative_bias", "fp16", 192, 2, 4, 2, 250, 250),
]


@pytest.mark.parametrize("case", DETERMINISTIC, ids=lambda c: "-".join(map(str, c)))
def test_deterministic(case):
    """Three deterministic runs give bitwise-equal dq, dk, dv and buffer gradients, which
    match the float64 reference; dk, dv equal the default mode's, dq is within 2 ulp."""
    name, dtype_name, D, B, Hq, Hkv, Q, KV, *tile = case
    tile_m = tile[0] if tile else None         # None: the planner's
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    mask, score = _case_mods(name, rng, B, Hq, Q, KV)
    torch.manual_seed(200 + DETERMINISTIC.index(case))
    dtype = DTYPES[dtype_name]
    q, do = (torch.randn(B, Hq, Q, D, device="cuda", dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, Hkv, KV, D, device="cuda", dtype=dtype) for _ in range(2))
    spec = AttentionSpec.from_args(score=score, mask=mask, enable_gqa=True)
    label = f"{name} {dtype_name} D{D} B{B} Hq{Hq} Hkv{Hkv} Q{Q} KV{KV}"
    runs = [kernel_backward(q, k, v, do, spec, deterministic=True, tile_m=tile_m) for _ in range(3)]
    dq, dk, dv, grads = runs[0][:4]
    out = runs[0][5]
    label += f" tile_m {runs[0][6].tile_m}"
    for again in runs[1:]:
        for what, a, b in zip(("dq", "dk", "dv"), (dq, dk, dv), again[:3]):
            assert torch.equal(a, b), f"{label}: {what} differs between deterministic runs"
        for slot, (a, b) in enumerate(zip(grads, again[3])):
            assert (a is None) == (b is None)
            assert a is None or torch.equal(a, b), f"{label}: d_capture[{slot}] differs"

    want = reference.backward(q.cpu(), k.cpu(), v.cpu(), do.cpu(), None, spec=spec)
    _close(f"{label} dq", dq, want.dq, dtype_name)
    _close(f"{label} dk", dk, want.dk, dtype_name)
    _close(f"{label} dv", dv, want.dv, dtype_name)
    if any(g is not None for g in want.d_captures):
        want = reference.backward(q.cpu(), k.cpu(), v.cpu(), do.cpu(), None, spec=spec,
                                  out=out.cpu())
        for slot, ref in enumerate(want.d_captures):
            if ref is not None:
                assert grads[slot] is not None, f"{label}: no kernel gradient for capture {slot}"
                _close(f"{label} d_capture[{slot}]", grads[slot], ref, dtype_name)

    # Against the default mode: the same sums in another order (dQ: the adds of the CTAs;
    # dK/dV: the default mode rotates each CTA's q-block walk, except under causal), i.e.
    # at most a rounding of the final bf16/fp16 value apart.
    default = kernel_backward(q, k, v, do, spec, tile_m=tile_m)
    ulp = 2.0 ** (-7 if dtype_name == "bf16" else -10)
    for what, a, b in (("dq", dq, default[0]), ("dk", dk, default[1]), ("dv", dv, default[2])):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 2 * ulp * a.float().abs().max().item(), f"{label}: {what} vs default {err:.3g}"
    if name == "causal":                  # no rotation: bitwise the same
        assert torch.equal(dk, default[1]) and torch.equal(dv, default[2]), label


def test_new_values_never_recompile():
    """Softcap values and relative-bias tables are runtime args."""
    torch.manual_seed(4)
    q, k, v, do = (torch.randn(1, 2, 200, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    counts = []
    for cap in (2.0, 7.0):
        table = np.random.default_rng(int(cap)).standard_normal((2, 9)).astype(np.float32)
        score = mods.relative_bias(table) >> mods.softcap(cap)
        spec = AttentionSpec.from_args(score=score)
        fwd_cfg = kernel_backward(q, k, v, do, spec)[4]
        counts.append(_runner(config_from_forward(fwd_cfg)).num_compiled)
    assert counts[0] == counts[1] == 3
