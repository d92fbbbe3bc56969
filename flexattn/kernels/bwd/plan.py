"""The backward planned from the forward: its config (``config_from_forward``: same dtype,
head dim, block structure and mods; ``choose_tile_m``) and the workspace the caller
allocates for it (``workspace_shapes``, ``workspace_dtypes``): lse_log2, delta and the fp32
dQ accumulator, padded to whole q tiles; deterministic: the dQ turn semaphores and the
fixed-point buffer-gradient accumulators. The launch itself: ``launch/backward.py``."""

import dataclasses
import os

from flexattn.kernels.bwd.sm90 import (FP32_TILE_M, BwdConfig, dkv_swap_allowed, finish_allowed, idle_keys_allowed,
                                       one_diagonal_read)
from flexattn.kernels.hopper.atomics import FIXED_WORDS


# 3xTF32's A/B variables (error studies, benchmarks/fp32_error_study.py): BwdConfig field,
# environment variable, the field's value from the variable's text.
_FP32_AB = (
    ("chain_promote", "FLEXATTN_BWD_CHAIN_PROMOTE", int),     # S^T / dP^T's chains in other pieces
    ("dq_promote", "FLEXATTN_BWD_DQ_PROMOTE", int),           # likewise dQ's
    ("dkv_pieces", "FLEXATTN_BWD_DKV_PIECES", int),           # dK / dV's column pieces
)


def config_from_forward(fwd_cfg, **overrides) -> BwdConfig:
    """The backward config for a forward config (same dtype, head dim, block structure and
    mods): what `kernel_path.plan_forward` chose for the forward applies to the backward.
    `overrides`: other BwdConfig fields, e.g. deterministic=True; tile_m, unless given,
    is `choose_tile_m`'s; idle_masked_keys, unless given, on wherever `idle_keys_allowed`
    (FLEXATTN_BWD_IDLE_KEYS=0: off, for A/B runs); dq_finish, unless given, off
    (FLEXATTN_DQ_FINISH=1: wherever it applies, `finish_allowed`, for A/B runs; measured
    slower); pdl, unless given, off (FLEXATTN_BWD_PDL=1, 16-bit dtypes, for A/B runs;
    measured neutral); dq_first_store, unless given, on for the unordered 16-bit dQ adds
    (FLEXATTN_DQ_FIRST_STORE=0: off, =data: dq_ticket_on_data, for A/B runs);
    partial_blocks off where the forward walks full blocks alone (FLEXATTN_BWD_FULL_ONLY=0: both walks, for A/B runs)."""
    kw = dict(dtype=fwd_cfg.dtype, head_dim=fwd_cfg.head_dim, head_dim_v=fwd_cfg.head_dim_v,
              causal=fwd_cfg.causal, block_sparse=fwd_cfg.block_sparse, band=fwd_cfg.band, mods=fwd_cfg.mods,
              tf32_passes=getattr(fwd_cfg, "tf32_passes", 1))   # (a 16-bit config stand-in may lack it)
    kw.update(overrides)
    if kw["dtype"] == "fp32" and "tile_m" not in kw:
        kw["tile_m"] = fp32_tile_m(kw["head_dim"], kw["head_dim_v"])   # before the stages are derived
    if kw["band"] and kw.get("deterministic"):
        # Deterministic dQ turns count visitors from the lists: the band's block mask's.
        kw.update(band=False, block_sparse=True)
    cfg = BwdConfig(**kw)
    if "tile_m" not in overrides:
        tile_m = 64 if cfg.dq_finish else choose_tile_m(cfg)     # (dq_finish asked for: its tiles)
        if tile_m != cfg.tile_m:
            cfg = dataclasses.replace(cfg, tile_m=tile_m)
    if "tile_n" not in overrides:
        cfg = with_swapped_layout(cfg)
    if "dq_finish" not in overrides and finish_allowed(cfg) and os.environ.get("FLEXATTN_DQ_FINISH") == "1":
        # dQ stored by the main kernel, no postprocess (bwd/sm90.py, BwdConfig.dq_finish):
        # measured slower (docs/experiments.md, session 29), so only for A/B runs.
        cfg = dataclasses.replace(cfg, dq_finish=True)
    if ("idle_masked_keys" not in overrides and os.environ.get("FLEXATTN_BWD_IDLE_KEYS") != "0"
            and idle_keys_allowed(cfg)):
        # Idle warpgroups on visits that mask all their keys (BwdConfig.idle_masked_keys):
        # window1024 / causal fwd+bwd kernels 1-2% faster at D128 and D96 (H200, session 39,
        # docs/experiments.md). FLEXATTN_BWD_IDLE_KEYS=0 leaves it off, for A/B runs.
        cfg = dataclasses.replace(cfg, idle_masked_keys=True)
    first_store = os.environ.get("FLEXATTN_DQ_FIRST_STORE")
    if ("dq_first_store" not in overrides and cfg.dtype != "fp32" and not (cfg.deterministic or cfg.dq_finish)
            and first_store != "0"):
        # Each dQ tile's first visit stores it; the preprocess zeroes only unvisited rows
        # (BwdConfig.dq_first_store; "data": its ticket drawn once the visit's dQ is staged).
        # With the acquiring ticket (a visit that sees the store published does not spin):
        # kernel sums -5.4% document4 B8 S2048, -3.7% B4 S4096, -2.7% window1024 B2 S8192;
        # door fwd+bwd 0.959 / 0.976 / 0.987 on document4's three shapes (H200, session 57).
        cfg = dataclasses.replace(cfg, dq_first_store=True, dq_ticket_on_data=first_store == "data")
    if ("partial_blocks" not in overrides and not getattr(fwd_cfg, "partial_blocks", True)
            and cfg.block_sparse and os.environ.get("FLEXATTN_BWD_FULL_ONLY") != "0"):
        # Lists known to hold no partial block (the forward's FwdConfig.partial_blocks): the
        # full q-block list alone, one copy of the step fewer: ~1 s less compile, the step
        # 0.98-1.005x (H200, session 55). FLEXATTN_BWD_FULL_ONLY=0 keeps both walks, for A/B runs.
        cfg = dataclasses.replace(cfg, partial_blocks=False)
    if cfg.tf32_passes == 3:
        for field, variable, value in _FP32_AB:
            text = os.environ.get(variable)
            if field not in overrides and text:
                cfg = dataclasses.replace(cfg, **{field: value(text)})
    if "pdl" not in overrides and cfg.dtype != "fp32" and os.environ.get("FLEXATTN_BWD_PDL") == "1":
        # The main kernel and the postprocess as programmatic dependents (BwdConfig.pdl):
        # measured neutral (docs/experiments.md, session 30), so only for A/B runs.
        cfg = dataclasses.replace(cfg, pdl=True)
    return cfg


