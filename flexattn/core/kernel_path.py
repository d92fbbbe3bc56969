"""The GPU path: choose a kernel configuration for a call and launch it on the caller's stream.

Framework-neutral and destination-passing: the adapter allocates ``out``/``lse`` and
supplies a ``Device`` (its stream and a way to put host arrays — block-mask lists,
captured buffers — on the GPU). Everything the kernel cannot do is refused here with a
clear error before any compilation or launch.

Block structure, cheapest first:
- no mask → dense;
- a causal mask (``q_idx >= kv_idx`` however spelled, read from its IR by
  ``mods.structure``), given as ``mask=`` or as a block mask built from it alone → the
  kernel's causal structure (diagonal mask built in, no lists to read);
- a block mask (given, or built here from ``mask=``) → block-sparse lists; full tiles skip
  the mask, empty tiles are never loaded.

Tile scheduling (kernels/hopper/tile_scheduler.py): the dense structure, where every tile does the
same work, runs persistent CTAs (one per SM; +3-5% measured on H100 at S=2k-4k, D=128);
causal runs one CTA per tile in longest-first order (the hardware's dynamic dispatch then
balances the uneven tiles: +4% over head order); block-sparse runs persistent CTAs when its
host lists show every q tile visiting about as many kv tiles (``BALANCED_TILES``: windows,
documents; +4-9% measured), else one CTA per tile. Inside ``gpu_shared()`` (context
parallelism: NCCL's kernels run beside ours) every launch runs one CTA per tile.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from ..arrays import dtype_name
from ..bounded import keep_bounded
from ..blockmask import _LIST_NAMES, BlockMask, create_block_mask
from ..blockmask.coarsen import at_block_size
from ..kernels.hopper.device_facts import persistent_ctas
from ..mods.structure import canonical_band, is_causal
from ..problem.spec import AttentionSpec
from ..problem.validate import AttentionShape

KERNEL_DTYPES = {"bfloat16": "bf16", "float16": "fp16"}   # every kernel's
# The forward also takes float32: tf32 MMAs, one pass or three (3xTF32) as the adapter's
# float32 matmul precision says (``Device.tf32_passes``; kernels/fwd/sm90.py).
FORWARD_DTYPES = {**KERNEL_DTYPES, "float32": "fp32"}
# The forward kernel takes any query and value head dim that is a multiple of 16 up to 256
# (wgmma's k step; TMA's 16-byte rows); the backward, query and value head dims among these
# from 32 (equal or not: ``BwdConfig.head_dim_v``; beyond 128 ``BwdConfig.split_head_dim``),
# trained against float64 on the H100 (tests/gpu/test_head_dims_gpu.py, 2026-11-27); decode steps go to the split-KV kernel at
# every multiple of 16 from 32 to 256 with equal value head dim (``decode_path.fit_head_dim``,
# ``decode.combine.lane_columns``; tests/gpu/test_decode_gpu.py, 2026-11-27).
BACKWARD_HEAD_DIMS = tuple(range(32, 257, 16))
DECODE_HEAD_DIMS = tuple(range(32, 257, 16))
TILE_N = 128


@dataclass(frozen=True)
class Device:
    """What the core needs from an adapter to run on its GPU."""

    stream: int  # a CUstream handle (0 = the legacy default stream)
    to_device: Callable  # host/framework array -> contiguous DLPack array on the GPU
    # True if TVM-FFI launches land on `stream` by themselves (torch: TVM-FFI reads
    # torch's current stream); other frameworks take the from_dlpack runner, which is
    # handed `stream` explicitly.
    tvm_ffi_stream: bool = False
    # () -> (SM count, this stream's decode workspace): lets the core send short-query
    # calls to the decode kernel (core/short_query.py). None: this adapter never does.
    decode_resources: Callable | None = None
    # alloc(shape, dtype name, zeroed) -> a contiguous GPU array (backward_path.Allocator):
    # scratch the forward needs for float32 inputs (their tf32 operands). None: float32
    # inputs are refused.
    alloc: Callable | None = None
    # float32 inputs: tf32 MMAs per product, 3 (3xTF32, about float32's accuracy: torch's
    # "highest" matmul precision) or 1 (tf32: "high" / "medium").
    tf32_passes: int = 3
    # () -> an int32 GPU array of at least one zero for one launch's tile tickets
    # (FwdConfig.tile_tickets), private to the stream that launch goes to (the kernel
    # leaves it zero, so it may be the stream's own, kept). None: a fresh zeroed array
    # per launch from `alloc`.
    tile_tickets: Callable | None = None
    # (k, block, fold=False) -> k [B, Hkv, KV, D] as pages [KV / block, block, Hkv, D] (a
    # view), where every sequence reads the same keys (batch 1, or a stride-0 batch: a key /
    # value batch of 1 broadcast) and blocks tile KV; with ``fold``, a batched k as pages of
    # B x Hkv heads [KV / block, block, B x Hkv, D] (its batch stride Hkv head strides);
    # else None. Lets a short query walk the kv blocks its block mask lists with the decode
    # kernel (``short_query.list_walk_route``: torch's PagedAttention). None: never.
    page_view: Callable | None = None
    # (x, copy) -> x [B, H, ...] as [1, B x H, ...]: a view, or with ``copy`` a copy where
    # the strides do not merge; else None (a folded walk's q, out and LSE). None: never.
    heads_view: Callable | None = None
    # x -> a key that stays equal while ``to_device(x)`` hands the kernel the same memory
    # (a framework tensor already on this GPU and contiguous: its data pointer), else None
    # (``to_device`` copies it). Lets prepared launches convert such captures once per key
    # (``CaptureArgs``). None: they are converted per launch.
    same_memory: Callable | None = None


def kernel_unsupported(q, shape: AttentionShape) -> str | None:
    """Why the forward kernel cannot run these inputs, or None."""
    if dtype_name(q) not in FORWARD_DTYPES:
        return f"the GPU kernel supports bfloat16, float16 and float32 inputs, got {dtype_name(q)}"
    for name, d in (("head dim", shape.head_dim), ("value head dim", shape.v_head_dim)):
        if d % 16 or not 16 <= d <= 256:
            return f"the GPU kernel supports {name}s that are multiples of 16 up to 256, got {d}"
    return None


def backward_unsupported(shape: AttentionShape, q=None) -> str | None:
    """Why the backward kernels cannot differentiate a call of this shape (and of ``q``'s
    dtype, if given), or None (checked before the forward runs, where autograd will need
    the backward)."""
    if q is not None and dtype_name(q) not in FORWARD_DTYPES:
        return f"the GPU backward supports bfloat16, float16 and float32 inputs, got {dtype_name(q)}"
    fp32 = q is not None and dtype_name(q) == "float32"
    return backward_unsupported_dims(shape.head_dim, shape.v_head_dim, fp32)


def backward_unsupported_dims(head_dim: int, v_head_dim: int, fp32: bool = False) -> str | None:
    """``backward_unsupported`` by head dims (and, with ``fp32``, those the float32 kernel's
    tiles fit): also what every adapter's backward plan (``backward_path.backward_config``)
    refuses, whether or not its adapter asked first."""
    if head_dim not in BACKWARD_HEAD_DIMS or v_head_dim not in BACKWARD_HEAD_DIMS:
        return (f"the GPU backward supports query and value head dims {BACKWARD_HEAD_DIMS}, got"
                f" {head_dim}/{v_head_dim} (the forward alone runs any multiple of 16 up to 256:"
                " call it without gradients, e.g. under torch.no_grad())")
    return _fp32_backward_unsupported(head_dim, v_head_dim) if fp32 else None


@functools.lru_cache(maxsize=None)
def _fp32_backward_unsupported(head_dim: int, v_head_dim: int) -> str | None:
    """Why the float32 backward (kernels/bwd/tf32_sync.py) cannot take these head dims (its
    tiles must fit shared memory: BwdConfig's own check), or None."""
    from ..kernels.bwd.plan import fp32_tile_m
    from ..kernels.bwd.sm90 import BwdConfig

    try:
        BwdConfig(dtype="fp32", head_dim=head_dim, head_dim_v=v_head_dim, tile_m=fp32_tile_m(head_dim, v_head_dim))
    except ValueError as e:
        return str(e)
    return None


# Keys per stage of the forward's K/V ring, largest first: the first whose shared memory
# fits (`_forward_tiles`). 128 up to head dim 128 (and 192/128); FA3's choices above it.
_TILE_N_CHOICES = (128, 112, 96, 80, 64)


def _forward_tiles(shape: AttentionShape, tile_m: int, lists: bool, persistent: bool) -> tuple:
    """(tile_n, num_stages, persistent) for the forward at this call's head dims: two K/V
    stages of the largest tile_n that fits shared memory; block-sparse lists need tile_n
    to divide their 128-key blocks: 128, or 64 where less than 128 fits (wide heads; the
    kernel expands each listed block into two tiles); persistent CTAs (a separate O
    buffer) only where that fits too."""
    d, dv = shape.head_dim, shape.v_head_dim

    def fits(tile_n, stages, separate_o):
        return _shared_fits(shape, tile_m, tile_n, stages, separate_o)

    # 192-row tiles beyond head dim 64: at most 112 keys, or the S fragment spills at 160
    # registers (128 keys: 240 B at D 96).
    choices = [t for t in _TILE_N_CHOICES if not (tile_m == 192 and max(d, dv) > 64 and t > 112)]
    tile_n = next((t for t in choices if fits(t, 2, False)), choices[-1])
    if lists and tile_n != TILE_N:
        tile_n = TILE_N // 2
    return tile_n, 2, persistent and fits(tile_n, 2, True)


def _shared_fits(shape: AttentionShape, tile_m: int, tile_n: int, stages: int, separate_o: bool) -> bool:
    """Whether the 16-bit forward's shared memory fits (O apart from Q: persistent CTAs,
    or value heads wider than the keys')."""
    from ..kernels.fwd.sm90 import shared_bytes
    from ..kernels.hopper.mma import SMEM_CAPACITY

    d, dv = shape.head_dim, shape.v_head_dim
    return shared_bytes(tile_m, tile_n, stages, d, dv, separate_o or dv > d) <= SMEM_CAPACITY


# fp32's K/V tiles (`_fp32_tiles`): multiples of 8 keys (V^T's key groups).
_FP32_TILE_N = (128, 96, 64, 48, 32, 16)


def _fp32_tiles(shape: AttentionShape, parts: int, lists: bool) -> tuple:
    """(tile_m, tile_n, num_stages) of the fp32 forward: 4-byte operands, twice over for
    3xTF32, fill shared memory twice as fast as 16-bit ones. Two 128-row consumer
    warpgroups; two K/V stages of at least 64 keys, else one stage of the widest tile that
    fits, else 64-row tiles (3xTF32 at head dim > 128). Block-sparse lists need tile_n to
    divide their 128-key blocks."""
    from ..kernels.fwd.sm90 import shared_bytes
    from ..kernels.hopper.mma import SMEM_CAPACITY

    d, dv = shape.head_dim, shape.v_head_dim
    choices = [t for t in _FP32_TILE_N if not lists or TILE_N % t == 0]
    if parts == 2 and dv <= d:
        # 3xTF32 sums S over the head dim in pieces (FwdConfig.s_promote), whose second S
        # accumulator fits beside 128-row tiles up to 64 keys (80/80's one 96-key stage
        # spilled 544-672 bytes with it, 32/32's 128-key stages 644).
        choices = [t for t in choices if t <= 64]
    for tile_m in (128, 64):
        for tile_n, stages in [(t, 2) for t in choices if t >= 64] + [(t, 1) for t in choices]:
            if shared_bytes(tile_m, tile_n, stages, d, dv, dv > d, elem_bytes=4, parts=parts) <= SMEM_CAPACITY:
                return tile_m, tile_n, stages
    raise ValueError(f"float32 at head dims {d}/{dv} does not fit shared memory")   # not reached for D <= 256


def _is_full(mask) -> bool:
    """No mask, or one that attends everywhere."""
    return mask is None or mask.attends_everywhere


_BUILT: dict = {}  # block masks built for ``mask=`` calls, see _block_mask_for
_BUILT_CAPACITY = 64


def _block_mask_for(mask, shape: AttentionShape) -> BlockMask:
    """The kernel's block mask for an element mask, reused across calls when nothing it
    depends on can have changed: captures that are numbers or read-only numpy arrays
    (built-ins' own arrays) are immutable; anything else (a tensor may be updated in
    place) means building anew each call — pass ``block_mask=`` to avoid that."""
    deps = mask.depends_on
    dims = (shape.batch if "b" in deps else None, shape.q_heads if "h" in deps else None, shape.q_len, shape.kv_len)
    immutable = all(isinstance(c, (int, float)) or (isinstance(c, np.ndarray) and not c.flags.writeable)
                    for c in mask.captures)
    key = (mask.structure_key, tuple(c if isinstance(c, (int, float)) else id(c) for c in mask.captures), dims)
    if immutable and key in _BUILT:
        return _BUILT[key]
    block_mask = create_block_mask(mask, *dims, BLOCK_SIZE=(128, TILE_N))
    if immutable:
        keep_bounded(_BUILT, key, block_mask, _BUILT_CAPACITY)  # holds the captures alive, so their ids stay theirs
    return block_mask


@dataclass(frozen=True)
class KernelPlan:
    """The compile-time configuration plus the runtime block lists of one call."""

    config: object  # kernels.fwd.sm90.FwdConfig (its hook carries this call's captures)
    block_mask: BlockMask | None
    entry: object = None  # the cached _PlanEntry it came from (runner lookups), if any
    backward_ctas: int = 0  # persistent CTAs for this call's backward (``_backward_ctas``), or 0


class _PlanEntry:
    """A planned structure: the config and its runners. The config's hook holds the mods'
    IR (so the ids in the entry's key stay theirs while it is cached) but no captured
    values: a cache entry must not keep a call's tensors alive."""

    __slots__ = ("config", "kinds", "runners")

    def __init__(self, config, kinds):
        self.config, self.kinds, self.runners = config, kinds, {}


def _structure_only(mod):
    """``mod`` with its captures replaced by None: the IR without the values."""
    return None if mod is None else mod.with_captures((None,) * len(mod.captures))


_PLANS: dict = {}  # see plan_forward
_PLANS_CAPACITY = 256

# Launches planned inside gpu_shared() run one CTA per tile, never persistent CTAs: a
# persistent kernel deals its tiles out statically, so a CTA whose SM another kernel holds
# (NCCL's transfer, 16 CTAs, spinning until its peer is ready) starts its whole share late
# and the launch lasts the other kernel's time plus its own. 4x H100, 2026-11-27, context
# parallelism: a 32k x 32k dense pair 11.0 -> 12.9 ms beside a 2 ms transfer, a 64k x 64k
# one 26 -> 52 ms beside a 28 ms wait. One CTA per tile lets the hardware hand the held
# SMs' tiles to the others; at these lengths persistence gains nothing.
_GPU_SHARED = contextvars.ContextVar("flexattn_gpu_shared", default=False)


@contextlib.contextmanager
def gpu_shared():
    """Within this block (this thread or task), forward launches are planned for a GPU
    whose SMs other kernels take at any time: one CTA per tile."""
    token = _GPU_SHARED.set(True)
    try:
        yield
    finally:
        _GPU_SHARED.reset(token)


class BlockStructure(NamedTuple):
    """How a call's kernels walk their tiles (cheapest first): ``causal`` (the kernel's own
    diagonal), ``band`` (the forward walks the mask's band of diagonals by arithmetic; the
    backward reads ``block_mask``'s lists), ``block_mask``'s lists, or dense (neither)."""

    causal: bool
    band: bool
    mask: object         # the element mask partial tiles evaluate, or None
    block_mask: object   # BlockMask | None: the lists the (backward) kernels read
    full_only: bool      # block_mask is known to list no partial tile (`full_tiles_only`)


def full_tiles_only(block_mask: BlockMask) -> bool:
    """Whether ``block_mask`` is known to hold no partial tile (``has_partial_tiles``): its
    kernels then leave the mask and the partial-tile walk out. ``FLEXATTN_FULL_ONLY=0``
    says no, for A/B runs."""
    return os.environ.get("FLEXATTN_FULL_ONLY") != "0" and block_mask.has_partial_tiles() is False


def _block_structure(spec: AttentionSpec, shape: AttentionShape) -> BlockStructure:
    """The ``BlockStructure`` of a call.

    The structure comes from the mask's IR (``mods.structure``), whatever door it came
    through: a ``mask=`` that is exactly ``q_idx >= kv_idx``, or a block mask built from
    such a mask alone (``from_mask``: its lists add nothing to the mask), runs the
    kernel's causal structure; a band of diagonals (sliding windows) the band structure.
    The mask partial tiles evaluate is a band's canonical form
    (``mods.structure.canonical_band``) where it is one."""
    block_mask = spec.block_mask
    mask = spec.mask
    causal = False
    # A block mask made from its mask alone adds nothing to it: the mask decides.
    mask_alone = block_mask is None or block_mask.from_mask
    if block_mask is not None and block_mask.BLOCK_SIZE != (128, TILE_N):
        # At another BLOCK_SIZE: built anew from its mask, or its lists read on the kernels'
        # tiles with their meaning kept (blockmask/coarsen.py); once per block mask.
        block_mask = at_block_size(block_mask, (128, TILE_N))
    if block_mask is not None and block_mask.from_mask and is_causal(block_mask.mask_mod):
        mask, block_mask = block_mask.mask_mod, None
    if block_mask is None and is_causal(mask):
        causal, mask = True, None  # the kernel's own diagonal mask
    elif block_mask is None and not _is_full(mask):
        block_mask = _block_mask_for(mask, shape)
    full_only = False
    if block_mask is not None:
        mask = None if _is_full(block_mask.mask_mod) else block_mask.mask_mod
        # No partial tile: the mask is never evaluated (full tiles skip it, as in torch),
        # so the kernel leaves it out (and plan_forward the partial-tile walk). Not known
        # yet (a GPU-built mask's host copy in flight): planned with the mask, the same
        # results.
        full_only = full_tiles_only(block_mask)
        if full_only:
            mask = None
    band = None
    if mask is not None:
        # Every spelling of a band evaluates one IR on partial tiles: one kernel for them all.
        band = canonical_band(mask)
        mask = mask if band is None else band
    return BlockStructure(causal, band is not None and mask_alone, mask, block_mask, full_only)


# Block-sparse rows whose tile counts stay within this factor of the mean run persistent
# CTAs like the dense structure: H100 2026-11-22, B4 S4096 H16 D128, window 1024 (balance
# 1.14) 0.280 -> 0.270 ms, 4 documents (1.0) 0.283 -> 0.259 ms. Unbalanced rows (a causal
# block mask: ~1.9) keep one CTA per tile, which the hardware balances dynamically.
BALANCED_TILES = 1.25
# The band structure (no list reads) gains from persistent CTAs further: H100 2026-11-26,
# window 1024 H16 D128, B8 S2048 (balance 1.33) 0.2442 -> 0.2401 ms, B4 S4096 (1.14)
# 0.2777 -> 0.2661 ms.
BALANCED_BAND_TILES = 1.5


def _balanced(block_mask: BlockMask | None, band: bool = False) -> bool:
    balance = None if block_mask is None else block_mask.tile_balance()
    return balance is not None and balance <= (BALANCED_BAND_TILES if band else BALANCED_TILES)


def _clusters_pay(shape: AttentionShape) -> bool:
    """Dense and causal calls run clusters of 2 CTAs sharing each K/V load (TMA
    multicast) at head dim 128, when each head has an even number of 128-row q tiles (a
    cluster's two tiles share a head). H100 2026-11-22, H16 D128 TFLOP/s: dense
    persistent B4 S4096 612 -> 652, B8 S2048 592 -> 627; causal B4 S4096 569 -> 575,
    B2 S8192 614 -> 622, B8 S2048 492 -> 492. Head dim 64 (192-row tiles): no gain.
    Also 192/128 (DeepSeek's MLA shape; 128 keys per tile fit two stages there, which
    clusters under causal need): H200 2026-11-28, causal B4 S4096 H16, forced configs side
    by side (sweep_fwd_configs.py), one CTA per tile 553.1 -> clusters 601.5 (FA4 616.4).
    ``FLEXATTN_CLUSTERS=0`` turns clusters off everywhere, for A/B runs."""
    if os.environ.get("FLEXATTN_CLUSTERS") == "0":
        return False
    return (shape.v_head_dim == 128 and shape.head_dim in (128, 192)
            and -(-shape.q_len // 128) % 2 == 0)


def _list_clusters_pay(block_mask: BlockMask, band) -> bool:
    """Block lists that run clusters of 2 CTAs as dense calls do (with `_clusters_pay`):
    128-row q blocks whose rows pair up (`BlockMask.row_pairs_match`: documents on 256-token
    boundaries), so both CTAs of a cluster walk identical lists and share each K/V load. Not
    bands (their rows differ). ``FLEXATTN_LIST_CLUSTERS=0`` turns it off, for A/B runs."""
    if band or block_mask.BLOCK_SIZE[0] != 128:
        return False
    if os.environ.get("FLEXATTN_LIST_CLUSTERS") == "0":
        return False
    return bool(block_mask.row_pairs_match())


def _two_rounds(shape: AttentionShape, ctas: int) -> bool:
    """At least two rounds of 128-row q tiles (over every head and batch) for `ctas` CTAs."""
    return -(-shape.q_len // 128) * shape.q_heads * shape.batch >= 2 * ctas


def _causal_tickets_pay(shape: AttentionShape, flag: str) -> bool:
    """Causal calls that run persistent CTAs by tickets, longest tile first (instead of one
    CTA per tile, in clusters at head dim 128), given two rounds of tiles: head dims up to
    96, and head dim 128 with at most 16 q tiles of 128 rows per head. H100 2026-11-27,
    causal forward kernels H16, one CTA per tile -> tickets, TFLOP/s: D32 B4 S4096 268.4 ->
    278.0 (FA4 275.7), D64 425.2 -> 444.5 (442.4), D96 471.2 -> 496.2 (492.7), D64 B8 S2048
    351.4 -> 382.1 (368.9); D128 clusters -> tickets: B8 S2048 494.2 -> 518.7 (502.8), while
    longer rows lose what the clusters' shared K/V loads bring: B4 S4096 575.7 -> 572.9,
    B2 S8192 626.4 -> 601.9. Beyond 128: not measured. At the door (bench_head_dims.py, B4
    S4096 H16, 2026-11-27), one CTA per tile -> tickets: D32 265.0 -> 274.3 (FA4 ~274),
    D64 421.4 -> 443.0 (~439), D96 500.2 -> 520.6 (~495). `flag`: FLEXATTN_TILE_TICKETS
    (see _tickets_pay)."""
    if flag == "0" or not _two_rounds(shape, _SMS_FOR_RULES):
        return False
    return max(shape.head_dim, shape.v_head_dim) <= 96 or (shape.head_dim == shape.v_head_dim == 128 and -(-shape.q_len // 128) <= 16)


# The SM count the planner's shape rules assume (an H100's); the launch reads the real one.
_SMS_FOR_RULES = 132


def _tickets_pay(shape: AttentionShape, band, max_ctas: int, cluster_m: int, causal: bool, flag: str) -> bool:
    """Whether a band's persistent CTAs take their tiles by tickets (FwdConfig.tile_tickets):
    rows near the start of a band see fewer keys, and a static walk commits each CTA to its
    tiles up front. H100, window 1024 H16 D128 forward, snake -> tickets (2026-11-27):
    B8 S2048 452.4 -> 457.3 TFLOP/s, B4 S4096 463.6 -> 469.3, B2 S8192 469.4 -> 474.4 (FA4
    462.0 / 473.6 / 466.4). Only with at least two rounds of 128-row tiles, where a
    launch's counter (``launch_tickets``) buys a tail worth evening out.
    `flag` (``FLEXATTN_TILE_TICKETS``) overrides, for A/B runs: ``0`` never, ``1`` every
    persistent walk without clusters (dense, balanced block lists, bands)."""
    if not max_ctas or cluster_m != 1 or flag == "0":
        return False
    if flag == "1" or causal:   # (causal is persistent only where _causal_tickets_pay says so)
        return True
    return bool(band) and _two_rounds(shape, max_ctas)


def kernel_block_mask(spec: AttentionSpec, shape: AttentionShape) -> BlockMask | None:
    """The block mask whose lists the kernels of this call read (the spec's own, or one
    built for its mask mod and shape and cached), or None (dense / built-in causal)."""
    return _block_structure(spec, shape).block_mask


def block_lists_to_device(spec: AttentionSpec, shape: AttentionShape, to_device: Callable) -> None:
    """``to_device`` every host block-mask list the kernels of this call read (the
    forward's kv-side and the backward's q-side lists), for adapters that must place them
    ahead of the first real call (a ``to_device`` that keeps its copies)."""
    block_mask = kernel_block_mask(spec, shape)
    if block_mask is not None:
        for name in _LIST_NAMES:
            to_device(block_mask.list_array(name))


def _fp32_ab_overrides(tf32_passes: int) -> tuple:
    """3xTF32's A/B variables as (FwdConfig field, value) pairs, for error studies
    (benchmarks/fp32_error_study.py); () without them or below 3 passes:
    FLEXATTN_FP32_EXACT_NORM=0 (``exact_normalize`` off), FLEXATTN_FWD_S_PROMOTE=N
    (``s_promote``), FLEXATTN_FWD_PV_PIECES=N (``promote_pv_pieces``; 0: ``promote_pv``
    off)."""
    if tf32_passes != 3:
        return ()
    env, out = os.environ, []
    if env.get("FLEXATTN_FP32_EXACT_NORM") == "0":
        out.append(("exact_normalize", False))
    if env.get("FLEXATTN_FWD_S_PROMOTE") is not None:
        out.append(("s_promote", int(env["FLEXATTN_FWD_S_PROMOTE"])))
    pieces = env.get("FLEXATTN_FWD_PV_PIECES")
    if pieces is not None:
        out += [("promote_pv", False)] if pieces == "0" else [("promote_pv_pieces", int(pieces))]
    return tuple(out)


def _rescale_o_early(shape: AttentionShape, tf32_passes: int) -> bool:
    """Whether the forward shrinks O while Q K^T runs (`FwdConfig.rescale_o_early`): beyond
    192 value columns (FA4 does it beyond 128). H200, B4 S4096 H16, door A/B in one process,
    ms early / late: 256/256 causal 0.8816 / 0.8917, dense 1.6007 / 1.6324; 192/192 causal
    0.7020 / 0.6855, dense 1.2511 / 1.2178; 128/128 causal 0.4925 / 0.4664 (issue 25,
    docs/experiments.md). Not with 3xTF32's promoted P V (its own fold, at every head dim).
    ``FLEXATTN_RESCALE_O_EARLY=0`` / ``1`` overrides, for A/B runs."""
    if tf32_passes == 3:
        return False
    flag = os.environ.get("FLEXATTN_RESCALE_O_EARLY", "auto")
    if flag in ("0", "1"):
        return flag == "1"
    return shape.v_head_dim > 192


def _rescale_threshold(shape: AttentionShape, has_score: bool, fp32: bool, on_demand: bool) -> float:
    """`FwdConfig.rescale_threshold`: O rescaled only when a warp's max outgrew the
    exponents' reference by 2^8 (FA4's Blackwell value), from 128 value columns (an O
    fragment of 64+ registers a thread) without a score mod, and wherever maxima_on_demand
    is planned (it needs one). H200, 2026-12-01, the door's forward A/B in alternating
    rounds (9), ms with / without: D128 full, causal, window1024 and document4 at B4 S4096,
    B2 S8192, B8 S2048 0.973-0.997 (12 of 12 faster); D128 ALiBi 0.999-1.021; D64 full /
    causal 1.008 / 0.996, D32 1.019 / 1.009 (docs/experiments.md, issue 25). Off for
    float32 (its error studies were measured with every block rescaled).
    ``FLEXATTN_RESCALE_THRESHOLD=t`` overrides (0: off, and the maxima on demand with it),
    for A/B runs."""
    if fp32:
        return 0.0
    flag = os.environ.get("FLEXATTN_RESCALE_THRESHOLD")
    if flag is not None:
        return float(flag)
    return 8.0 if on_demand or (shape.v_head_dim >= 128 and not has_score) else 0.0


def _maxima_on_demand(fp32: bool, max_scores: bool) -> bool:
    """`FwdConfig.maxima_on_demand`: no row maxima on the softmax's fast path (with a
    rescale threshold of 8 where none is planned), for 16-bit calls without max_scores.
    H200, 2026-12-01, the door's forward A/B in alternating rounds (7), B4 S4096 H16, ms
    with / without: D32 full 0.936, causal 0.991, window1024 0.931, softcap 0.965, ALiBi
    1.001, document4 1.022; D64 0.913 / 0.945 / 0.954 / 0.976 / 0.977 / 0.991; D128 0.956 /
    0.966 / 0.982 / 0.999 / 0.950 / 0.988 (docs/experiments.md, issue 25).
    ``FLEXATTN_MAXIMA_ON_DEMAND=0`` turns it off, for A/B runs."""
    return not fp32 and not max_scores and os.environ.get("FLEXATTN_MAXIMA_ON_DEMAND", "1") != "0"


# A score mod's per-element work that still fits four consumer warpgroups' 112 registers
# at 256 x 80 (D32) and 256 x 64 (D64): ptxas, 2026-12-01, causal and dense alike, no spill
# up to 13 operations without gathers (softcap 3, ALiBi 4, both 7; gelu's erf, atan,
# sigmoid, exp, log, rsqrt, a division by a captured number); 18 operations (a modulo, an
# exp and a tanh) spill 20-28 B, 23 spill 156-220 B; a relative-bias table read (4
# operations, one gather) spills 192-252 B; one sin, cos or sqrt (libdevice's slow paths)
# spills 20-36 B in a mod of 3-5 operations, and // or % by 7 (a multiply-high sequence,
# ElementCost.divisions; powers of two are a shift or a mask) 4-8 B at D32.
TALL_TILE_SCORE_OPS = 8
TALL_TILE_HEAVY_OPS = frozenset(("sin", "cos", "sqrt"))


def _tall_tile_score(score) -> bool:
    """Whether a score mod is light enough for the four-warpgroup tiles (above)."""
    from ..kernels.emit.mod_emit import element_cost

    cost = element_cost(score)
    return (cost.gathers == 0 and cost.divisions == 0 and cost.ops <= TALL_TILE_SCORE_OPS
            and not cost.kinds & TALL_TILE_HEAVY_OPS)


def _four_warpgroup_tiles(shape: AttentionShape, score, block_mask, fp32: bool, on_demand: bool,
                          band: bool = False) -> tuple | None:
    """(tile_m, tile_n) in place of the 192 x 128 tiles of 16-bit calls without a score mod
    or a block mask: four consumer warpgroups at 112 registers. 256 x 80 up to head dim 32:
    H200, 2026-12-01, the door's forward A/B in alternating rounds (7), ms 256 x 80 / 192 x
    128, D32 H16: causal B4 S4096 0.967, B8 S2048 0.976, B2 S8192 1.002; full 0.993 / 0.984
    / 1.000. 256 x 64 up to head dim 64 with maxima_on_demand (fewer live registers on its
    fast path): D64 B4 S4096 causal 0.911 / full 0.917 against 0.945 / 0.913 for 192 x 128,
    both on demand (without it: 1.007 / 1.008; 256 x 80 spills at D64). Docs/experiments.md,
    issue 25. Score mods light enough for 112 registers (``_tall_tile_score``) take the
    same tiles: H200, 2026-12-01, the door's forward A/B in alternating rounds (7), ms 256-row
    / 128 x 128, causal B4 S4096 / B8 S2048: softcap 0.856 / 0.845 (D32), 0.876 / 0.855 (D64);
    ALiBi 0.834 / 0.832, 0.871 / 0.851. Bands keep 128 x 128 (window1024 1.086 / 1.098 at D32,
    1.056 / 1.057 at D64), and so do block lists (128-row q blocks). ``FLEXATTN_FWD_TILES=MxN``
    overrides (192x128: the plan before), for A/B runs, also for any score mod or a band."""
    if fp32 or (block_mask is not None and not band):
        return None
    flag = os.environ.get("FLEXATTN_FWD_TILES")
    if flag:
        parts = flag.lower().split("x")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"FLEXATTN_FWD_TILES must be MxN (e.g. 256x80), got {flag!r}")
        return int(parts[0]), int(parts[1])
    widest = max(shape.head_dim, shape.v_head_dim)
    if block_mask is not None or widest > 64 or (widest > 32 and not on_demand):
        return None
    if score is not None and not _tall_tile_score(score):
        return None
    return (256, 80) if widest <= 32 else (256, 64)


def plan_forward(q, shape: AttentionShape, spec: AttentionSpec, max_scores: bool = False,
                 tf32_passes: int = 3) -> KernelPlan:
    """Pick the kernel configuration (compile-time) for this call.

    Plans are cached by the *identity* of the mods' IR (shared by every ``with_captures``
    copy of a mod, so calls that reuse mod values hit) plus dtype, head dim and block
    structure: a hit costs a dict lookup and a fresh hook carrying this call's captures,
    instead of rebuilding and re-hashing the config (tens of µs per call)."""
    from ..kernels.emit.mod_emit import IRModHook

    reason = kernel_unsupported(q, shape)
    if reason:
        raise ValueError(reason)
    causal, band, mask, block_mask, full_only = _block_structure(spec, shape)
    score = spec.score
    dtype = FORWARD_DTYPES[dtype_name(q)]
    fp32 = dtype == "fp32"
    tf32_passes = tf32_passes if fp32 else 1
    dense = not causal and block_mask is None
    # fp32: no clusters, no persistent CTAs (their separate O buffer would not fit).
    tickets_flag = os.environ.get("FLEXATTN_TILE_TICKETS", "auto")   # A/B override: see _tickets_pay
    causal_tickets = causal and block_mask is None and not fp32 and _causal_tickets_pay(shape, tickets_flag)
    # (the lists' row pairs are asked last: a host mask's first answer compares its states)
    clusters = not fp32 and not causal_tickets and _clusters_pay(shape)
    cluster_m = 2 if clusters and (block_mask is None or _list_clusters_pay(block_mask, band)) else 1
    persistent_pays = (dense or _balanced(block_mask, band) or causal_tickets) and not fp32 and not _GPU_SHARED.get()
    max_ctas = persistent_ctas(q, cluster_m) if persistent_pays else 0
    tickets = _tickets_pay(shape, band, max_ctas, cluster_m, causal_tickets, tickets_flag)
    rescale_early = _rescale_o_early(shape, tf32_passes)
    ab_fp32 = _fp32_ab_overrides(tf32_passes)
    on_demand = _maxima_on_demand(fp32, max_scores)
    threshold = _rescale_threshold(shape, score is not None, fp32, on_demand)
    on_demand = on_demand and threshold > 0
    tiles = _four_warpgroup_tiles(shape, score, block_mask, fp32, on_demand, band)
    # (FwdConfig.own_diagonal is planned; FLEXATTN_OWN_DIAGONAL=0 walks whole tiles, for A/B runs)
    own_diagonal = os.environ.get("FLEXATTN_OWN_DIAGONAL") != "0"
    # A float index's product with a row constant as one FFMA per element (ALiBi's slope *
    # (kv - q); affine_index.FloatAffine). H200, 2026-12-01, B4 S4096 H16 causal+alibi door:
    # forward 0.933 / 0.950 / 0.946x the time at D32 / D64 / D128, fwd+bwd D128 0.983x.
    # FLEXATTN_SCALED_INDICES=0 emits the plain product, for A/B runs.
    scaled_indices = os.environ.get("FLEXATTN_SCALED_INDICES") != "0"
    # A band's partial and full blocks through one step (FwdConfig.band_one_step: one copy of
    # the step fewer; window1024 D128 compiles in 1.43 s instead of 2.00 on the CPU box).
    # H200, sessions 76-77, the door's window1024 forward in alternating rounds (5, 11, 9),
    # time with / without at B4 S4096, B8 S2048, B2 S8192: 1.000-1.018x (mean 1.008);
    # fwd+bwd 1.002-1.014x; first call (one host, alternating processes) 2.04 / 1.77 s
    # against 2.84 / 2.01. The vote of the maxima on demand after the exponentials read
    # 1.014-1.019x, none on block 0 1.002-1.012x: the vote stays before them (may_be_first).
    # FLEXATTN_BAND_ONE_STEP=0 walks partial and full blocks in loops of their own, for A/B runs.
    band_one_step = bool(band) and os.environ.get("FLEXATTN_BAND_ONE_STEP") != "0"
    # The dense and causal structures without hooks through one step too (FwdConfig.one_step_walk:
    # causal D128 compiles in 0.92 s instead of 1.07 on the CPU box, 2128 SASS instructions
    # against 2400; the planned D32 causal's 4 B spill gone). H200, 2026-12-02, the door's
    # forward in alternating rounds (9), time with / without at B4 S4096 H16: D32 full 0.969x,
    # causal 0.985x; D64 0.994x / 0.999x; but D128 full 1.008x, causal 1.022x (7 rounds):
    # planned up to head dim 64. FLEXATTN_ONE_STEP_WALK=1 / 0 plans it at every head dim / none,
    # for A/B runs.
    walk_flag = os.environ.get("FLEXATTN_ONE_STEP_WALK")
    one_step_walk = (not band and block_mask is None and not fp32 and walk_flag != "0"
                     and (walk_flag == "1" or max(shape.head_dim, shape.v_head_dim) <= 64))
    key = (dtype, tf32_passes, ab_fp32, shape.head_dim, shape.v_head_dim, causal, band, block_mask is not None, max_ctas,
           cluster_m, max_scores, tickets, shape.kv_len % 128 == 0, rescale_early, threshold, on_demand,
           tiles, own_diagonal, scaled_indices, full_only, band_one_step, one_step_walk,
           None if score is None else id(score.expr), None if mask is None else id(mask.expr))
    entry = _PLANS.get(key)
    # 3xTF32 keeps float32's accuracy: the mods' tanh / sigmoid exact, not tanh.approx.
    fast_math = tf32_passes != 3
    hook = IRModHook(score, mask, fast_math, scaled_indices)
    if entry is None:
        from ..kernels.fwd.sm90 import FwdConfig
        from ..kernels.emit.mod_emit import capture_kinds

        # Three consumer warpgroups (tile_m 192) pay off up to head dim 96 (H100, B4 S4096
        # H16, 2026-11-27: D96 causal 477 -> 511 TFLOP/s, dense 526 -> 581; D80 causal
        # 390 -> 444, dense 465 -> 534), but only without a score mod (register pressure)
        # and outside block-sparse mode (128-row tiles); four (256 x 80) up to head dim 32
        # (_four_warpgroup_tiles).
        lists = block_mask is not None and not band
        small = max(shape.head_dim, shape.v_head_dim) <= 96
        if fp32:
            tile_m, tile_n, stages = _fp32_tiles(shape, 2 if tf32_passes == 3 else 1, lists)
            persistent = False
        else:
            tile_m = 192 if small and score is None and block_mask is None else 128
            tile_n, stages, persistent = _forward_tiles(shape, tile_m, lists, max_ctas > 0)
            if tiles:   # (same stages; persistent where O apart still fits)
                tile_m, tile_n = tiles
                persistent = persistent and _shared_fits(shape, tile_m, tile_n, stages, True)
        template = IRModHook(_structure_only(score), _structure_only(mask), fast_math, scaled_indices)
        config = FwdConfig(
            dtype=dtype, tf32_passes=tf32_passes, head_dim=shape.head_dim, head_dim_v=shape.v_head_dim,
            tile_m=tile_m, tile_n=tile_n, num_stages=stages, causal=causal, block_sparse=lists, band=band,
            # lists without a partial block (documents on tile boundaries): the full list
            # alone, one copy of the step fewer
            partial_blocks=not (lists and full_only),
            mods=template, max_ctas=max_ctas if persistent else 0, cluster_m=cluster_m, max_scores=max_scores,
            pingpong=tile_m > 64, sparse_block_m=128 if lists else None,   # lists: 128-row q blocks
            # Bands: persistent CTAs take tiles by tickets (_tickets_pay), else in a snake
            # (odd rounds reversed), which evens out the last round too. H100, window 1024
            # H16 D128, 2026-11-27, static order -> snake: B8 S2048 434 -> 453 TFLOP/s (FA4
            # 464), B4 S4096 463 -> 467, B2 S8192 468 -> 472 (issue 24, session 25).
            tile_tickets=tickets and persistent,
            snake=bool(band) and persistent and cluster_m == 1 and not tickets,
            # (keyed above by KV_LEN % 128: a tile_n that divides 128 then divides KV_LEN)
            kv_aligned=shape.kv_len % 128 == 0 and 128 % tile_n == 0,
            rescale_o_early=rescale_early,
            rescale_threshold=threshold,
            maxima_on_demand=on_demand,
            own_diagonal=own_diagonal,
            band_one_step=band_one_step,
            one_step_walk=one_step_walk,
            **dict(ab_fp32),
            # The mods' reads constant over a tile (a converted PagedAttention mask's page
            # map at kv // 128) once per tile and row: H200, 2026-11-30, a prefill chunk
            # 627 -> 633 TFLOP/s, no spill (36 B before); other kernels unchanged.
            hoist_tile_reads=template.tile_invariant_count(tile_n) > 0,
        )
        # _clusters_pay counts 128-row q tiles; the kernel pairs its own tile_m rows, and
        # the TVM-FFI launch does not check again: the two counts must agree.
        assert config.cluster_fits(shape.q_len), (config.tile_m, cluster_m, shape.q_len)
        entry = _PlanEntry(config, capture_kinds(template))
        keep_bounded(_PLANS, key, entry, _PLANS_CAPACITY)
    hook.capture_kinds = entry.kinds
    hook.derivative_box = entry.config.mods.derivative_box  # the same IR: one derivative
    return KernelPlan(entry.config.with_mods(hook), block_mask, entry,
                      _backward_ctas(q, shape, fp32, block_mask, band))


# The backward runs persistent CTAs over block lists whose kv-block columns are this even
# (q tiles per column, max / mean) and this short (mean q blocks per column): see
# _backward_ctas.
BWD_PERSISTENT_COLUMN_BALANCE = 1.05
BWD_PERSISTENT_MEAN_COLUMN = 8


def _backward_ctas(q, shape: AttentionShape, fp32: bool, block_mask: BlockMask | None, band: bool) -> int:
    """Persistent CTAs for the backward (``BwdConfig.max_ctas``), or 0: one CTA per kv tile.

    Planned for block lists (not bands) at head dim 128 whose kv-block columns are even
    and short, i.e. documents of up to 1024 tokens: each CTA then walks equal tiles, a
    static walk loses nothing to the hardware's CTA scheduling, and the next tile's K / V
    loading during the epilogue (``FlashBwdSm90.dkv_staged_apart``) hides part of each
    tile's fixed cost (K / V load, pipeline fill and drain, ~5 µs, 14% of a 16-visit
    tile). H200, the door's fwd+bwd time, persistent / one CTA per tile, document4 (4
    equal documents: column balance 1.0; 4 / 8 / 16 q blocks per column at B8 S2048 / B4
    S4096 / B2 S8192): 2026-11-28 13:00 UTC 0.992 / 0.979-0.986 / 0.998; 14:25 UTC (the
    walk's numbers no longer spilled) 0.991 / 0.991 / 1.010 — longer columns lose, hence
    at most 8. Not planned where it measured slower: window1024 (a band) 1.016, full
    (balance 1.0, 32 q blocks per column) 1.009; H100 before the apart staging: causal
    1.35 (uneven columns). Never for float32 or inside ``gpu_shared()`` (see there).
    ``FLEXATTN_BWD_PERSISTENT``: ``1`` plans them for every
    16-bit backward, ``0`` never (A/B runs)."""
    flag = os.environ.get("FLEXATTN_BWD_PERSISTENT", "auto")
    if fp32 or _GPU_SHARED.get() or flag == "0":
        return 0
    if flag == "1":
        return persistent_ctas(q)
    if block_mask is None or band or not shape.head_dim == shape.v_head_dim == 128:
        return 0
    visits = block_mask.column_visits()
    if visits is None or visits.balance > BWD_PERSISTENT_COLUMN_BALANCE or visits.mean > BWD_PERSISTENT_MEAN_COLUMN:
        return 0
    return persistent_ctas(q)


def _runner(plan: KernelPlan, tvm_ffi: bool):
    from ..kernels.launch.cache import forward_runner

    entry = plan.entry
    if entry is None:
        return forward_runner(plan.config, tvm_ffi=tvm_ffi)
    runner = entry.runners.get(tvm_ffi)
    if runner is None:
        # From the capture-free template: the runner outlives this call (compile cache)
        # and must not keep its captured tensors alive. Values come in as launch args.
        runner = entry.runners[tvm_ffi] = forward_runner(entry.config, tvm_ffi=tvm_ffi)
    return runner


def use_tvm_ffi(device: Device | None = None, stream_scope: bool = False) -> bool:
    """Launch through TVM-FFI (framework tensors straight into the compiled kernel, µs of
    host time) when the ``apache-tvm-ffi`` package is installed and the launch lands on
    the device's stream: TVM-FFI's environment stream is it (torch), or the caller sets it
    around the launch (``stream_scope``: ``ffi_stream_scope``) — unless
    ``FLEXATTN_TVM_FFI`` says otherwise (``0``: never, ``1``: always); else the
    ``from_dlpack`` runner (~35 µs per tensor)."""
    flag = os.environ.get("FLEXATTN_TVM_FFI")
    if flag is not None:
        return flag == "1"
    if device is not None and not device.tvm_ffi_stream and not stream_scope:
        return False
    return _tvm_ffi_installed()


def ffi_stream_scope(q, device: Device):
    """A context in which TVM-FFI launches go to ``device.stream``: TVM-FFI's environment
    stream of q's GPU is set to it (frameworks whose current stream TVM-FFI does not
    read, e.g. CuPy); nothing to do where it reads the framework's (torch)."""
    if device.tvm_ffi_stream:
        return contextlib.nullcontext()
    import tvm_ffi

    return tvm_ffi.use_raw_stream(_ffi_device(q), device.stream)


class EnvStream:
    """TVM-FFI's environment stream of one device, for launches repeated many times:
    ``swap(stream)`` sets it and returns the previous one. ``tvm_ffi.use_raw_stream`` does
    the same through a context object built per call (~1 µs of host time more per launch);
    this calls the setter it wraps directly, or falls back to it where the setter is gone."""

    __slots__ = ("_device", "_set", "_type", "_index")

    def __init__(self, ffi_device):
        from tvm_ffi import core

        self._device = ffi_device
        self._set = getattr(core, "_env_set_current_stream", None)
        self._type, self._index = ffi_device.dlpack_device_type(), ffi_device.index

    def swap(self, stream: int) -> int:
        if self._set is not None:
            return self._set(self._type, self._index, stream)
        import tvm_ffi

        previous = tvm_ffi.get_raw_stream(self._device)
        tvm_ffi.use_raw_stream(self._device, stream).__enter__()   # sets it; nothing to undo on exit
        return previous


def _ffi_device(q):
    """TVM-FFI's name for the CUDA device q lives on."""
    import tvm_ffi

    return tvm_ffi.device("cuda", int(q.__dlpack_device__()[1]))


def frozen_captures(captures) -> bool:
    """Whether captured values cannot change between launches (numbers, read-only numpy
    arrays): prepared launches convert them once. Anything else may be updated in place
    or rebound between calls: converted per call."""
    return all(isinstance(c, (int, float, np.integer, np.floating))
               or (isinstance(c, np.ndarray) and not c.flags.writeable) for c in captures)


class CaptureArgs:
    """A prepared launch's captured values as kernel arguments (``current()``), converted
    as rarely as their kinds allow: numbers and read-only host arrays once (with the
    ``stable`` captures: arrays the plan itself owns and writes in stream order); arrays
    the kernel reads in place (``Device.same_memory`` gives them a key: a framework
    tensor's data pointer, on this GPU and contiguous) once per key, so updates in place
    cost nothing and a rebound storage converts again; anything else per launch
    (writeable host arrays are copied, strided tensors made contiguous, each time: their
    values may have changed). ``convert()``: every capture converted now; ``wrap``: applied
    to a conversion that is kept (``ffi_tensors``: TVM-FFI then skips the DLPack exchange
    per launch, ~1-4 µs per array)."""

    __slots__ = ("_convert", "_wrap", "_same_memory", "_watched", "_keys", "_args")

    def __init__(self, captures, convert: Callable, same_memory: Callable | None = None, wrap=None, stable=()):
        self._convert, self._wrap, self._same_memory = convert, wrap or (lambda a: a), same_memory
        self._keys = self._args = None
        changing = tuple(c for c in captures if not any(c is x for x in stable) and not frozen_captures((c,)))
        # (): nothing changes, converted now; None: every launch converts
        self._watched = changing if not changing or same_memory is not None else None
        if not changing:
            self._args = self._wrap(convert())

    def current(self):
        watched = self._watched
        if watched is None:
            return self._convert()
        if not watched:
            return self._args
        keys = tuple(self._same_memory(c) for c in watched)
        if keys != self._keys:
            if any(k is None for k in keys):
                return self._convert()
            self._args, self._keys = self._wrap(self._convert()), keys
        return self._args


def ffi_tensors(values):
    """``values`` with every array converted to a ``tvm_ffi.Tensor`` once, for arguments that
    stay the same across launches: TVM-FFI passes its own tensors through, while a
    framework array is exchanged over DLPack at every call (about 4 µs each for CuPy's,
    measured by bench_overhead's block-mask rows). Numbers and None pass unchanged."""
    if values is None:
        return None
    import tvm_ffi

    return tuple(v if v is None or isinstance(v, (int, float)) else tvm_ffi.from_dlpack(v) for v in values)


def _kv_lists(plan: KernelPlan, device: Device, tickets: bool = True):
    """The int32 arrays the forward kernel reads besides its operands, on the GPU: the
    block mask's kv-side lists (kernel order) where it reads them, then (``tickets``) the
    tile tickets' counter where it schedules by tickets; None where it reads none."""
    bm = plan.block_mask
    lists = ()
    if plan.config.block_sparse:
        lists = tuple(device.to_device(bm.list_array(n))
                      for n in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"))
    if tickets and plan.config.tile_tickets:
        lists += (launch_tickets(device),)
    return lists or None


def launch_tickets(device: Device):
    """The counter of one launch's tile tickets (FwdConfig.tile_tickets): the adapter's
    for the launch's stream (``Device.tile_tickets``), else a fresh zero allocated in the
    stream's order, so launches on different streams, or recorded into CUDA graphs, never
    share a counter."""
    if device.tile_tickets is not None:
        return device.tile_tickets()
    if device.alloc is not None:
        return device.alloc((1,), "int32", True)
    return device.to_device(np.zeros(1, np.int32))


@functools.cache
def _tvm_ffi_installed() -> bool:
    return importlib.util.find_spec("tvm_ffi") is not None


def forward_into(q, k, v, out, lse, shape: AttentionShape, spec: AttentionSpec, device: Device,
                 max_scores=None) -> KernelPlan | None:
    """Run the forward kernel, writing ``out`` [B, Hq, Q, D] and ``lse`` [B, Hq, Q] (float32),
    and ``max_scores`` [B, Hq, Q] (float32: each row's max of the scaled, modded, masked
    scores; -inf for rows that see nothing) if given. Short queries go to the decode kernel
    where the device allows (``core/short_query.py``; then no plan is returned) unless
    ``max_scores`` is wanted (the decode kernel keeps no such output)."""
    fp32 = dtype_name(q) == "float32"
    if device.decode_resources is not None and max_scores is None:
        from .short_query import decode_route, list_walk_into, list_walk_route, short_query_into

        route = decode_route(shape, spec, dtype_name(q))
        if route is not None:
            short_query_into(q, k, v, out, lse, route, device)
            return None
        walk = list_walk_route(shape, spec, dtype_name(q), k, v, device)
        if walk is not None:
            list_walk_into(q, out, lse, walk, device)
            return None
    plan = plan_forward(q, shape, spec, max_scores is not None, device.tf32_passes)
    lists = _kv_lists(plan, device)
    scale = spec.resolved_scale(shape.head_dim)
    if use_tvm_ffi(device, stream_scope=True):  # see kernels/launch/forward.py
        from ..kernels.launch.arguments import ffi_mod_args

        args = ffi_mod_args(plan.config.mods, device.to_device)
        with ffi_stream_scope(q, device):
            if fp32:
                from ..kernels.launch.fp32 import fp32_operands

                if device.alloc is None:
                    raise ValueError("float32 inputs need scratch memory this adapter does not give (Device.alloc)")
                q, k, v = fp32_operands(plan.config, q, k, v, device.alloc)
            _runner(plan, True).run(q, k, v, out, lse, scale, args, lists, max_scores)
        return plan
    if fp32:
        raise ValueError("float32 inputs run through TVM-FFI launches (pip install apache-tvm-ffi)")
    from ..kernels.emit.mod_emit import runtime_args

    args = runtime_args(plan.config.mods, device.to_device)
    _runner(plan, False).run(q, k, v, out, lse, scale, args, device.stream, lists, max_scores)
    return plan


class PreparedForward:
    """One validated call shape, ready to launch again with new tensors of the same
    metadata: ``launch(q, k, v, out, lse)`` costs the kernel call alone (TVM-FFI) plus,
    only for captures that may change between calls (framework tensors, writeable numpy
    arrays), their conversion. Built by ``prepare_forward`` after a first full call;
    adapters keep them keyed by everything the checks read (see flexattn/torch/__init__.py)."""

    __slots__ = ("_fn", "_scale", "_args", "_kinds", "_captures", "_to_device", "_lists", "_tickets", "_env_stream")

    def __init__(self, q, plan: KernelPlan, spec: AttentionSpec, shape: AttentionShape, device: Device):
        from ..kernels.launch.arguments import ffi_args
        from ..kernels.emit.mod_emit import capture_kinds

        runner = _runner(plan, True)
        runner.compile()
        self._fn = runner.compiled
        self._scale = spec.resolved_scale(shape.head_dim)
        # The captured values, not the mods: holding no mod object lets an adapter's
        # cache entry die with the mods it was keyed by.
        self._kinds, self._captures = capture_kinds(plan.config.mods), plan.config.mods.captures()
        self._to_device = device.to_device
        kinds, captures, to_device = self._kinds, self._captures, self._to_device   # (no cycle through self)
        self._args = CaptureArgs(captures, lambda: ffi_args(kinds, captures, to_device) or None, device.same_memory,
                                 ffi_tensors)
        self._lists = ffi_tensors(_kv_lists(plan, device, tickets=False))
        self._tickets = device if plan.config.tile_tickets else None   # a counter per launch
        # Set: launches need TVM-FFI's stream set around them (as ffi_stream_scope does).
        self._env_stream = None if device.tvm_ffi_stream else EnvStream(_ffi_device(q))

    def launch(self, q, k, v, out, lse, stream: int | None = None):
        """``stream``: the caller's current stream, for frameworks whose stream TVM-FFI does
        not read itself (the ``Device`` had ``tvm_ffi_stream=False``)."""
        args = self._args.current()
        if self._env_stream is None:
            self._fn(q, k, v, out, lse, self._scale, args, self._launch_lists(), None)
            return
        previous = self._env_stream.swap(stream)
        try:
            self._fn(q, k, v, out, lse, self._scale, args, self._launch_lists(), None)
        finally:
            self._env_stream.swap(previous)

    def operand_positions(self, operands) -> tuple:
        """Where each array of ``operands`` sits among this launch's captures, for
        ``launch_operands``."""
        return operand_positions(self._captures, operands)

    def launch_operands(self, q, k, v, out, lse, operands, positions):
        """``launch`` with ``operands`` in place of the prepared call's arrays at ``positions``
        (``operand_positions``): a compiled graph's op call, the same spec with this call's
        tensors. For devices whose stream TVM-FFI reads itself."""
        from ..kernels.launch.arguments import ffi_args

        captures = with_operands(self._captures, operands, positions)
        self._fn(q, k, v, out, lse, self._scale, ffi_args(self._kinds, captures, self._to_device) or None,
                 self._launch_lists(), None)

    def _launch_lists(self):
        """The block lists, then this launch's own tile-ticket counter where the kernel
        takes one (made here, in the launch's stream order)."""
        if self._tickets is None:
            return self._lists
        return (self._lists or ()) + (launch_tickets(self._tickets),)


def operand_positions(captures, operands) -> tuple:
    """Where each array of ``operands`` sits among a prepared launch's ``captures`` (by
    identity: the spec it was prepared from holds them)."""
    return tuple(tuple(i for i, c in enumerate(captures) if c is x) for x in operands)


def with_operands(captures, operands, positions) -> list:
    """``captures`` with ``operands`` at their ``positions`` (``operand_positions``)."""
    captures = list(captures)
    for x, where in zip(operands, positions):
        for i in where:
            captures[i] = x
    return captures


def prepare_forward(q, shape: AttentionShape, spec: AttentionSpec, device: Device):
    """A ``PreparedForward`` for calls like this one (a ``short_query.PreparedShortQuery``
    for calls routed to the decode kernel; both ``launch(q, k, v, out, lse, stream)``, a
    launch returning False asks for the full path), or None where launches must go
    through ``forward_into`` (no TVM-FFI for this device)."""
    if not use_tvm_ffi(device, stream_scope=True) or dtype_name(q) == "float32":
        return None   # float32 calls make their operands each time: the full path
    if device.decode_resources is not None:
        from .short_query import PreparedShortQuery, decode_route

        route = decode_route(shape, spec, dtype_name(q))
        if route is not None:
            return PreparedShortQuery(route, device)
        from .short_query import prepared_list_walk

        walk = prepared_list_walk(shape, spec, dtype_name(q), device)
        if walk is not None:
            return walk
    return PreparedForward(q, plan_forward(q, shape, spec), spec, shape, device)


__all__ = ["Device", "EnvStream", "KernelPlan", "PreparedForward", "forward_into", "gpu_shared", "kernel_unsupported",
           "plan_forward", "prepare_forward", "use_tvm_ffi"]
