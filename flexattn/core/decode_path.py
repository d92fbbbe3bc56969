"""The GPU decode path: plan and launch the split-KV decode kernel for a step.

Framework-neutral and destination-passing, like ``kernel_path.forward_into``: the adapter
allocates ``out``/``lse`` and supplies a ``DecodeSite``: a ``Device`` (stream, host→GPU
copies), the SM count (read by the adapter, never while a kernel is traced) and a
``DecodeWorkspace`` (one per stream: the fp32 split partials, the kernel's arrival
tickets, the per-step upload of lengths/offsets through pinned staging, a lock); the
step's mods and scale come as ``DecodeMods``, benchmarks' choices as ``DecodeOverrides``.
Everything the kernel cannot do is refused before anything compiles.

Once per call shape (``DecodePlan``, kept while the same mod objects, shapes and stream
recur): checks; the mods rewritten to true positions with the query offsets as a runtime
buffer (``mods.positions.shift_queries``) — the plan's device buffer [lengths; offsets];
the kernel config and runner; the captures converted; the buffer's uploader and the
tickets. The kernel bounds keys by the per-batch length itself, so no ``limit_keys`` term.

Per step, on the host (``DecodePlan.run``, which an adapter calls straight from its own
key of a repeated step — the torch adapter's whole step costs ~34 µs of host time):
the cache's lengths (host ints) are checked (batch, query tokens present, capacity) and
go with the offsets (``len - q_len``) into the plan's buffer through the workspace's
uploader (a ``StagingRing`` slot and one asynchronous copy: the host plans the next
step while the GPU runs this one — new values, same structure: nothing recompiles; values
equal to the plan's last upload are not copied again: a flex_attention call against a
fixed-length cache repeats them every call);
``choose_launch`` picks how many splits of the kv blocks to visit fill the GPU and how
they merge (see there; cached per kv block count); the partials are views of the workspace's
scratch, kept per split count; one launch, whose split CTAs merge in a cluster (pairs)
or whose last split CTA of each group merges the splits, counting arrivals in the
workspace's tickets (``decode.sm90``). The upload and launch
hold the workspace's lock, so threads sharing a stream each launch after their own
upload; each stream has its own workspace and plans, so streams never share a buffer.

The kernel skips the leading kv blocks its mask provably excludes (a sliding window
skips the cache's head) by interval analysis on the GPU (``decode.sm90``), per CTA and
step (compiled out where the host proves the cache's first key always attended, as under
causal masks: ``head_always_kept``); blocks at or past each sequence's length are never
visited either. The host runs
the same analysis only to size the splits (``live_blocks``: once per plan and kv block
count, ~0.2-0.3 ms, so about every tile_n decoded tokens — and only for masks that can
exclude a cache's head at all, ``may_skip_head``: windows, not causal), never for
correctness.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..arrays import dtype_name
from ..bounded import keep_bounded
from ..mods import as_mask, as_score
from ..mods.positions import shift_queries
from .kernel_path import DECODE_HEAD_DIMS, KERNEL_DTYPES, CaptureArgs, Device, _is_full, ffi_tensors, use_tvm_ffi
from .prepared import PreparedCalls, call_identity

DECODE_MAX_Q_LEN = 16      # longer query blocks take the ordinary forward kernel
PAGE_TILE = 128            # page sizes are checked against this tile: then every tile_n
                           # the tuning picks (64 or 128) reads them in place
MIN_KEYS_PER_SPLIT = 256   # below that a split's fixed costs (Q load, epilogue, its share
                           # of the merge) outweigh the parallelism it adds (H100, B 1: 16
                           # splits of 256 keys beat 8 of 512, 14.1 against 14.9 µs at 4k keys)


@dataclass(frozen=True)
class DecodeTuning:
    """The kernel shape of a decode step (see ``decode.sm90.DecodeConfig``)."""

    tile_n: int = 128          # kv rows per pipeline stage
    num_stages: int = 3        # K/V ring depth
    ctas_per_sm: int = 1       # resident CTAs per SM the kernel is sized for
    waves: int = 1             # CTAs per resident slot the splits heuristic aims for
    cluster_merge: bool = True  # 2 splits: one cluster per group, merged through distributed
                                # shared memory (else: arrival tickets); see choose_launch


# Measured on the H100 (benchmarks/RESULTS.md, decode sweep): 64-key tiles in a 2-stage
# ring (80 KB of shared memory), two CTAs per SM (128 KB of K/V in flight per SM), stream
# 2.84-3.07 TB/s (decode kernel alone) on every benchmark shape, contiguous and paged;
# 128-key tiles with one CTA per SM lose up to 0.1 TB/s on short caches and at B 1.
DEFAULT_TUNING = DecodeTuning(tile_n=64, num_stages=2, ctas_per_sm=2)
# One CTA per SM with a deeper ring: two consumer warpgroups (group x q_len > 64 rows),
# and steps that fill the GPU with half the splits this way (``choose_launch``).
ONE_CTA_TUNING = DecodeTuning(tile_n=64, num_stages=6, ctas_per_sm=1)


def choose_launch(batch: int, kv_heads: int, m_blocks: int, kv_blocks: int, num_sms: int,
                  tuning: DecodeTuning = DEFAULT_TUNING, balanced: bool = False) -> tuple:
    """(tuning, splits, cluster) of a step whose longest sequence visits ``kv_blocks``
    blocks (``live_blocks``): ``choose_splits``, and how the splits merge.

    Two splits merge through distributed shared memory, in a cluster of the pair (no
    arrival ticket, no partials in global memory: the last group is done 1.3-3 µs sooner
    than with tickets on the H100). Pairs are resident wherever the CTAs are (measured:
    132 pairs at two CTAs per SM, 66 at one), while clusters of 4 or 8 lose slots to the
    GPCs' granularity (62 of 66 clusters of 4 at two CTAs per SM: a B 8 x Hkv 8 step would
    run a second wave; benchmarks/decode_clusters.py), so more splits merge by tickets.
    Where a wider cluster would be resident it is no faster either: it packs its CTAs onto
    fewer SMs (B 1, 4096-key window: 13 splits in one cluster 16.9 µs, by tickets 16.0).
    Where the default tuning (two CTAs per SM) needs 4 splits or more, one CTA per SM with
    a ring three times as deep streams as fast with half as many: fewer partials to merge
    (B 8 L 8k: 2 splits merged in pairs, 93.6 against 95.8 µs with 4 and tickets; a ticket
    merge of 33 splits takes ~4 µs, of 16 ~2 µs: benchmarks/RESULTS.md, sessions 11-12).
    Explicit tunings are kept. ``balanced``: the kernel's ranges balanced
    (``DecodeConfig.balanced_splits``), so the counts are not trimmed."""
    splits = choose_splits(batch, kv_heads, m_blocks, kv_blocks, num_sms, tuning, balanced)
    if splits >= 4 and tuning == DEFAULT_TUNING:
        deep = dataclasses.replace(ONE_CTA_TUNING, cluster_merge=tuning.cluster_merge)
        fewer = choose_splits(batch, kv_heads, m_blocks, kv_blocks, num_sms, deep, balanced)
        if 2 * fewer <= splits + 1:
            tuning, splits = deep, fewer
    if tuning.cluster_merge and splits == 2:
        return tuning, 2, 2
    return tuning, splits, 1


def choose_splits(batch: int, kv_heads: int, m_blocks: int, kv_blocks: int, num_sms: int,
                  tuning: DecodeTuning = DEFAULT_TUNING, balanced: bool = False) -> int:
    """Number of kv splits per (batch, kv head, row block).

    A memory-bound step needs every SM streaming. ``batch * kv_heads * m_blocks`` CTAs
    exist without splitting; splitting multiplies them, up to ``num_sms * ctas_per_sm *
    waves`` (the resident CTA slots, times the waves the tuning aims for) — more would only
    add partial results to merge — and no split gets fewer than ``MIN_KEYS_PER_SPLIT``
    keys of the ``kv_blocks`` blocks (those the longest sequence visits). The count is then trimmed
    so that the longest sequence leaves no split empty (ceil(blocks / splits) each), unless
    ``balanced`` (the kernel's ``balanced_splits``: no split is empty while splits <= blocks).
    Examples (132 SMs, Hkv 8, one slot per SM): B 8 → 2 splits (128 CTAs); B 1, 128k keys
    → 16 (128 CTAs); B 64 → 1."""
    ctas = batch * kv_heads * m_blocks
    if ctas <= 0 or kv_blocks <= 0:
        return 1
    slots = num_sms * tuning.ctas_per_sm * tuning.waves
    min_blocks = max(1, MIN_KEYS_PER_SPLIT // tuning.tile_n)
    splits = max(1, min(slots // ctas, kv_blocks // min_blocks))
    if balanced:
        return splits
    per_split = -(-kv_blocks // splits)
    return -(-kv_blocks // per_split)


_FAR_QUERY = 1 << 30   # a query position past any cache


def _host_values(mask):
    """The mask's captures when the host holds them all (numbers, numpy arrays), else None
    (device arrays: reading them would wait for the GPU)."""
    values = list(mask.captures)
    if all(isinstance(c, (bool, int, float, np.integer, np.floating, np.ndarray)) for c in values):
        return values
    return None


def _classify_on_host(mask, ranges):
    """``intervals.classify`` of ``mask`` over ``ranges`` with its captured values, or None
    when there is no mask or the host does not hold its captures (``_host_values``)."""
    values = None if mask is None else _host_values(mask)
    if values is None:
        return None
    from ..mods.intervals import classify

    return classify(mask.expr, ranges, values)


def may_skip_head(mask) -> bool:
    """Whether ``mask`` (at true positions) can exclude a cache's first key — the masked
    prefix ``live_blocks`` counts — by interval analysis at a query far past it: a window
    can, causal / prefix-LM / full masks cannot (plans skip their analysis per block
    count, ~0.2 ms for nothing). False for masks reading device arrays."""
    kept = _classify_on_host(mask, {"b": (0, 0), "h": (0, 0), "q": (_FAR_QUERY, _FAR_QUERY), "kv": (0, 0)})
    return kept is not None and bool(np.all(kept == 0))


def head_always_kept(mask, batch: int, q_heads: int) -> bool:
    """Whether every query position of every (batch, head) attends a cache's first key
    under ``mask`` (at true positions), by interval analysis: causal and prefix-LM masks
    do. Then no leading block is ever masked and the kernel's masked-prefix analysis (one
    per CTA before its first load, ~0.3 µs) would find nothing, so the plan compiles it
    out. False for masks reading device arrays (the kernel's analysis may still skip)."""
    kept = _classify_on_host(mask, {"b": (0, batch - 1), "h": (0, q_heads - 1), "q": (0, _FAR_QUERY), "kv": (0, 0)})
    return kept is not None and bool(np.all(kept == 1))


def live_blocks(mask, batch: int, q_heads: int, q_len: int, length: int, tile_n: int,
                first_query: int | None = None) -> int:
    """The kv blocks of a ``length``-token sequence the decode kernel will visit: all but
    the leading ones interval analysis proves ``mask`` excludes for its ``q_len`` query
    positions from ``first_query`` (None: the last ``q_len`` of the sequence) on
    (the kernel's own masked-prefix skip, done here on the host for the
    planner: a sliding window of 4096 leaves 65 of 2048 blocks at 128k keys, which want
    more splits than the cache's length suggests). One vectorized analysis over every
    prefix; ``mask`` at true positions, every batch and head at once. Masks reading
    device arrays are not analysed (it would wait for the GPU): all blocks."""
    blocks = -(-length // tile_n)
    if mask is None or blocks <= 1:
        return blocks
    prefix_end = np.minimum(np.arange(1, blocks + 1) * tile_n, length) - 1
    first = length - q_len if first_query is None else first_query
    kept = _classify_on_host(mask, {"b": (0, batch - 1), "h": (0, q_heads - 1), "q": (first, first + q_len - 1),
                                    "kv": (np.zeros_like(prefix_end), prefix_end)})
    if kept is None:
        return blocks
    masked = np.broadcast_to(kept, prefix_end.shape) == 0
    # Longer prefixes are never "more masked" (sound bounds only widen): count the leading run.
    skipped = int(np.argmin(masked)) if not masked.all() else blocks
    return max(1, blocks - skipped)


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
        hit = keep_bounded(_SHIFTED, key, (mod, template, slot), _SHIFTED_CAPACITY)  # the mod keeps the key's ids its own
    _, template, slot = hit
    if slot is None:
        return template
    captures = list(template.captures)
    captures[slot] = q_offset
    return template.with_captures(tuple(captures))


def decode_unsupported(q, k, v, page_size: int) -> str | None:
    """Why the decode kernel cannot run this step, or None."""
    name = dtype_name(q)
    if name not in KERNEL_DTYPES:
        return f"the GPU decode kernel supports bfloat16 and float16 queries, got {name}"
    if dtype_name(k) != name or dtype_name(v) != name:
        return f"the KV cache must have the query's dtype {name}, got {dtype_name(k)} and {dtype_name(v)}"
    d = int(q.shape[-1])
    if d not in DECODE_HEAD_DIMS:
        return (f"the GPU decode kernel supports head dims that are multiples of 16 from {DECODE_HEAD_DIMS[0]}"
                f" to {DECODE_HEAD_DIMS[-1]}, got {d}")
    if int(k.shape[-1]) != d or int(v.shape[-1]) != d:
        return f"the KV cache's head dims must equal the query's ({d}), got {int(k.shape[-1])} and {int(v.shape[-1])}"
    if page_size:
        from ..kernels.decode.sm90 import check_page_size

        try:
            check_page_size(page_size, PAGE_TILE)
        except ValueError as e:
            return f"the GPU decode kernel cannot read these pages: {e}"
    return None


@dataclass(frozen=True)
class DecodeWorkspace:
    """Device memory and copies a decode step needs besides its outputs (the adapter's,
    one per device and stream; everything in it is used in that stream's order).

    ``alloc(shape, dtype)``: an uninitialized device array (a plan's int32 lengths/offsets
    buffer, once per plan). ``tickets(n)``: an int32 device array of at least n zeros that
    stays with this device and stream — the kernel's arrival counters; each group's last
    split resets its own, so it is zeroed once, never per step. ``scratch(n)``: a float32
    device array of at least n elements, the same one until a larger one is asked for —
    the splits' partial O and LSE, reused by every step on the stream (a step's kernel
    runs after the previous step's in stream order, so it never overwrites partials still
    being merged). ``uploader(into)``: a function ``put(values)`` that copies a flat
    sequence of ``into``'s element count of int32 values into the device array ``into``,
    ordered on the stream, without waiting for the GPU (pinned staging that the adapter
    recycles only once the GPU has copied from it; the copy lands after the previous
    step's kernel in stream order, so ``into`` can be the same buffer every step).
    ``lock``: held around a step's upload and launch (``DecodePlan.run``, ``decode_into``),
    so that steps queued on one stream from several threads each launch right after their
    own upload."""

    alloc: Callable
    tickets: Callable
    scratch: Callable
    uploader: Callable
    lock: object = field(default_factory=threading.Lock, compare=False, repr=False)
    # ``marked_scratch(n)``: like ``scratch``, but all zero between steps (allocated zeroed;
    # the polled merge zeroes every slot it read: ``decode/polled_merge.py``). None: the
    # adapter keeps no such memory (XLA's scratch lives one call), so steps merge by tickets.
    marked_scratch: Callable | None = None
    # ``zeroed(n, dtype name)``: a new zeroed device array of n elements, a plan's own
    # (the parity slots of ``DecodeConfig.parity_slots``). None: the adapter has none.
    zeroed: Callable | None = None


class StagingRing:
    """Pinned host slots for one stream's uploads, recycled behind fences.

    A copy from host memory queued on a stream reads its source when the stream reaches
    it, after the host has returned: the host must not rewrite that memory before then.
    The ring has ``slots`` slots in groups of ``group``; after the copy out of a group's
    last slot it records a fence on the stream, and before writing a group's first slot
    again (a lap later) it waits for that group's previous fence — every copy out of the
    group has then run. The host can thus run ``slots - group`` steps ahead of the GPU
    before it waits (it never does in a decoder's steady state), and fences cost one
    record per ``group`` steps.

    The adapter supplies the memory and the stream: ``host(nbytes)`` -> a writable uint8
    numpy view of pinned memory (kept alive by the ring) and its address;
    ``copy(dst, src_address, nbytes)`` queues the host→device copy on the stream (``dst``
    as the adapter's ``uploader`` gave it); ``fence()`` -> an object whose ``record()``
    marks the stream's current position and ``wait()`` blocks until the stream passed the
    last mark. A slot too small for a new request grows the ring: every copy out of the
    old memory is waited for first (once per size increase).

    Not thread-safe by itself: its callers hold the workspace's lock. Not CUDA-graph
    capturable: a replay would copy from a slot rewritten since."""

    def __init__(self, host: Callable, copy: Callable, fence: Callable, slots: int = 64, group: int = 16,
                 slot_bytes: int = 256):
        if slots % group:
            raise ValueError(f"slots ({slots}) must be a multiple of group ({group})")
        self._host, self._copy, self._fence = host, copy, fence
        self.slots, self.group = slots, group
        self._fences = [None] * (slots // group)
        self._next = 0
        self._alloc(slot_bytes)

    def _alloc(self, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self._view, self._base = self._host(slot_bytes * self.slots)

    def _grow(self, nbytes: int) -> None:
        last = self._fence()
        last.record()
        last.wait()                       # every copy out of the old memory has run
        self._fences = [None] * (self.slots // self.group)
        self._next = 0
        size = self.slot_bytes
        while size < nbytes:
            size *= 2
        self._alloc(size)

    def uploader(self, dst, count: int) -> Callable:
        """``put(values)``: ``count`` int32 values into a free slot, then the copy of the
        slot to ``dst``."""
        packer = struct.Struct(f"<{count}i")
        pack, nbytes = packer.pack_into, packer.size

        def put(values) -> None:
            if nbytes > self.slot_bytes:
                self._grow(nbytes)
            i = self._next
            group = self.group
            if i % group == 0:            # entering a group: its previous lap's copies done?
                previous = self._fences[i // group]
                if previous is not None:
                    previous.wait()
            offset = i * self.slot_bytes
            pack(self._view, offset, *values)
            self._copy(dst, self._base + offset, nbytes)
            i += 1
            if i % group == 0:            # the group's last copy is queued: fence it
                fence = self._fences[i // group - 1]
                if fence is None:
                    fence = self._fences[i // group - 1] = self._fence()
                fence.record()
            self._next = i % self.slots

        return put


@dataclass(frozen=True)
class DecodeSite:
    """Where a decode step runs: the ``Device`` (stream, host→device copies), its SM count
    (read by the adapter, never while a kernel is traced) and the stream's
    ``DecodeWorkspace``."""

    device: Device
    num_sms: int
    workspace: DecodeWorkspace


@dataclass(frozen=True)
class DecodeMods:
    """A step's mods as the caller gave them (``Mod`` values or plain functions, at cache
    positions: the plan rewrites them to true positions) and its scale (None: 1/sqrt(D))."""

    score_mod: object = None
    mask: object = None
    scale: float | None = None
    # True: query row i of a sequence of length L sits at L - q_len + i (a decoding step:
    # the plan rewrites the mods to those positions). False: at i, as flex_attention
    # numbers them (short queries routed here from the forward, ``core/short_query.py``).
    true_positions: bool = True
    # True: every page of a sequence but its last is known full (a short query's walk of
    # listed blocks, full ones first: ``short_query.ListWalk``): the kernel evaluates the
    # mask in the tiles over the last page alone (``DecodeConfig.mask_last_page_only``).
    full_but_last: bool = False
    # True: the mods read a walk's block table (any ``short_query.ListWalk``), which the
    # masked-prefix analysis cannot see through: the kernel runs without it.
    listed_walk: bool = False

    @property
    def call(self) -> tuple:
        """The step as a ``prepared.call_identity`` call (GQA implicit)."""
        return (self.score_mod, None, self.scale, True, self.mask, None)


@dataclass(frozen=True)
class DecodeOverrides:
    """What benchmarks and tests choose instead of the planner: the kernel shape
    (``tuning``; None: ``DEFAULT_TUNING``) and the split count (``num_splits``; None:
    ``choose_launch``; an explicit 2, 4, 8 or 16 merges in a cluster unless the tuning's
    ``cluster_merge`` is off)."""

    tuning: DecodeTuning | None = None
    num_splits: int | None = None


NO_MODS = DecodeMods()
NO_OVERRIDES = DecodeOverrides()


@dataclass
class DecodeLaunch:
    """One planned step, ready to launch (``launch()`` repeats the kernel with the same
    arguments: benchmarks time it apart from the host planning). It reads the lengths its
    plan's buffer holds at launch time: preparing a later step of the same plan (same
    mods, shapes, stream) uploads that step's lengths into the same buffer."""

    config: object          # DecodeConfig; its hook carries the plan's captures
    num_splits: int
    _decode: Callable = None
    plan: object = None     # the DecodePlan it came from

    def launch(self) -> None:
        self._decode()


def _row_blocks(q_heads: int, kv_heads: int, q_len: int, tuning: DecodeTuning, head_dim: int = 128) -> tuple:
    """(consumer warpgroups, row blocks, tuning) of a step: a GQA group's query rows
    (heads x q_len) packed into 64-row warpgroups, two when they exceed 64, and then one
    CTA per SM; the tuning fitted to the head dim (``fit_head_dim``)."""
    group_rows = (q_heads // kv_heads) * q_len
    num_mma_wg = 1 if group_rows <= 64 else 2
    if num_mma_wg > 1 and tuning.ctas_per_sm > 1:   # two consumer warpgroups: one CTA per SM
        tuning = ONE_CTA_TUNING
    return num_mma_wg, -(-group_rows // (64 * num_mma_wg)), fit_head_dim(tuning, head_dim, num_mma_wg)


def fit_head_dim(tuning: DecodeTuning, head_dim: int, num_mma_wg: int = 1) -> DecodeTuning:
    """``tuning`` (sized for head dims up to 128) for a wider head: one CTA per SM with as
    many K/V bytes in flight as ``ONE_CTA_TUNING`` at head dim 128 (fewer, wider stages),
    as many stages as shared memory holds beside the Q tile; no pair-cluster merge where
    the ring cannot hold a split's fp32 O tile (``DecodeConfig``'s rule)."""
    if head_dim <= 128:
        return tuning
    from ..kernels.decode.sm90 import DecodeConfig

    tile_m = 64 * num_mma_wg
    stages = max(1, ONE_CTA_TUNING.num_stages * 128 // head_dim)
    while stages > 1 and DecodeConfig.smem_for(head_dim, tile_m, tuning.tile_n, stages) > DecodeConfig.smem_limit_for(1):
        stages -= 1
    return dataclasses.replace(tuning, num_stages=stages, ctas_per_sm=1,
                               cluster_merge=tuning.cluster_merge and stages * tuning.tile_n >= 2 * tile_m)


def _with_launch(config, tuning: DecodeTuning, cluster: int, polled: bool = False):
    """``config`` for another kernel shape (``choose_launch``'s tuning), merging cluster and
    merge (``polled_merge_pays``)."""
    return dataclasses.replace(config, tile_n=tuning.tile_n, num_stages=tuning.num_stages,
                               ctas_per_sm=tuning.ctas_per_sm, cluster_splits=cluster, polled_merge=polled,
                               prefetch_tile_reads=config.prefetch_tile_reads
                               and _prefetch_pays(config.mods, tuning.tile_n, config.mask_last_page_only))


def polled_merge_pays(splits: int, cluster: int, head_dim: int) -> bool:
    """Whether a step's splits merge by polling their partials' slots (``DecodeConfig.
    polled_merge``) instead of tickets: wherever no cluster merges them, up to 32 splits
    (one LSE per lane) and head dims that are multiples of 32, on workspaces that keep the
    slots zeroed (``DecodeWorkspace.marked_scratch``; the caller checks, and reads
    ``FLEXATTN_DECODE_MERGE=tickets``, which keeps the tickets for A/B runs, once per plan)."""
    from ..kernels.decode.polled_merge import MAX_SPLITS

    return cluster == 1 and 1 < splits <= MAX_SPLITS and head_dim % 32 == 0


def stable_merge_chunk(splits: int, max_chunk: int, band_hi: int | None, longest: int, q_len: int) -> int:
    """``DecodeConfig.merge_chunk`` for a polled launch of ``splits`` splits: the count
    itself where it holds across a decoder's steps — once the longest sequence has filled
    a band ``q - kv <= band_hi`` (a sliding window, ``host_band_hi``), every step visits
    the same number of blocks (one of two by alignment; 65 for 4097 keys in 64-key
    tiles), so the planner's count settles and one kernel serves the steps — within
    ``max_chunk``, the head dim's chunk (``polled_merge.chunk_splits``); else 0 (that
    chunk, clamped: one kernel for every count, where a filling window or a growing cache
    would compile one per count it passes through). The clamped duplicates cost ~0.2 µs
    of a B1 L128k window step on the H200 (docs/experiments.md, session 71)."""
    settled = band_hi is not None and longest - q_len > band_hi
    return splits if settled and splits <= max_chunk else 0


def host_band_hi(prefix_band, mask) -> int | None:
    """``DecodeConfig.prefix_band``'s bound as a host int: a number, or an ``Affine`` of
    the mask's captured numbers; None without a band or where it reads an array."""
    if prefix_band is None:
        return None
    hi = prefix_band[0]
    if isinstance(hi, int):
        return hi
    values = [mask.captures[slot] for slot, _ in hi.terms]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return None
    return int(hi.value(mask.captures))


def slot_views(o_flat, lse_flat, splits: int, sets: int, o_shape: tuple, group_major: bool,
               capacity: int | None = None) -> tuple:
    """(o_part [splits, B, Hq, q_len, D], lse_part [splits, B, Hq, q_len]) over flat float32
    slot arrays, views never copies. ``sets`` 2: each slot has its twin of the other set
    side by side (parity slots: mode 0's stride spans both, the kernel finds set 1 half a
    stride in), for ``capacity`` splits (default ``splits``). Split-major: [capacity, sets,
    B, Hq, q_len, D] and [capacity, sets, B, Hq, q_len]. ``group_major``: a row's splits
    adjacent — [B, Hq, q_len, capacity, sets, D] and [B, Hq, capacity, sets, q_len] (q_len
    contiguous, as the kernel's LSE view wants)."""
    B, Hq, q_len, D = o_shape
    cap = splits if capacity is None else capacity
    rows = B * Hq * q_len
    if not group_major:
        o = o_flat[:cap * sets * rows * D].reshape((cap, sets) + tuple(o_shape))[:splits, 0]
        lse = lse_flat[:cap * sets * rows].reshape((cap, sets, B, Hq, q_len))[:splits, 0]
        return o, lse
    o = o_flat[:rows * cap * sets * D].reshape(rows, cap, sets, D)[:, :splits, 0]       # [rows, splits, D]
    o = o.swapaxes(0, 1).reshape(splits, B, Hq, q_len, D)
    lse = lse_flat[:B * Hq * cap * sets * q_len].reshape(B * Hq, cap, sets, q_len)[:, :splits, 0]
    lse = lse.swapaxes(0, 1).reshape(splits, B, Hq, q_len)
    return o, lse


def _prefetch_pays(mods, tile_n: int, mask_last_page_only: bool) -> bool:
    """Whether the kernel reads the mods' tile-constant values a step ahead (``DecodeConfig.
    prefetch_tile_reads``): wherever they have such reads (a walk's table, a paged mask's
    page map) and every step applies them. ``FLEXATTN_DECODE_PREFETCH=0`` turns it off for
    A/Bs."""
    return (not mask_last_page_only and mods.tile_invariant_count(tile_n) > 0
            and os.environ.get("FLEXATTN_DECODE_PREFETCH", "1") != "0")


_CONFIGS: dict = {}
_CONFIGS_CAPACITY = 128


def band_prefix(base, mask, queries_at_end: bool):
    """``DecodeConfig.prefix_band`` for a step whose user mask ``base`` the kernel evaluates
    as ``mask`` (``base`` itself, or ``base`` at true positions): where ``base`` is a band
    with an upper bound on q - kv (a sliding window), (that bound with its captured numbers
    re-indexed to ``mask``'s captures, ``queries_at_end``), else None. Planned by default
    (``_planned_band_prefix``; ``FLEXATTN_DECODE_BAND_PREFIX=0`` keeps the interval
    analysis, for A/B): B1 L128k window 4096 on the H200, the split's range known 0.3 µs
    after entry instead of 0.9, the step 14.0–14.1 µs against 14.2–14.3."""
    if base is None or mask is None:
        return None
    from ..mods.structure import Affine, diagonal_band

    band = diagonal_band(base.expr)
    if band is None or band.empty or band.hi is None:
        return None
    hi = band.hi
    if isinstance(hi, Affine):
        terms = []
        for slot, coef in hi.terms:
            # (the same objects: shift_queries captures the mod's numbers as they are)
            at = [j for j, c in enumerate(mask.captures) if c is base.captures[slot]]
            if not at:
                return None
            terms.append((at[0], coef))
        hi = Affine(hi.const, tuple(sorted(terms)))
    return (hi, queries_at_end)


def _planned_band_prefix(base, mask, queries_at_end: bool):
    return None if os.environ.get("FLEXATTN_DECODE_BAND_PREFIX") == "0" else band_prefix(base, mask, queries_at_end)


V_OVERHANG_POLICIES = ("auto", "keep", "zero")


def v_overhang_policy() -> str:
    """FLEXATTN_DECODE_V_OVERHANG (read once per plan): which steps zero the V rows their
    last block reads past a length before P V (``DecodeConfig.zero_v_overhang``). Such rows
    — a cache longer than its lengths, a page's tail — may hold NaN / Inf bits (a
    ``torch.empty`` cache), and P = 0 times NaN is NaN in O (FA2 zero-fills them; FA3 and
    FA4 do not). "auto" (default): the steps that read there (``DecodePlan.
    _zeroes_overhang``); "keep": none (A/B); "zero": every step, also where nothing is read
    there (A/B: the cost of the code where it does not run). H200, 2026-12-02: B1 L128k
    window 4096 13.39 µs keep / 13.56 zero over four processes each, within their spread."""
    policy = os.environ.get("FLEXATTN_DECODE_V_OVERHANG", "auto")
    if policy not in V_OVERHANG_POLICIES:
        raise ValueError(f"FLEXATTN_DECODE_V_OVERHANG must be one of {V_OVERHANG_POLICIES}, got {policy!r}")
    return policy


def _config_for(dtype: str, head_dim: int, num_mma_wg: int, page_size: int, score, mask,
                tuning: DecodeTuning = DEFAULT_TUNING, skip_masked_prefix: bool = True,
                mask_last_page_only: bool = False, prefix_band: tuple | None = None):
    """The step's DecodeConfig; configs are cached by the mods' structure, so a hit only
    wraps these captures in a fresh hook."""
    from ..kernels.decode.sm90 import DecodeConfig
    from ..kernels.emit.mod_emit import IRModHook, capture_kinds

    # By IR identity (cached rewrites share it), so a hit hashes no structure; the entry's
    # template holds the IR, so the ids stay its own.
    # A band's kv tiles start at its first key (``DecodeConfig.band_start_tiles``) in
    # contiguous caches; FLEXATTN_DECODE_BAND_TILES=aligned keeps multiples of tile_n (A/B).
    start_tiles = os.environ.get("FLEXATTN_DECODE_BAND_TILES", "start") != "aligned"
    key = (dtype, head_dim, num_mma_wg, page_size, tuning, skip_masked_prefix, mask_last_page_only, prefix_band,
           start_tiles, os.environ.get("FLEXATTN_DECODE_PREFETCH", "1") != "0",
           None if score is None else id(score.expr), None if mask is None else id(mask.expr))
    hook = IRModHook(score, mask)
    entry = _CONFIGS.get(key)
    if entry is None:
        template = IRModHook(*(None if m is None else m.with_captures((None,) * len(m.captures))
                               for m in (score, mask)))
        band = prefix_band if skip_masked_prefix else None
        prefetch = _prefetch_pays(template, tuning.tile_n, mask_last_page_only)
        config = DecodeConfig(dtype=dtype, head_dim=head_dim, num_mma_wg=num_mma_wg, tile_n=tuning.tile_n,
                              num_stages=tuning.num_stages, ctas_per_sm=tuning.ctas_per_sm,
                              page_size=page_size, skip_masked_prefix=skip_masked_prefix, prefix_band=band,
                              band_start_tiles=start_tiles and band is not None and not page_size and not prefetch,
                              mask_last_page_only=mask_last_page_only, prefetch_tile_reads=prefetch,
                              mods=template)
        entry = (config, capture_kinds(template))
        keep_bounded(_CONFIGS, key, entry, _CONFIGS_CAPACITY)
    hook.capture_kinds = entry[1]
    return entry[0].with_mods(hook)


def _converter(ffi: bool, kinds, captures, to_device, mods) -> Callable:
    """A plan's captures converted as its runner takes them (TVM-FFI arguments, or cute
    views for the from_dlpack runner), as a function that holds no plan (``CaptureArgs``
    keeps it: the plan would then sit in a reference cycle)."""
    if ffi:
        from ..kernels.launch.arguments import ffi_args

        return lambda: ffi_args(kinds, captures, to_device) or None
    from ..kernels.emit.mod_emit import runtime_args

    return lambda: runtime_args(mods, to_device)


class DecodePlan:
    """Everything about a step that stays while the mods, shapes, dtypes and stream do: the
    kernel config with the mods rewritten to true positions, its runner, the captures
    converted for the launch, a device buffer [lengths; query offsets] the mods' offset
    capture reads — each step uploads its values into it, so a plan serves every step of a
    decoder — with its uploader, the arrival tickets, and the split counts and partial
    views already seen. Plans are kept per call shape (``_PREPARED``, and the adapters'
    own caches): a repeated step skips the checks, the rewrite and the conversions.

    ``run`` is a whole step (lengths checked and uploaded, split count, launch) under the
    workspace's lock; ``step`` uploads and returns the launch (benchmarks, tests)."""

    def __init__(self, q, k, table, out, page_size: int, tuning: DecodeTuning, site: DecodeSite, mods: DecodeMods):
        device, workspace, score_mod, mask, scale = site.device, site.workspace, mods.score_mod, mods.mask, mods.scale
        B, Hq, q_len, D = (int(s) for s in q.shape)
        paged = page_size > 0
        self.kv_heads = int(k.shape[2] if paged else k.shape[1])
        # Keys a length may reach: past them the kernel would read outside the cache.
        self.capacity = int(table.shape[1]) * page_size if paged else int(k.shape[2])
        self.paged = paged
        self.q_len, self.batch = q_len, B
        self.workspace = workspace   # held: its id in the plan's key is never reused meanwhile
        self.lock = workspace.lock
        num_mma_wg, self.m_blocks, tuning = _row_blocks(Hq, self.kv_heads, q_len, tuning, D)
        self.tuning = tuning
        self.scale = float(scale) if scale is not None else 1.0 / math.sqrt(D)
        self.part_shapes = ((B, Hq, q_len, D), (B, Hq, q_len))
        self._part_sizes = (B * Hq * q_len * D, B * Hq * q_len)

        # Mods at true positions: query row i of sequence b sits at lengths[b] - q_len + i,
        # read from row 1 of the positions buffer (row 0: the lengths the kernel bounds keys by).
        self.positions = workspace.alloc((2, B), "int32")
        self.seq_lens, q_offset = self.positions[0], self.positions[1]
        self._put = workspace.uploader(self.positions)
        self._uploaded = None        # the values of the last upload into positions
        base = None if mask is None else as_mask(mask, "mask")
        shift = mods.true_positions
        # The first query's position: None at the end of each sequence (true positions), else 0.
        self._first_query = None if shift else 0
        # For the planner's live_blocks; None when it can never skip (at true positions,
        # may_skip_head says so cheaply; at given positions live_blocks asks the mask itself).
        # (a walk's mask reads its table, which no analysis sees through: nothing to skip,
        # and its plan serves other captures: ``rebind``)
        self._base_mask = base if (not _is_full(base) and not mods.full_but_last and not mods.listed_walk
                                   and (not shift or may_skip_head(base))) else None
        at = _at_true_positions if shift else (lambda mod, _: mod)
        the_mask = None if _is_full(base) else at(base, q_offset)
        the_score = None if score_mod is None else at(as_score(score_mod, "score_mod"), q_offset)
        # A walk of listed blocks: its mask reads the block table, which no interval analysis
        # sees through (no masked prefix to find). Full ones listed first: the mask matters
        # on the last page alone.
        walk = mods.listed_walk or mods.full_but_last
        self.config = _config_for(KERNEL_DTYPES[dtype_name(q)], D, num_mma_wg, page_size, the_score, the_mask,
                                  tuning, skip_masked_prefix=not walk and not head_always_kept(base, B, Hq),
                                  mask_last_page_only=mods.full_but_last,
                                  prefix_band=None if walk else _planned_band_prefix(base, the_mask, shift))

        from ..kernels.decode.polled_merge import chunk_splits
        from ..kernels.emit.mod_emit import capture_kinds

        # Polled merges whose split count holds across steps load exactly that many splits
        # in their first round (``stable_merge_chunk``: a filled band's); FLEXATTN_DECODE_
        # MERGE_CHUNK=generic (read once per plan) keeps the head dim's chunk, for A/B runs.
        exact_chunks = os.environ.get("FLEXATTN_DECODE_MERGE_CHUNK", "exact") != "generic"
        self._band_hi = host_band_hi(self.config.prefix_band, the_mask) if exact_chunks else None
        self._max_chunk = chunk_splits(D)

        self.ffi = use_tvm_ffi(device)
        self._kernels: dict = {}     # (tuning, cluster size, polled, chunk, V zeroed) -> (config, runner)
        self._fns: dict = {}         # (the same key) -> the compiled TVM-FFI function, once launched
        self.stream = device.stream
        self._kinds, self._captures = capture_kinds(self.config.mods), self.config.mods.captures()
        self._to_device = device.to_device
        # One arrival counter per CTA group (grid dims 1 and 2), all zero between launches.
        self._tickets = workspace.tickets(self.batch * self.kv_heads * self.m_blocks)
        self._scratch = workspace.scratch
        # Zeroed slots for the polled merge, unless FLEXATTN_DECODE_MERGE=tickets (read once
        # per plan: a step's host time is tens of µs, an environment read ~1).
        self._marked = workspace.marked_scratch if os.environ.get("FLEXATTN_DECODE_MERGE", "auto") != "tickets" \
            else None
        # How the polled merge's slots return to zero (read once per plan): "parity" (the
        # default, where the workspace gives zeroed memory) — two sets in the plan's own
        # memory, by launch parity: the splits that do not merge zero their slots of the
        # other set after their partial stores, no merger empties anything
        # (``DecodeConfig.parity_slots``; H200, B1 L128k window 4096: 13.5-13.8 µs against
        # 13.7-14.0, docs/experiments.md session 70); "emptied" — the merger zeroes the
        # workspace's shared slots after its merge; benchmarks only, decode_floor.py --zero-slots
        # zeroing the slots between timed steps: "caller" — the emptied kernel without its
        # emptying, "parity-caller" — the parity kernel without its zeroing
        # (``caller_empties_slots``: what the zeroing costs, by its absence).
        slots = os.environ.get("FLEXATTN_DECODE_SLOTS", "parity")
        self._caller_empties = slots in ("caller", "parity-caller")
        self._parity = (slots in ("parity", "parity-caller") and workspace.zeroed is not None
                        and self._marked is not None)
        # Where a group's polled slots lie (read once per plan): "split" — split-major, each
        # split's slots of every row together ([splits, B, Hq, q_len, D]); "group" — a row's
        # splits side by side ([B, Hq, q_len, splits, D], LSEs [B, Hq, splits, q_len]), so a
        # merger's polls and emptying cover one contiguous span per row (``slot_views``).
        self._group_major = os.environ.get("FLEXATTN_DECODE_SLOT_LAYOUT", "split") == "group"
        # FLEXATTN_DECODE_BALANCED=1 (opt-in, read once per plan): split ranges balanced, the
        # planner's counts untrimmed (``DecodeConfig.balanced_splits``; B1 L128k window: 16
        # splits 13.4-13.9 µs against the planner's 13 at 13.5-13.8, H200, session 70: no
        # reliable gain).
        self._balanced = os.environ.get("FLEXATTN_DECODE_BALANCED", "0") == "1"
        self._overhang = v_overhang_policy()
        self._parity_parts = None    # (split capacity, O slots, LSE slots (flat, both sets), tickets + phase words, views)
        self._launches: dict = {}    # (kv blocks, SM count) -> choose_launch's (tuning, splits, cluster), polled
        self.q_heads = Hq
        self._parts: dict = {}       # (split count, polled) -> (scratch array, o_part, lse_part)
        # Numbers, read-only arrays and our positions buffer cannot change under the plan:
        # converted once; tensors read in place, once per data pointer; anything else
        # (writeable host arrays, strided tensors) per step (CaptureArgs).
        self._same_memory, self._stable = device.same_memory, (q_offset,)
        self._args = self._capture_args()

    def _capture_args(self) -> CaptureArgs:
        return CaptureArgs(self._captures, _converter(self.ffi, self._kinds, self._captures, self._to_device,
                                                      self.config.mods),
                           self._same_memory, ffi_tensors if self.ffi else None, stable=self._stable)

    def rebind(self, mods: DecodeMods) -> None:
        """This plan for a call whose mods have its mods' IR but capture other values (a
        walk's table of a new block mask, a closure's new tensor): the launch takes them
        from now on. Only for walks (``DecodeMods.listed_walk``, at flex_attention's
        positions): nothing else the plan decided read the captured values."""
        from ..kernels.emit.mod_emit import IRModHook

        if not mods.listed_walk or mods.true_positions:
            raise ValueError("rebind serves list walks at flex_attention's positions")
        base = None if mods.mask is None else as_mask(mods.mask, "mask")   # (as __init__ takes them)
        hook = IRModHook(None if mods.score_mod is None else as_score(mods.score_mod, "score_mod"),
                         None if _is_full(base) else base)
        captures = hook.captures()
        if len(captures) == len(self._captures) and all(a is b for a, b in zip(captures, self._captures)):
            return
        hook.capture_kinds = self._kinds
        self.config = self.config.with_mods(hook)
        self._captures = captures
        self._args = self._capture_args()

    def _kernel(self, kernel: tuple) -> tuple:
        """(config, runner) of `kernel` = (tuning, CTAs per merging cluster, polled merge,
        the polled merge's first chunk: ``DecodeConfig.merge_chunk``, V rows past the length
        zeroed: ``DecodeConfig.zero_v_overhang``)."""
        hit = self._kernels.get(kernel)
        if hit is None:
            from ..kernels.launch.cache import decode_runner

            tuning, cluster, polled, chunk, zero_v = kernel
            config = self.config
            if kernel[:4] != (self.tuning, 1, False, 0):
                config = _with_launch(config, tuning, cluster, polled)
                if polled and self._parity:
                    config = dataclasses.replace(config, parity_slots=True,
                                                 caller_empties_slots=self._caller_empties)
                elif polled and self._caller_empties:
                    config = dataclasses.replace(config, caller_empties_slots=True)
                if chunk:
                    config = dataclasses.replace(config, merge_chunk=chunk)
            if self._balanced:
                config = dataclasses.replace(config, balanced_splits=True)
            if zero_v:
                config = dataclasses.replace(config, zero_v_overhang=True)
            hit = self._kernels[kernel] = (config, decode_runner(config, self.ffi))
        return hit

    def _stage(self, lengths: list, num_sms: int, num_splits: int | None):
        """Check this step's lengths (ints, one per sequence), upload them with the query
        offsets, pick the launch -> (kernel, splits, o_part, lse_part) (``_launch_parts``)."""
        if len(lengths) != self.batch:
            raise ValueError(f"query batch {self.batch} does not match the cache's {len(lengths)}")
        q_len = self.q_len
        shortest = min(lengths, default=q_len)
        if shortest < q_len:
            raise ValueError(f"every sequence must already hold its {q_len} query tokens (append them first); "
                             f"lengths {list(lengths)}")
        longest = max(lengths, default=0)
        if longest > self.capacity:
            raise ValueError(f"lengths {list(lengths)} exceed the cache's capacity ({self.capacity} tokens)")
        values = (*lengths, *[n - q_len for n in lengths])
        if values != self._uploaded:
            # Only this plan writes its positions buffer, in stream order: lengths that did not
            # change since its last upload are there already (a flex_attention call against a
            # cache of fixed length, the short-query door, repeats them every call; the copy
            # cost ~2-3 µs of the stream per step at B 1, L 128k).
            self._put(values)
            self._uploaded = values
        return self._launch_parts(longest, num_sms, num_splits, self._zeroes_overhang(shortest))

    def _zeroes_overhang(self, shortest: int | None) -> bool:
        """Whether a step's kernel zeroes the V rows its last block reads past a length
        (``v_overhang_policy``): under "auto", where memory past a length is read — a paged
        cache (a page's tail), a sequence shorter than the view (``shortest``; None: the
        lengths are on the device only). Steps whose every length is the view's rows (the
        door's ``k_cache[:, :, :L]``) keep the kernel without it: past the view the TMA
        reads zeros."""
        if self._overhang != "auto":
            return self._overhang == "zero"
        return self.paged or shortest is None or shortest < self.capacity

    def _launch_parts(self, longest: int, num_sms: int, num_splits: int | None, zero_v: bool):
        """The launch for sequences of at most ``longest`` keys -> (kernel = (tuning,
        cluster, polled merge, merge chunk, V overhang zeroed), splits, o_part, lse_part)."""
        q_len = self.q_len
        if num_splits is None:
            key = (-(-longest // self.tuning.tile_n), num_sms)
            launch = self._launches.get(key)
            if launch is None:
                # Splits are sized by the blocks the kernel visits, not the cache's length
                # (a window's); planned once per block count (every tile_n tokens of decoding).
                live = live_blocks(self._base_mask, self.batch, self.q_heads, q_len, longest, self.tuning.tile_n,
                                   self._first_query)
                tuning, splits, cluster = choose_launch(self.batch, self.kv_heads, self.m_blocks, live, num_sms,
                                                       self.tuning, self._balanced)
                launch = self._launches[key] = (tuning, splits, cluster, self._polls(splits, cluster))
        else:
            if num_splits < 1:
                raise ValueError(f"num_splits must be >= 1, got {num_splits}")
            # An explicit count of 2, 4, 8 or 16 merges in one cluster (residency is the caller's call).
            from ..kernels.decode.sm90 import CLUSTER_SPLITS

            clustered = self.tuning.cluster_merge and num_splits > 1 and num_splits in CLUSTER_SPLITS
            cluster = int(num_splits) if clustered else 1
            launch = (self.tuning, int(num_splits), cluster, self._polls(int(num_splits), cluster))
        tuning, splits, cluster, polled = launch
        chunk = stable_merge_chunk(splits, self._max_chunk, self._band_hi, longest, q_len) if polled else 0
        kernel = (tuning, cluster, polled, chunk, zero_v)
        if polled and self._parity:
            return kernel, splits, *self._parity_slots(splits)
        o_size, lse_size = self._part_sizes
        flat = (self._marked if polled else self._scratch)(splits * (o_size + lse_size))
        parts = self._parts.get((splits, polled))
        if parts is None or parts[0] is not flat:
            o_part, lse_part = slot_views(flat[:splits * o_size], flat[splits * o_size:splits * (o_size + lse_size)],
                                          splits, 1, self.part_shapes[0], polled and self._group_major)
            parts = self._parts[(splits, polled)] = (flat, o_part, lse_part)
        return kernel, splits, parts[1], parts[2]

    def _parity_slots(self, splits: int) -> tuple:
        """(o_part, lse_part) of the parity slots for ``splits`` splits: views of the plan's
        own zeroed memory for a capacity of splits (at least 16), each split's two slots
        (one per set) side by side — mode 0 has this launch's split count (the kernel's
        grid) and a stride of two slots; the kernel finds set 1 half a stride in
        (``DecodeConfig.parity_slots``), and zeroes slots past the count where it shrank.
        Its tickets and phase words are the plan's own too (its state is this layout's,
        so it cannot share the workspace's). A split count past the capacity allocates
        anew, everything zero again (the kernel's state with it); steps on the stream keep
        their order, so the old memory's last launch is done."""
        parts = self._parity_parts
        if parts is None or parts[0] < splits:
            from ..kernels.decode.polled_merge import MAX_SPLITS

            cap = min(MAX_SPLITS, max(splits, 16))
            o_size, lse_size = self._part_sizes
            flat = self.workspace.zeroed(2 * cap * (o_size + lse_size), "float32")
            words = self.workspace.zeroed(2 * self.batch * self.kv_heads * self.m_blocks, "int32")
            parts = self._parity_parts = (cap, flat[:2 * cap * o_size], flat[2 * cap * o_size:], words, {})
        views = parts[4].get(splits)
        if views is None:    # (made once per split count: a step's host time counts)
            views = parts[4][splits] = slot_views(parts[1], parts[2], splits, 2, self.part_shapes[0],
                                                  self._group_major, capacity=parts[0])
        return views

    def _tickets_for(self, kernel: tuple):
        """The tickets `kernel` (``_kernel``) takes: the workspace's, or with
        parity slots the plan's own (tickets, then one phase word per group)."""
        return self._parity_parts[3] if kernel[2] and self._parity else self._tickets

    def _polls(self, splits: int, cluster: int) -> bool:
        """Whether ``splits`` merge polled (``polled_merge_pays``, where the workspace keeps
        zeroed slots)."""
        return self._marked is not None and polled_merge_pays(splits, cluster, self.config.head_dim)

    def _launcher(self, kernel, q, k, v, table, out, lse, o_part, lse_part, seq_lens=None, args=None) -> Callable:
        """The launch of `kernel` (``_kernel``) with these arguments (compiling on its
        first call); ``seq_lens``: the plan's own uploaded lengths, ``args``: its captures
        converted, unless given."""
        args = self._args.current() if args is None else args
        runner = self._kernel(kernel)[1]
        seq_lens = self.seq_lens if seq_lens is None else seq_lens
        if self.ffi:
            tickets, scale = self._tickets_for(kernel), self.scale

            def launch():
                fn = self._fns.get(kernel)
                if fn is None:
                    fn = self._fns[kernel] = runner.ffi_function()
                fn(q, k, v, table, seq_lens, out, lse, o_part, lse_part, tickets, scale, args)

            return launch
        run, tickets, scale, stream = runner.run, self._tickets_for(kernel), self.scale, self.stream
        return lambda: run(q, k, v, table, seq_lens, out, lse, o_part, lse_part, tickets, scale, args, stream)

    def run(self, q, k, v, table, out, lse, lengths: list, num_sms: int) -> int:
        """One whole step, the adapters' repeated-call path: ``lengths`` (ints, the
        cache's) checked and uploaded, the split count picked, the kernel launched — under
        the workspace's lock, so the launch follows its own upload in stream order. The
        arrays must be those the plan was made for (shapes, dtypes, strides, device:
        the caller's key says so). Returns the split count."""
        with self.lock:
            kernel, splits, o_part, lse_part = self._stage(lengths, num_sms, None)
            self._launch_now(kernel, q, k, v, table, out, lse, o_part, lse_part, self.seq_lens, self._args.current())
        return splits

    def run_device_lengths(self, q, k, v, table, out, lse, seq_lens, longest: int, num_sms: int,
                           captures: tuple | None = None) -> int:
        """``run`` for lengths already on the device (``seq_lens``: int32 [B], written in the
        stream's order by the caller; a graph's own values): no upload, the split count
        chosen for ``longest``, the most keys any sequence may hold (each sequence's splits
        divide its own length; a shorter one leaves splits empty, which the merge weighs
        zero). The positions buffer is not read: only walks at flex_attention's positions
        (``DecodeMods.true_positions`` False) run this way. ``captures``: this call's values
        for the mods' captures, in the hook's order, where they differ from the plan's (a
        repeated call of one structure, ``short_query.PreparedDeviceWalk``): converted for
        this launch alone, the plan left bound to its own."""
        if self._first_query is None:
            raise ValueError("device lengths serve queries at flex_attention's positions")
        if longest > self.capacity:
            raise ValueError(f"{longest} keys exceed the cache's capacity ({self.capacity} tokens)")
        with self.lock:
            kernel, splits, o_part, lse_part = self._launch_parts(longest, num_sms, None, self._zeroes_overhang(None))
            self._launch_now(kernel, q, k, v, table, out, lse, o_part, lse_part, seq_lens,
                             self._args.current() if captures is None else self._args_of(captures))
        return splits

    def _launch_now(self, kernel, q, k, v, table, out, lse, o_part, lse_part, seq_lens, args) -> None:
        """Launch ``kernel`` (``_kernel``): its TVM-FFI function once compiled (the
        repeated steps' path), else through ``_launcher`` (compiling first)."""
        fn = self._fns.get(kernel)
        if fn is not None:
            fn(q, k, v, table, seq_lens, out, lse, o_part, lse_part, self._tickets_for(kernel), self.scale, args)
        else:
            self._launcher(kernel, q, k, v, table, out, lse, o_part, lse_part, seq_lens, args)()

    def _args_of(self, captures: tuple):
        """``captures`` as this plan's TVM-FFI launch takes them (only TVM-FFI launches take
        captures per call)."""
        if not self.ffi:
            raise ValueError("captures given per launch need TVM-FFI launches")
        from ..kernels.launch.arguments import ffi_args

        return ffi_args(self._kinds, captures, self._to_device) or None

    def step(self, q, k, v, table, out, lse, lengths: list, num_sms: int,
             num_splits: int | None = None) -> DecodeLaunch:
        """This step's launch: its lengths uploaded, its split count and partials. Not
        locked: ``decode_into`` holds the lock around this and the launch."""
        kernel, splits, o_part, lse_part = self._stage(lengths, num_sms, num_splits)
        return DecodeLaunch(self._kernel(kernel)[0], splits,
                            self._launcher(kernel, q, k, v, table, out, lse, o_part, lse_part), self)


_PREPARED = PreparedCalls(capacity=64)


def _array_key(x) -> tuple:
    return None if x is None else (tuple(x.shape), dtype_name(x))


def _plan_for(q, cache, out, lse, site: DecodeSite, mods: DecodeMods, page_table, tuning: DecodeTuning | None):
    """(plan, k, v, table, host lengths as ints) for this step; checks before anything compiles."""
    paged = hasattr(cache, "page_table")
    k, v = (cache.k_pages, cache.v_pages) if paged else (cache.k, cache.v)
    table = (cache.page_table if page_table is None else page_table) if paged else None
    page_size = cache.page_size if paged else 0
    tuning = DEFAULT_TUNING if tuning is None else tuning
    workspace = site.workspace
    call = mods.call
    identity = call_identity(call)
    key = None if identity is None else identity + (
        tuning, page_size, id(workspace), site.device.stream, tuple(q.shape), dtype_name(q), _array_key(k),
        _array_key(v), _array_key(table), _array_key(out), _array_key(lse))
    plan = None if key is None else _PREPARED.get(key)
    if plan is None or plan.workspace is not workspace:
        _check_step(q, k, v, table, page_size, out, lse)
        plan = DecodePlan(q, k, table, out, page_size, tuning, site, mods)
        if key is not None:
            _PREPARED.add(key, call, lambda: plan)
    return plan, k, v, table, cache.host_lengths().tolist()


def prepare_decode(q, cache, out, lse, site: DecodeSite, mods: DecodeMods = NO_MODS, *, page_table=None,
                   overrides: DecodeOverrides = NO_OVERRIDES) -> DecodeLaunch:
    """Plan one decode step for the split-KV kernel (``decode_into`` runs it): ``q`` [B, Hq, q_len, D] (the last
    q_len tokens of each sequence, already appended to ``cache``) → ``out`` [B, Hq, q_len, D]
    (contiguous, q's dtype) and ``lse`` [B, Hq, q_len] (float32, natural log), on ``site``
    (device, SM count, workspace) with ``mods`` (score mod, mask, scale).

    ``page_table`` overrides the paged cache's table (the adapter passes an int32 copy);
    ``overrides`` the kernel shape / the launch heuristic (benchmarks, tests). A step like
    an earlier one — the same mod objects (``Mod`` values: plain functions are traced
    anew), scale, tuning, workspace and stream, arrays of the same shapes and dtypes —
    reuses that step's ``DecodePlan``: only the lengths are read and checked. The lengths
    are uploaded here, into the plan's buffer: launch a step before preparing the next one
    of the same plan (it would overwrite them), and from one thread per stream
    (``decode_into`` holds the workspace's lock)."""
    plan, k, v, table, lengths = _plan_for(q, cache, out, lse, site, mods, page_table, overrides.tuning)
    return plan.step(q, k, v, table, out, lse, lengths, site.num_sms, overrides.num_splits)


def _check_step(q, k, v, table, page_size: int, out, lse) -> None:
    """Everything about the arrays the kernel cannot take, refused before anything compiles."""
    reason = decode_unsupported(q, k, v, page_size)
    if reason:
        raise ValueError(reason)
    if len(q.shape) != 4:
        raise ValueError(f"query must be 4-D [B, Hq, q_len, D], got shape {tuple(q.shape)}")
    B, Hq, q_len, D = (int(s) for s in q.shape)
    kv_heads = int(k.shape[2] if page_size else k.shape[1])
    if not 1 <= q_len <= DECODE_MAX_Q_LEN:
        raise ValueError(f"the decode kernel takes 1..{DECODE_MAX_Q_LEN} query tokens, got {q_len}")
    if kv_heads == 0 or Hq % kv_heads:
        raise ValueError(f"query heads ({Hq}) must be a multiple of the cache's kv heads ({kv_heads})")
    if page_size and dtype_name(table) != "int32":
        raise ValueError(f"the GPU decode kernel reads an int32 page table, got {dtype_name(table)}")
    if tuple(out.shape) != (B, Hq, q_len, D) or tuple(lse.shape) != (B, Hq, q_len):
        raise ValueError(f"out/lse must be [B, Hq, q_len, D] / [B, Hq, q_len], got {tuple(out.shape)} / {tuple(lse.shape)}")


def mod_key(mod):
    """A mod's part of a plan key: its IR's identity and its captures (numbers by value,
    arrays by identity). The trace cache hands out a new mod object per call for one
    function, so mod objects do not key plans here; the plan holds the IR and the
    captures, so their ids stay theirs while it is kept."""
    if mod is None:
        return None
    return (id(mod.expr), tuple(c if isinstance(c, (int, float)) else id(c) for c in mod.captures))


def structure_key(mod):
    """A mod's part of a walk's plan key (``attention_plan``): its IR's identity and what
    its captures are (numbers, arrays by shape and dtype), not which."""
    if mod is None:
        return None
    return (id(mod.expr), tuple(("number",) if isinstance(c, (int, float)) else
                                (tuple(getattr(c, "shape", ())), str(getattr(c, "dtype", type(c))))
                                for c in mod.captures))


def attention_plan(q, k, v, out, lse, site: DecodeSite, mods: DecodeMods, table=None,
                   page_size: int = 0) -> DecodePlan:
    """The plan of the decode kernel as an ordinary attention call (``core/short_query.py``
    routes short queries here): q [B, Hq, q_len, D] against all of k, v [B, Hkv, KV, D]
    (views of a larger cache welcome) — or, with a ``table`` (int32 [B, blocks] on the
    device), against the blocks it lists of k, v as pages [pages, page_size, Hkv, D]
    (views welcome) — queries at the positions ``mods.true_positions`` says; ``mods``
    holds ``Mod`` values. Kept per call shape like a decoding step's (bounded; an entry
    holds its captured arrays until it is evicted)."""
    # A walk's plan is kept by its mods' IR alone and rebound to each call's captures (a
    # block mask sliced or converted anew each step brings a new table, a closure a new
    # tensor); other plans by their captures too (planning read their values).
    mod_part = structure_key if mods.listed_walk and not mods.true_positions else mod_key
    key = ("attention", mod_part(mods.score_mod), mod_part(mods.mask), mods.scale, mods.true_positions,
           mods.full_but_last, mods.listed_walk,
           id(site.workspace), site.device.stream, tuple(q.shape), dtype_name(q), _array_key(k), _array_key(v),
           _array_key(out), _array_key(lse), _array_key(table), page_size)
    plan = _ATTENTION_PLANS.get(key)
    if plan is None or plan.workspace is not site.workspace:
        _check_step(q, k, v, table, page_size, out, lse)
        plan = DecodePlan(q, k, table, out, page_size, DEFAULT_TUNING, site, mods)
        keep_bounded(_ATTENTION_PLANS, key, plan, _ATTENTION_PLANS_CAPACITY)
    elif mod_part is structure_key:
        plan.rebind(mods)
    return plan


@dataclass(frozen=True)
class FixedLaunch:
    """The decode kernel for calls whose every sequence holds ``kv_len`` keys, decided once
    on the host (an XLA entry's compile-time choice): ``config`` (its mods capture-free;
    ``hook`` carries this call's captures, in argument order), the split count and the
    arrival tickets it needs."""

    config: object
    hook: object
    num_splits: int
    num_tickets: int


def fixed_length_launch(q_shape, kv_heads: int, kv_len: int, dtype: str, mods: DecodeMods,
                        num_sms: int) -> FixedLaunch:
    """What ``DecodePlan`` decides per step, for a fixed length and queries at the
    positions flex_attention gives them (``mods.true_positions`` False; the XLA route of
    ``core/short_query.py``): the kernel shape, the mods, the splits (``choose_launch`` over
    ``live_blocks``) and how they merge."""
    from ..kernels.emit.mod_emit import IRModHook, capture_kinds

    if mods.true_positions:
        raise ValueError("fixed_length_launch takes queries at flex_attention's positions")
    B, Hq, q_len, D = (int(x) for x in q_shape)
    num_mma_wg, m_blocks, tuning = _row_blocks(Hq, kv_heads, q_len, DEFAULT_TUNING, D)
    base = None if mods.mask is None else as_mask(mods.mask, "mask")
    mask = None if _is_full(base) else base
    score = None if mods.score_mod is None else as_score(mods.score_mod, "score_mod")
    config = _config_for(KERNEL_DTYPES[dtype], D, num_mma_wg, 0, score, mask, tuning,
                         skip_masked_prefix=not head_always_kept(base, B, Hq),
                         prefix_band=_planned_band_prefix(base, mask, False))
    live = live_blocks(mask, B, Hq, q_len, kv_len, tuning.tile_n, first_query=0)
    chosen, splits, cluster = choose_launch(B, kv_heads, m_blocks, live, num_sms, tuning)
    if (chosen, cluster) != (tuning, 1):
        config = _with_launch(config, chosen, cluster)
    hook = config.mods
    template = IRModHook(*(None if m is None else m.with_captures((None,) * len(m.captures))
                           for m in (score, mask)))
    template.capture_kinds = capture_kinds(hook)
    return FixedLaunch(config.with_mods(template), hook, splits, B * kv_heads * m_blocks)


_ATTENTION_PLANS: dict = {}
_ATTENTION_PLANS_CAPACITY = 32


def attention_into(q, k, v, out, lse, site: DecodeSite, mods: DecodeMods) -> None:
    """Run ``attention_plan``'s plan: each call uploads the lengths (KV per sequence)."""
    plan = attention_plan(q, k, v, out, lse, site, mods)
    plan.run(q, k, v, None, out, lse, [int(k.shape[2])] * int(q.shape[0]), site.num_sms)


def decode_into(q, cache, out, lse, site: DecodeSite, mods: DecodeMods = NO_MODS, *, page_table=None,
                overrides: DecodeOverrides = NO_OVERRIDES) -> DecodeLaunch:
    """Run one decode step with the split-KV kernel; see ``prepare_decode``. The upload and
    the launch happen under the workspace's lock (threads sharing a stream)."""
    plan, k, v, table, lengths = _plan_for(q, cache, out, lse, site, mods, page_table, overrides.tuning)
    with plan.lock:
        step = plan.step(q, k, v, table, out, lse, lengths, site.num_sms, overrides.num_splits)
        step.launch()
    return step


__all__ = ["DECODE_MAX_Q_LEN", "DEFAULT_TUNING", "fit_head_dim", "DecodeLaunch", "DecodeMods", "DecodeOverrides", "DecodePlan",
           "DecodeSite", "DecodeTuning", "DecodeWorkspace", "FixedLaunch", "StagingRing", "attention_into",
           "attention_plan", "choose_splits", "decode_into", "decode_unsupported", "fixed_length_launch",
           "prepare_decode"]