# Head dims the planner gives the swapped layout (`BwdConfig.dkv_swap`), each with the
# fields that measured fastest in forced A/Bs (benchmarks/bench_bwd_layouts.py, causal
# B4 S4096 H16 fwd+bwd kernels, ms, the 64-key split layout -> the planned one):
# - 192/128 (DeepSeek's) 3.53-3.65 -> 2.75, 128/192 2.77 -> 2.52, 192/64 3.52-3.54 ->
#   2.63: 96-key CTAs, the warpgroups splitting the keys, two Q / dO stages (H100,
#   2026-11-27; with one stage, at 192/192, the split layout's two stages won: 3.81-3.88
#   against 4.03-4.06);
# - 256/128 5.51-5.63 -> 3.56-3.57 (80 keys) and 256/256 5.81-6.07 -> 5.10-5.18 (48 keys):
#   FA4's layout there, the warpgroups splitting dK^T / dV^T by head-dim rows, two Q stages
#   and one dO stage, one dS^T buffer, dV's GEMM first (H200, 2026-11-28; splitting by keys
#   instead at 48: 6.8-7.2, slower than the split layout);
# - 192/192 3.48-3.54 -> 3.22: FA4's layout there, 96-key CTAs split by keys, two Q stages,
#   one dO stage, one dS^T buffer, dV's GEMM first, so the one dO slot frees as soon as dV's
#   GEMM retires (H200, 2026-11-29; the same rings with dQ first: 4.00-4.21; storing P^T
#   during dP, `p_early`: 3.18-3.23, within noise, not planned).
SWAP_PLANNED = {
    (192, 128): dict(tile_n=96, num_stages=2),
    (128, 192): dict(tile_n=96, num_stages=2),
    (192, 64): dict(tile_n=96, num_stages=2),
    (192, 192): dict(tile_n=96, num_stages=2, do_stages=1, ds_buffers=1, tail_order="dv_first"),
    (256, 128): dict(tile_n=80, num_stages=2, do_stages=1, ds_buffers=1, dkv_rows=True, tail_order="dv_first"),
    (256, 256): dict(tile_n=48, num_stages=2, do_stages=1, ds_buffers=1, dkv_rows=True, tail_order="dv_first"),
}


def with_swapped_layout(cfg: BwdConfig) -> BwdConfig:
    """Head dims beyond 128: the swapped layout where it is planned (SWAP_PLANNED) and
    allowed for this call's structure and mods (`dkv_swap_allowed`: dense or causal walks,
    not deterministic, shared memory fits); else `cfg` as it is (the 64-key split layout)."""
    if cfg.dtype == "fp32" or not cfg.split_head_dim:
        return cfg
    fields = SWAP_PLANNED.get((cfg.head_dim, cfg.head_dim_v))
    if fields is not None and dkv_swap_allowed(_Probe(cfg, fields)):
        return dataclasses.replace(cfg, **fields)
    return cfg


