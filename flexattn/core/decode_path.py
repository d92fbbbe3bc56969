"""The GPU decode path: plan and launch the split-KV decode kernel for a step.

Framework-neutral and destination-passing, like ``kernel_path.forward_into``: the adapter
allocates ``out``/``lse``, supplies a ``Device`` (stream, host→GPU copies), the SM count
(read by the adapter, never while a kernel is traced) and a ``DecodeWorkspace`` (the fp32
split partials, the kernel's arrival tickets, the per-step upload of lengths/offsets).
Everything the kernel cannot do is refused before anything compiles.

Per step, on the host:
* the cache's lengths (host copy) give each sequence's query offset (``len - q_len``);
  the mods are rewritten to true positions with those offsets as runtime buffers
  (``mods.positions.shift_queries``) — new values, same structure: nothing recompiles;
  the kernel bounds keys by the per-batch length itself, so no ``limit_keys`` term;
* ``choose_splits``: how many splits of the kv range fill the GPU (see there);
* one launch: the last split CTA of each group merges the splits (``fused_combine``,
  ``decode_sm90``), counting arrivals in the workspace's tickets;
* lengths and offsets go to the GPU as one int32 array through ``workspace.upload``
  (asynchronous: the host plans the next step while the GPU runs this one).

No mask analysis runs on the host: the kernel skips the leading kv blocks its mask
provably excludes (a sliding window skips the cache's head) by interval analysis on the
GPU (``decode_sm90``); blocks at or past each sequence's length are never visited either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..arrays import dtype_name
from ..mods import as_mask, as_score
from ..mods.positions import shift_queries
from .kernel_path import KERNEL_DTYPES, KERNEL_HEAD_DIMS, Device, use_tvm_ffi

DECODE_MAX_Q_LEN = 16      # longer query blocks take the ordinary forward kernel
PAGE_TILE = 128            # page sizes are checked against this tile: then every tile_n
                           # the tuning picks (64 or 128) reads them in place
MIN_KEYS_PER_SPLIT = 512   # below that a split's fixed costs (Q load, epilogue, its share
                           # of the combine) outweigh the parallelism it adds


@dataclass(frozen=True)
class DecodeTuning:
    """The kernel shape of a decode step (see ``decode_sm90.DecodeConfig``)."""

    tile_n: int = 128          # kv rows per pipeline stage
    num_stages: int = 3        # K/V ring depth
    ctas_per_sm: int = 1       # resident CTAs per SM the kernel is sized for
    waves: int = 1             # CTAs per resident slot the splits heuristic aims for


# Measured on the H100 (benchmarks/RESULTS.md, decode sweep): 64-key tiles in a 2-stage
# ring (80 KB of shared memory), two CTAs per SM (128 KB of K/V in flight per SM), stream
# 2.84-3.07 TB/s (decode kernel alone) on every benchmark shape, contiguous and paged;
# 128-key tiles with one CTA per SM lose up to 0.1 TB/s on short caches and at B 1.
DEFAULT_TUNING = DecodeTuning(tile_n=64, num_stages=2, ctas_per_sm=2)
# Two consumer warpgroups (group x q_len > 64 rows) run one CTA per SM: a deeper ring.
ONE_CTA_TUNING = DecodeTuning(tile_n=64, num_stages=6, ctas_per_sm=1)


def choose_splits(batch: int, kv_heads: int, m_blocks: int, kv_blocks: int, num_sms: int,
                  tuning: DecodeTuning = DEFAULT_TUNING) -> int:
    """Number of kv splits per (batch, kv head, row block).

    A memory-bound step needs every SM streaming. ``batch * kv_heads * m_blocks`` CTAs
    exist without splitting; splitting multiplies them, up to ``num_sms * ctas_per_sm *
    waves`` (the resident CTA slots, times the waves the tuning aims for) — more would only
    add partial results to combine — and no split gets fewer than ``MIN_KEYS_PER_SPLIT``
    keys of the ``kv_blocks`` blocks (the longest sequence's). The count is then trimmed
    so that the longest sequence leaves no split empty.
    Examples (132 SMs, Hkv 8, one slot per SM): B 8 → 2 splits (128 CTAs); B 1, 128k keys
    → 16 (128 CTAs); B 64 → 1."""
    ctas = batch * kv_heads * m_blocks
    if ctas <= 0 or kv_blocks <= 0:
        return 1
    slots = num_sms * tuning.ctas_per_sm * tuning.waves
    min_blocks = max(1, MIN_KEYS_PER_SPLIT // tuning.tile_n)
    splits = max(1, min(slots // ctas, kv_blocks // min_blocks))
    per_split = -(-kv_blocks // splits)
    return -(-kv_blocks // per_split)


_SHIFTED: dict = {}   # (id(expr), ids of captures) -> (mod, shifted template, offset slot)
_SHIFTED_CAPACITY = 64


def _at_true_positions(mod, q_offset):
    """``shift_queries(mod, q_offset)``, traced once per mod: later steps (same mod, new
    offsets) only swap the offset capture of the cached rewrite (tracing costs ~0.5 ms)."""
    key = (id(mod.expr), tuple(id(c) for c in mod.captures))
    hit = _SHIFTED.get(key)
    if hit is None:
        placeholder = np.zeros(1, np.int32)
        template = shift_queries(mod, placeholder)
        # None: the mod never reads the query position (softcap...), the rewrite keeps no offset
        slot = next((i for i, c in enumerate(template.captures) if c is placeholder), None)
        if len(_SHIFTED) >= _SHIFTED_CAPACITY:
            _SHIFTED.pop(next(iter(_SHIFTED)))
        hit = _SHIFTED[key] = (mod, template, slot)  # the mod keeps the ids in the key its own
    _, template, slot = hit
    if slot is None:
        return template
    captures = list(template.captures)
    captures[slot] = q_offset
    return template.with_captures(tuple(captures))


def _swap(mod, old, new):
    """``mod`` with the capture that is ``old`` (by identity) replaced by ``new``."""
    if mod is None:
        return None
    return mod.with_captures(tuple(new if c is old else c for c in mod.captures))


def _is_full(mask) -> bool:
    return mask is None or (mask.expr.op == "const" and mask.expr.attr is True)


def decode_unsupported(q, k, v, page_size: int) -> str | None:
    """Why the decode kernel cannot run this step, or None."""
    name = dtype_name(q)
    if name not in KERNEL_DTYPES:
        return f"the GPU decode kernel supports bfloat16 and float16 queries, got {name}"
    if dtype_name(k) != name or dtype_name(v) != name:
        return f"the KV cache must have the query's dtype {name}, got {dtype_name(k)} and {dtype_name(v)}"
    d = int(q.shape[-1])
    if d not in KERNEL_HEAD_DIMS:
        return f"the GPU decode kernel supports head dims {KERNEL_HEAD_DIMS}, got {d}"
    if int(k.shape[-1]) != d or int(v.shape[-1]) != d:
        return f"the KV cache's head dims must equal the query's ({d}), got {int(k.shape[-1])} and {int(v.shape[-1])}"
    if page_size:
        from ..kernels.decode_sm90 import check_page_size

        try:
            check_page_size(page_size, PAGE_TILE)
        except ValueError as e:
            return f"the GPU decode kernel cannot read these pages: {e}"
    return None


@dataclass(frozen=True)
class DecodeWorkspace:
    """Device memory and copies a decode step needs besides its outputs (the adapter's).

    ``alloc(shape, "float32")``: an uninitialized device array (the splits' partial O and
    LSE, per step). ``tickets(n)``: an int32 device array of at least n zeros that stays
    with this device and stream — the kernel's arrival counters; each group's last split
    resets its own, so it is zeroed once, never per step (None: merge the splits with the
    separate combine kernel instead). ``upload(host int32 array)``: its device copy,
    ordered on the stream, without waiting for the GPU (pinned staging); None: the Device's
    ``to_device``."""

    alloc: Callable
    tickets: Callable | None = None
    upload: Callable | None = None


@dataclass
class DecodeLaunch:
    """One planned step, ready to launch (``launch()`` repeats the kernels with the same
    arguments: benchmarks time it apart from the host planning)."""

    config: object          # DecodeConfig; its hook carries this step's captures
    num_splits: int
    _decode: Callable = None
    _combine: Callable = None

    def launch(self) -> None:
        self._decode()
        if self._combine is not None:
            self._combine()


_PLANS: dict = {}
_PLANS_CAPACITY = 128


def _config_for(dtype: str, head_dim: int, num_mma_wg: int, page_size: int, score, mask,
                tuning: DecodeTuning = DEFAULT_TUNING, fused_combine: bool = True):
    """The step's DecodeConfig; configs are cached by the mods' structure, so a hit only
    wraps this step's captures in a fresh hook."""
    from ..kernels.decode_sm90 import DecodeConfig
    from ..kernels.mod_emit import IRModHook, capture_kinds

    # By IR identity (cached rewrites share it), so a hit hashes no structure; the entry's
    # template holds the IR, so the ids stay its own.
    key = (dtype, head_dim, num_mma_wg, page_size, tuning, fused_combine,
           None if score is None else id(score.expr), None if mask is None else id(mask.expr))
    hook = IRModHook(score, mask)
    entry = _PLANS.get(key)
    if entry is None:
        template = IRModHook(*(None if m is None else m.with_captures((None,) * len(m.captures))
                               for m in (score, mask)))
        config = DecodeConfig(dtype=dtype, head_dim=head_dim, num_mma_wg=num_mma_wg, tile_n=tuning.tile_n,
                              num_stages=tuning.num_stages, ctas_per_sm=tuning.ctas_per_sm,
                              page_size=page_size, fused_combine=fused_combine, mods=template)
        entry = (config, capture_kinds(template))
        if len(_PLANS) >= _PLANS_CAPACITY:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = entry
    hook.capture_kinds = entry[1]
    return entry[0].with_mods(hook)


def prepare_decode(q, cache, out, lse, device: Device, num_sms: int, workspace: DecodeWorkspace, score_mod=None,
                   mask=None, scale=None, page_table=None, tuning: DecodeTuning | None = None,
                   num_splits: int | None = None, fused_combine: bool | None = None) -> DecodeLaunch:
    """Plan one decode step for the split-KV kernel (``decode_into`` runs it): ``q`` [B, Hq, q_len, D] (the last
    q_len tokens of each sequence, already appended to ``cache``) → ``out`` [B, Hq, q_len, D]
    (contiguous, q's dtype) and ``lse`` [B, Hq, q_len] (float32, natural log).

    ``page_table`` overrides the paged cache's table (the adapter passes an int32 copy);
    ``tuning`` / ``num_splits`` / ``fused_combine`` override the kernel shape / the splits
    heuristic / the in-kernel merge (benchmarks, tests; the merge needs
    ``workspace.tickets``)."""
    paged = hasattr(cache, "page_table")
    k, v = (cache.k_pages, cache.v_pages) if paged else (cache.k, cache.v)
    table = (cache.page_table if page_table is None else page_table) if paged else None
    page_size = cache.page_size if paged else 0
    reason = decode_unsupported(q, k, v, page_size)
    if reason:
        raise ValueError(reason)
    if len(q.shape) != 4:
        raise ValueError(f"query must be 4-D [B, Hq, q_len, D], got shape {tuple(q.shape)}")
    B, Hq, q_len, D = (int(s) for s in q.shape)
    kv_heads = int(k.shape[2] if paged else k.shape[1])
    if not 1 <= q_len <= DECODE_MAX_Q_LEN:
        raise ValueError(f"the decode kernel takes 1..{DECODE_MAX_Q_LEN} query tokens, got {q_len}")
    if kv_heads == 0 or Hq % kv_heads:
        raise ValueError(f"query heads ({Hq}) must be a multiple of the cache's kv heads ({kv_heads})")
    if paged and dtype_name(table) != "int32":
        raise ValueError(f"the GPU decode kernel reads an int32 page table, got {dtype_name(table)}")
    if tuple(out.shape) != (B, Hq, q_len, D) or tuple(lse.shape) != (B, Hq, q_len):
        raise ValueError(f"out/lse must be [B, Hq, q_len, D] / [B, Hq, q_len], got {tuple(out.shape)} / {tuple(lse.shape)}")
    lengths = cache.host_lengths()
    if lengths.shape[0] != B:
        raise ValueError(f"query batch {B} does not match the cache's {lengths.shape[0]}")
    if np.any(lengths < q_len):
        raise ValueError(
            f"every sequence must already hold its {q_len} query tokens (append them first); lengths {lengths.tolist()}")

    # Mods at true positions: query row i of sequence b sits at lengths[b] - q_len + i.
    # One host array [lengths; query offset] goes to the GPU in one (asynchronous) copy.
    host = np.empty((2, B), dtype=np.int32)
    host[0] = lengths
    q_offset = host[1]
    q_offset[:] = lengths - q_len
    base = None if mask is None else as_mask(mask, "mask")
    the_mask = None if _is_full(base) else _at_true_positions(base, q_offset)
    the_score = None if score_mod is None else _at_true_positions(as_score(score_mod, "score_mod"), q_offset)

    group_rows = (Hq // kv_heads) * q_len
    num_mma_wg = 1 if group_rows <= 64 else 2
    m_blocks = -(-group_rows // (64 * num_mma_wg))
    dtype = KERNEL_DTYPES[dtype_name(q)]
    if tuning is None:
        tuning = DEFAULT_TUNING
    if num_mma_wg > 1 and tuning.ctas_per_sm > 1:   # two consumer warpgroups: one CTA per SM
        tuning = ONE_CTA_TUNING

    if fused_combine is None:
        fused_combine = workspace.tickets is not None
    elif fused_combine and workspace.tickets is None:
        raise ValueError("fused_combine needs workspace.tickets")
    on_device = (workspace.upload or device.to_device)(host)
    seq_lens, q_offset_dev = on_device[0], on_device[1]
    # The kernel's mods read the offsets from that device copy.
    config = _config_for(dtype, D, num_mma_wg, page_size, _swap(the_score, q_offset, q_offset_dev),
                         _swap(the_mask, q_offset, q_offset_dev), tuning, fused_combine)
    kv_blocks = int(-(-int(np.max(lengths)) // tuning.tile_n))
    splits = choose_splits(B, kv_heads, m_blocks, kv_blocks, num_sms, tuning)
    if num_splits is not None:
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        splits = int(num_splits)

    o_part = workspace.alloc((splits, B, Hq, q_len, D), "float32")
    lse_part = workspace.alloc((splits, B, Hq, q_len), "float32")
    # One arrival counter per CTA group (grid dims 1 and 2), all zero between launches.
    tickets = workspace.tickets(B * kv_heads * m_blocks) if fused_combine else None
    scale_value = float(scale) if scale is not None else 1.0 / math.sqrt(D)
    ffi = use_tvm_ffi(device)

    from ..kernels.cache import combine_runner, decode_runner
    from ..kernels.decode_combine import CombineConfig

    if ffi:
        from ..kernels.ffi_runner import ffi_mod_args

        args = ffi_mod_args(config.mods, device.to_device)
    else:
        from ..kernels.mod_emit import runtime_args

        args = runtime_args(config.mods, device.to_device)
    runner = decode_runner(config, ffi)
    step = DecodeLaunch(config, splits, lambda: runner.run(
        q, k, v, table, seq_lens, out, lse, o_part, lse_part, tickets, scale_value, args, device.stream))
    if splits > 1 and not fused_combine:
        rows = B * Hq * q_len
        merge = combine_runner(CombineConfig(dtype=dtype, head_dim=D), ffi)
        views = (o_part.reshape(splits, rows, D), lse_part.reshape(splits, rows), out.reshape(rows, D),
                 lse.reshape(rows))
        step._combine = lambda: merge.run(*views, device.stream)
    return step


def decode_into(q, cache, out, lse, device: Device, num_sms: int, workspace: DecodeWorkspace, score_mod=None,
                mask=None, scale=None, page_table=None, tuning: DecodeTuning | None = None,
                num_splits: int | None = None, fused_combine: bool | None = None) -> DecodeLaunch:
    """Run one decode step with the split-KV kernel; see ``prepare_decode``."""
    step = prepare_decode(q, cache, out, lse, device, num_sms, workspace, score_mod, mask, scale, page_table,
                          tuning, num_splits, fused_combine)
    step.launch()
    return step


__all__ = ["DECODE_MAX_Q_LEN", "DEFAULT_TUNING", "DecodeLaunch", "DecodeTuning", "DecodeWorkspace", "choose_splits",
           "decode_into", "decode_unsupported", "prepare_decode"]