class _Probe:
    """`cfg`'s fields with `fields` in place (dkv_swap_allowed and split_shared_bytes read
    fields only; a BwdConfig would check itself on construction)."""

    def __init__(self, cfg, fields):
        self._cfg = cfg
        self.__dict__.update(fields)

    def __getattr__(self, name):
        return getattr(self._cfg, name)


def choose_tile_m(cfg: BwdConfig) -> int:
    """q rows per visit: 80 (FA3/FA4's tile for dense non-causal head dim 128; dQ is then
    computed transposed, `BwdConfig.dq_swap_ab`) where it applies; 128 at head dims up to
    64 without a score mod (FA3's 128 x 128 there: half the visits, each K / V tile reused
    over twice the rows; causal fwd+bwd B4 S4096 H16 on the H100, 2026-11-27: D32 271.7 ->
    284.7 TFLOP/s, D64 408.0 -> 421.2), except block lists beyond 32 (a document mask's
    reads spill there, as a score mod's do); else 64: causal and block-sparse walks keep
    64 at wider heads (as FA4: diagonal tiles, 128-row BlockMask blocks), and so does a
    relative-position table's gradient (`bwd.sm90.one_diagonal_read`), whose per-diagonal
    shared-memory sums only fit next to 64-row tiles. A band runs 80 too (BwdConfig allows
    it) but stays at 64: window1024 fwd+bwd at 80 took 2-5% longer (H100, 2026-11-27: the
    band's two partial edges span more 80-row tiles)."""
    if cfg.dtype == "fp32":
        return fp32_tile_m(cfg.head_dim, cfg.head_dim_v)
    if cfg.split_head_dim:
        return 64
    if cfg.head_dim == cfg.head_dim_v == 128 and not (cfg.causal or cfg.block_sparse or cfg.band
                                                      or one_diagonal_read(cfg)):
        return 80
    widest = max(cfg.head_dim, cfg.head_dim_v)
    if widest <= 64 and not cfg.mods.has_score and not (cfg.block_sparse and widest > 32):
        return 128
    return 64


def fp32_tile_m(head_dim: int, head_dim_v: int) -> int:
    """The float32 kernel's q rows per visit: 32 (the accumulators stay small at every head
    dim); 64 where dQ's GEMM needs it (head dims not multiples of 32:
    bwd/tf32_sync.warp_layouts)."""
    return FP32_TILE_M if head_dim % 32 == 0 and head_dim_v % 32 == 0 else 64


def padded_len(q_len: int, cfg: BwdConfig) -> int:
    return -(-q_len // cfg.q_pad) * cfg.q_pad


def buffer_grad_shapes(hook) -> tuple:
    """Shapes of the buffer-gradient arrays of a hook (its float captures read by the score
    mod, `hook.grad_slots`; 0-d captures as [1])."""
    import numpy as np

    captures = hook.captures()
    return tuple(tuple(int(n) for n in np.shape(captures[s])) or (1,) for s in hook.grad_slots)


def workspace_shapes(cfg: BwdConfig, batch: int, q_heads: int, q_len: int,
                     grad_shapes: tuple = None) -> dict:
    """The workspace arrays, name -> shape, in argument order; their dtypes are
    `workspace_dtypes(cfg)` (same names: all float32 unless deterministic). Contents need
    not be initialized; contiguous. `grad_shapes`: the buffer gradients' shapes (default:
    `buffer_grad_shapes(cfg.mods)`), used only by deterministic configs with buffer grads."""
    sp = padded_len(q_len, cfg)
    out = {"lse_log2": (batch, q_heads, sp), "delta": (batch, q_heads, sp),
           "dq_accum": (batch, q_heads, sp, cfg.head_dim)}
    if cfg.dq_flags:
        out["dq_semaphore"] = (batch, q_heads, sp // cfg.tile_m)
    if cfg.deterministic:
        if cfg.buffer_grads:
            shapes = buffer_grad_shapes(cfg.mods) if grad_shapes is None else grad_shapes
            out["grad_fixed"] = (max(sum(_numel(s) for s in shapes), 1), FIXED_WORDS)
    return out


def workspace_dtypes(cfg: BwdConfig) -> dict:
    """dtype name ("float32" | "int32" | "int64") of each `workspace_shapes` entry."""
    out = {"lse_log2": "float32", "delta": "float32", "dq_accum": "float32"}
    if cfg.dq_flags:
        out["dq_semaphore"] = "int32"
    if cfg.deterministic:
        if cfg.buffer_grads:
            out["grad_fixed"] = "int64"
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
