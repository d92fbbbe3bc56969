"""Block-sparse layout of a mask, in FlexAttention's format.

The attention matrix is cut into ``BLOCK_SIZE = (q_block, kv_block)`` tiles. Each tile is
*empty* (skipped), *full* (computed without evaluating the mask) or *partial* (computed
with the mask). Per (b, h, q-block) we store the partial kv-blocks
(``kv_num_blocks``, ``kv_indices``) and the full ones (``full_kv_*``); per kv-block the
q-side transposes (``q_*``, ``full_q_*``) serve the backward. Index lists are sorted
like torch's: the listed blocks in ascending order first, the rest after.

Building on the host: interval analysis classifies every tile at once; tiles it cannot
decide are split into quadrants and analysed again, down to 8×8 boxes; only boxes still
undecided are evaluated element by element (vectorized over all of them, in chunks).

Building on the GPU (``create_block_mask(..., device="cuda")``): the same interval
analysis per tile, emitted into a CuTeDSL kernel, then element evaluation with early exit
for undecided tiles and a compaction kernel for the sorted lists
(``kernels/blockmask_sm90.py``, ``kernels/blockmask_compact.py``); the lists stay on the
GPU, where the attention kernels read them.

Packed variable-length batches (``varlen_block_mask``): tile states in closed form from
the document offsets, no element evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from .arrays import to_numpy
from .mods import MaskMod, as_mask, full
from .mods.mod import LIVE_OBJECTS
from .mods.evaluate import evaluate
from .mods.intervals import classify

EMPTY, PARTIAL, FULL = 0, 1, 2
_CHUNK_ELEMENTS = 1 << 22  # elements evaluated per numpy pass for undecided boxes
_LEAF = 8  # boxes still undecided at this size are evaluated element by element


_LIST_NAMES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
               "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


class BlockCounts(NamedTuple):
    num_blocks: np.ndarray  # [..., rows]
    indices: np.ndarray  # [..., rows, cols]


_NOT_COMPUTED = object()  # BlockMask._tile_balance before its first computation


class BlockMask:
    """Which tiles of the [Q_LEN, KV_LEN] score matrix to compute, with which mask."""

    def __init__(self, states: np.ndarray, seq_lengths, block_size, mask_mod: MaskMod | None, num_allowed=None):
        LIVE_OBJECTS[id(self)] = self  # see mods.mod.LIVE_OBJECTS
        states = np.asarray(states, dtype=np.int8)
        if states.ndim != 4:
            raise ValueError(f"block states must be [B, H, Q_BLOCKS, KV_BLOCKS], got shape {states.shape}")
        self.seq_lengths = tuple(int(s) for s in seq_lengths)
        self.BLOCK_SIZE = tuple(int(s) for s in block_size)
        self.mask_mod = mask_mod if mask_mod is not None else full()
        self.device = "cpu"
        self._states = states
        self._batch_heads = states.shape[:2]
        self._num_allowed = num_allowed  # [B, H] exact count of attended (q, kv) pairs, if known
        self._count_allowed = None  # computes it on demand (GPU-built masks)
        self._rebuild = None  # new captures -> the block mask of the same structure (update)
        self._tile_balance = _NOT_COMPUTED
        partial, fullb = states == PARTIAL, states == FULL
        self.kv_num_blocks, self.kv_indices = _lists(partial)
        self.full_kv_num_blocks, self.full_kv_indices = _lists(fullb)
        self.q_num_blocks, self.q_indices = _lists(partial.swapaxes(-1, -2))
        self.full_q_num_blocks, self.full_q_indices = _lists(fullb.swapaxes(-1, -2))

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_kv_blocks(cls, kv_num_blocks, kv_indices, full_kv_num_blocks=None, full_kv_indices=None,
                       BLOCK_SIZE=128, mask_mod=None, seq_lengths=None):
        """From kv-side lists (e.g. computed elsewhere); the q-side lists are derived."""
        qb, kvb = _block_size(BLOCK_SIZE)
        kv_num = np.asarray(to_numpy(kv_num_blocks), dtype=np.int64)
        kv_idx = np.asarray(to_numpy(kv_indices), dtype=np.int64)
        if kv_idx.ndim != 4 or kv_num.shape != kv_idx.shape[:3]:
            raise ValueError(
                f"kv_indices must be [B, H, Q_BLOCKS, KV_BLOCKS] and kv_num_blocks [B, H, Q_BLOCKS];"
                f" got {kv_idx.shape} and {kv_num.shape}"
            )
        states = np.zeros(kv_idx.shape, dtype=np.int8)
        _scatter(states, kv_num, kv_idx, PARTIAL, "kv_indices")
        if full_kv_num_blocks is not None:
            _scatter(states, np.asarray(to_numpy(full_kv_num_blocks), dtype=np.int64),
                     np.asarray(to_numpy(full_kv_indices), dtype=np.int64), FULL, "full_kv_indices")
        if seq_lengths is None:
            seq_lengths = (states.shape[2] * qb, states.shape[3] * kvb)
        return cls(states, seq_lengths, (qb, kvb), as_mask(mask_mod) if mask_mod is not None else None)

    @classmethod
    def _on_device(cls, arrays: dict, seq_lengths, block_size, mask_mod, device, count_allowed=None):
        """A block mask whose states and lists are the device arrays in ``arrays`` (as the
        GPU builder returns them); host views are copied on demand."""
        self = cls.__new__(cls)
        LIVE_OBJECTS[id(self)] = self
        self.seq_lengths = tuple(int(s) for s in seq_lengths)
        self.BLOCK_SIZE = tuple(int(s) for s in block_size)
        self.mask_mod = mask_mod if mask_mod is not None else full()
        self.device = device
        self._states = None
        self._device_states = arrays["states"]
        self._batch_heads = tuple(int(s) for s in arrays["states"].shape[:2])
        self._num_allowed = None
        self._count_allowed = count_allowed
        self._rebuild = None
        self._tile_balance = _NOT_COMPUTED
        for name in _LIST_NAMES:
            setattr(self, name, arrays[name])
        return self

    def update(self, *captures) -> "BlockMask":
        """The block mask of the same mask structure with new captured values (e.g. next
        step's document boundaries; for ``varlen_block_mask``, new offsets): no
        re-tracing, a GPU-built mask is rebuilt on its device by the kernels compiled for
        the old values, and attention kernels compiled for them serve the new ones."""
        if self._rebuild is not None:
            return self._rebuild(*captures)
        b, h, q, kv = self.shape
        return create_block_mask(self.mask_mod.with_captures(captures), b, h, q, kv,
                                 BLOCK_SIZE=self.BLOCK_SIZE, device=None if self.device == "cpu" else self.device)

    # -- views ---------------------------------------------------------------------------------
    @property
    def shape(self):
        return tuple(self._batch_heads) + self.seq_lengths

    @property
    def num_allowed(self):
        """[B, H] exact count of attended (q, kv) pairs (FLOP accounting), or None if unknown.
        GPU-built masks count on first access (a second kernel pass without early exit)."""
        if self._num_allowed is None and self._count_allowed is not None:
            self._num_allowed = self._count_allowed()
        return self._num_allowed

    def _host_states(self) -> np.ndarray:
        if self._states is None:  # GPU-built: one host copy, on demand
            self._states = np.asarray(to_numpy(self._device_states), dtype=np.int8)
        return self._states

    def block_states(self) -> np.ndarray:
        """[B, H, Q_BLOCKS, KV_BLOCKS] int8: 0 empty, 1 partial, 2 full."""
        return self._host_states().copy()

    def to_dense(self) -> np.ndarray:
        """[B, H, Q_BLOCKS, KV_BLOCKS] int32: 1 where a tile is computed (partial or full)."""
        return (self._host_states() != EMPTY).astype(np.int32)

    def sparsity(self) -> float:
        """Percentage of tiles skipped (torch's definition)."""
        return 100.0 * (1.0 - float(self.to_dense().mean()))

    def tile_balance(self) -> float | None:
        """max / mean of the tiles each (batch, head, q block) row visits (partial + full),
        from host lists only: None for a GPU-built mask (reading its lists would wait for
        the GPU) or one that visits nothing. 1.0: every row does the same work. Decided at
        the first call and kept (the planner asks on every planned call, and a mask's
        kernel configuration must not change later)."""
        if self._tile_balance is _NOT_COMPUTED:
            balance = None
            if self._states is not None:
                counts = (self._states != EMPTY).sum(axis=-1, dtype=np.int64)
                mean = float(counts.mean()) if counts.size else 0.0
                balance = float(counts.max()) / mean if mean > 0 else None
            self._tile_balance = balance
        return self._tile_balance

    def density(self) -> float | None:
        """Fraction of (q, kv) pairs attended, exact; for FLOP accounting."""
        if self.num_allowed is None:
            return None
        q, kv = self.seq_lengths
        return float(np.mean(self.num_allowed)) / (q * kv)

    def as_tuple(self):
        return (self.seq_lengths[0], self.seq_lengths[1], self.kv_num_blocks, self.kv_indices,
                self.full_kv_num_blocks, self.full_kv_indices, self.q_num_blocks, self.q_indices,
                self.full_q_num_blocks, self.full_q_indices, self.BLOCK_SIZE[0], self.BLOCK_SIZE[1],
                self.mask_mod)

    def to_string(self, max_blocks: int = 32) -> str:
        """Tile picture per (b, h): █ full, ░ partial, blank empty (first ``max_blocks`` tiles)."""
        chars = {EMPTY: " ", PARTIAL: "░", FULL: "█"}
        lines = []
        states = self._host_states()
        for b in range(min(states.shape[0], 2)):
            for h in range(min(states.shape[1], 2)):
                grid = states[b, h, :max_blocks, :max_blocks]
                lines.append(f"b={b}, h={h}:")
                lines.extend("  |" + "".join(chars[int(s)] * 2 for s in row) + "|" for row in grid)
        return "\n".join(lines)

    def __repr__(self):
        b, h, q, kv = self.shape
        name = self.mask_mod.name or "custom"
        return (
            f"BlockMask(shape=(B={b}, H={h}, Q_LEN={q}, KV_LEN={kv}), BLOCK_SIZE={self.BLOCK_SIZE},"
            f" sparsity={self.sparsity():.2f}%, partial={int((self._host_states() == PARTIAL).sum())},"
            f" full={int((self._host_states() == FULL).sum())}, mask_mod={name}"
            + ("" if self.device == "cpu" else f", device={self.device!r}") + ")"
        )

    def __str__(self):
        return repr(self) + "\n" + self.to_string()


def _block_size(bs):
    def positive_int(x):
        return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)) and x > 0

    pair = (bs, bs) if positive_int(bs) else bs
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(positive_int(x) for x in pair)):
        raise ValueError(f"BLOCK_SIZE must be a positive int or a (q_block, kv_block) pair, got {bs!r}")
    return int(pair[0]), int(pair[1])


def _lists(selected: np.ndarray) -> BlockCounts:
    """Counts and stable-sorted indices (selected first, ascending), as torch orders them."""
    num = selected.sum(-1).astype(np.int32)
    idx = np.argsort(~selected, axis=-1, kind="stable").astype(np.int32)
    num.flags.writeable = idx.flags.writeable = False  # immutable: device copies may be cached
    return BlockCounts(num, idx)


def _scatter(states, num, idx, value, what):
    if np.any(num < 0) or np.any(num > idx.shape[-1]):
        raise ValueError(f"block counts for {what} must lie in [0, {idx.shape[-1]}]")
    if np.any((idx < 0) | (idx >= states.shape[-1])):
        raise ValueError(f"{what} holds block indices outside [0, {states.shape[-1]})")
    listed = np.arange(idx.shape[-1]) < num[..., None]
    b, h, r, c = np.nonzero(listed)
    states[b, h, r, idx[b, h, r, c]] = value


@dataclass(frozen=True)
class DeviceArrays:
    """What the GPU builder needs from a framework (adapters register a resolver with
    ``register_device``): device arrays, host→device copies, the stream to launch on."""

    device: object  # the name the block mask reports (e.g. "cuda:0")
    stream: int  # a CUstream handle
    empty: Callable  # (shape, dtype name) -> contiguous device array of the framework
    to_device: Callable  # captured value -> contiguous device array
    tvm_ffi_stream: bool = False  # TVM-FFI launches land on `stream` by themselves (torch)


_DEVICE_RESOLVERS: list = []


def register_device(resolve: Callable) -> None:
    """Register ``resolve(device) -> DeviceArrays | None`` for ``create_block_mask(device=)``
    (``flexattn.torch`` registers torch's CUDA devices on import)."""
    if resolve not in _DEVICE_RESOLVERS:
        _DEVICE_RESOLVERS.append(resolve)


def _on_host(device) -> bool:
    return device is None or str(device) == "cpu"


def _device_arrays(device) -> DeviceArrays | None:
    """The registered framework's arrays on ``device``, or None (no adapter imported that
    serves it, e.g. no CUDA here)."""
    if _on_host(device):
        return None
    for resolve in reversed(_DEVICE_RESOLVERS):
        arrays = resolve(device)
        if arrays is not None:
            return arrays
    return None


def _use_tvm_ffi(arrays: DeviceArrays) -> bool:
    """As the forward (core.kernel_path.use_tvm_ffi): TVM-FFI where installed and its
    stream is the caller's; ``FLEXATTN_TVM_FFI=0/1`` overrides."""
    import importlib.util
    import os

    flag = os.environ.get("FLEXATTN_TVM_FFI")
    if flag is not None:
        return flag == "1"
    return arrays.tvm_ffi_stream and importlib.util.find_spec("tvm_ffi") is not None


def _check_dims(fn, dims):
    for name, v, allow_none in dims:
        if v is None and allow_none:
            continue
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{fn}: {name} must be a positive int{' or None' if allow_none else ''}, got {v!r}")


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, _compile=False) -> BlockMask:
    """Block mask of ``mask_mod`` (a ``MaskMod`` or a function ``(b, h, q_idx, kv_idx) -> bool``).

    Argument order as ``torch.nn.attention.flex_attention.create_block_mask``; ``B`` or ``H``
    of ``None`` means the mask is the same for every batch / head (stored once).
    ``device=None`` (or "cpu") builds on the host (numpy lists). A GPU device (e.g. "cuda")
    that a registered adapter serves (``flexattn.torch`` imported, CUDA available) builds
    with the GPU kernels and keeps the lists there as that framework's arrays
    (``num_allowed`` is then counted on first access); any other device builds on the host,
    as torch-style code expects to run everywhere. ``_compile`` is accepted for compatibility.
    """
    mask = as_mask(mask_mod, "mask_mod") if mask_mod is not None else full()
    _check_dims("create_block_mask", (("B", B, True), ("H", H, True), ("Q_LEN", Q_LEN, False), ("KV_LEN", KV_LEN, False)))
    qb, kvb = _block_size(BLOCK_SIZE)
    B, H, Q_LEN, KV_LEN = int(B or 1), int(H or 1), int(Q_LEN), int(KV_LEN)
    arrays = _device_arrays(device)
    if arrays is not None:
        return _build_on_device(mask, B, H, Q_LEN, KV_LEN, qb, kvb, arrays)
    states, allowed = _classify_tiles(mask, B, H, Q_LEN, KV_LEN, qb, kvb)
    return BlockMask(states, (Q_LEN, KV_LEN), (qb, kvb), mask, allowed)


def _build_on_device(mask, B, H, Q_LEN, KV_LEN, qb, kvb, arrays: DeviceArrays) -> BlockMask:
    from .kernels.blockmask_sm90 import builder_for

    builder = builder_for(mask, qb, kvb, _use_tvm_ffi(arrays))
    built = builder.build(mask, B, H, Q_LEN, KV_LEN, arrays)

    def count_allowed():
        per_tile = builder.count_allowed(mask, B, H, Q_LEN, KV_LEN, arrays)
        return np.asarray(to_numpy(per_tile), dtype=np.int64).sum(axis=-1)

    return BlockMask._on_device(built, (Q_LEN, KV_LEN), (qb, kvb), mask, arrays.device, count_allowed)


def _classify_tiles(mask: MaskMod, B, H, Q_LEN, KV_LEN, qb, kvb):
    values = [to_numpy(c) for c in mask.captures]
    nq, nkv = -(-Q_LEN // qb), -(-KV_LEN // kvb)
    q_lo = np.arange(nq) * qb
    kv_lo = np.arange(nkv) * kvb
    q_hi = np.minimum(q_lo + qb, Q_LEN) - 1
    kv_hi = np.minimum(kv_lo + kvb, KV_LEN) - 1
    b = np.arange(B).reshape(B, 1, 1, 1)
    h = np.arange(H).reshape(1, H, 1, 1)
    ranges = {
        "b": (b, b), "h": (h, h),
        "q": (q_lo.reshape(1, 1, nq, 1), q_hi.reshape(1, 1, nq, 1)),
        "kv": (kv_lo.reshape(1, 1, 1, nkv), kv_hi.reshape(1, 1, 1, nkv)),
    }
    verdict = np.broadcast_to(classify(mask.expr, ranges, values), (B, H, nq, nkv))
    states = np.where(verdict == 1, FULL, np.where(verdict == 0, EMPTY, PARTIAL)).astype(np.int8)
    tile_elems = np.outer(q_hi - q_lo + 1, kv_hi - kv_lo + 1)  # valid elements per tile
    counts = np.where(states == FULL, tile_elems, 0).astype(np.int64)

    undecided = np.argwhere(verdict == -1)
    if len(undecided):
        tb, th, tq, tk = (undecided[:, i] for i in range(4))
        boxes = _Boxes(np.arange(len(undecided)), tb, th, q_lo[tq], q_hi[tq], kv_lo[tk], kv_hi[tk])
        allowed = _count_allowed(mask.expr, values, boxes, len(undecided))
        n_valid = tile_elems[tq, tk]
        states[tb, th, tq, tk] = np.where(allowed == 0, EMPTY, np.where(allowed == n_valid, FULL, PARTIAL))
        counts[tb, th, tq, tk] = allowed
    return states, counts.sum(axis=(2, 3))


class _Boxes(NamedTuple):
    """Index boxes [q_lo, q_hi] × [kv_lo, kv_hi] of batch b, head h, each inside tile ``tile``."""

    tile: np.ndarray
    b: np.ndarray
    h: np.ndarray
    q_lo: np.ndarray
    q_hi: np.ndarray
    kv_lo: np.ndarray
    kv_hi: np.ndarray

    def take(self, keep):
        return _Boxes(*(x[keep] for x in self))

    def split(self) -> "_Boxes":
        """Each box into its (up to) four quadrants; halves of a 1-wide side are dropped."""
        q_mid = (self.q_lo + self.q_hi) // 2
        kv_mid = (self.kv_lo + self.kv_hi) // 2
        parts = []
        for q_range in ((self.q_lo, q_mid), (q_mid + 1, self.q_hi)):
            for kv_range in ((self.kv_lo, kv_mid), (kv_mid + 1, self.kv_hi)):
                parts.append(_Boxes(self.tile, self.b, self.h, *q_range, *kv_range))
        kids = _Boxes(*(np.concatenate(cols) for cols in zip(*parts)))
        return kids.take((kids.q_lo <= kids.q_hi) & (kids.kv_lo <= kids.kv_hi))


def _count_allowed(expr, values, boxes: _Boxes, n_tiles: int) -> np.ndarray:
    """Exact count of allowed elements per tile, refining undecided boxes by quadrants.

    Interval analysis decides most sub-boxes of a tile the diagonal or a window edge
    crosses (a causal diagonal tile leaves 16 8×8 boxes undecided instead of 128×128
    elements), so only the boxes still undecided at 8×8 are evaluated element by element.
    """
    counts = np.zeros(n_tiles, dtype=np.int64)
    while len(boxes.tile) and int(np.max(np.maximum(boxes.q_hi - boxes.q_lo, boxes.kv_hi - boxes.kv_lo))) >= _LEAF:
        boxes = boxes.split()
        ranges = {"b": (boxes.b, boxes.b), "h": (boxes.h, boxes.h),
                  "q": (boxes.q_lo, boxes.q_hi), "kv": (boxes.kv_lo, boxes.kv_hi)}
        verdict = np.broadcast_to(classify(expr, ranges, values), boxes.tile.shape)
        full = verdict == 1
        area = (boxes.q_hi - boxes.q_lo + 1) * (boxes.kv_hi - boxes.kv_lo + 1)
        np.add.at(counts, boxes.tile[full], area[full])
        boxes = boxes.take(verdict == -1)
    per_chunk = max(1, _CHUNK_ELEMENTS // (_LEAF * _LEAF))
    step = np.arange(_LEAF)
    for start in range(0, len(boxes.tile), per_chunk):
        bx = boxes.take(slice(start, start + per_chunk))
        q = bx.q_lo[:, None, None] + step[None, :, None]
        kv = bx.kv_lo[:, None, None] + step[None, None, :]
        valid = (q <= bx.q_hi[:, None, None]) & (kv <= bx.kv_hi[:, None, None])
        env = {"b": bx.b[:, None, None], "h": bx.h[:, None, None],  # clipped: reads stay in range
               "q": np.minimum(q, bx.q_hi[:, None, None]), "kv": np.minimum(kv, bx.kv_hi[:, None, None])}
        allowed = np.broadcast_to(evaluate(expr, env, values), valid.shape) & valid
        np.add.at(counts, bx.tile, allowed.sum(axis=(1, 2)))
    return counts


# -- packed variable-length batches ------------------------------------------------------------

def varlen_block_mask(offsets=None, *, lengths=None, length: int | None = None, causal: bool = False,
                      BLOCK_SIZE=128, device=None) -> BlockMask:
    """Block mask of packed documents (``mods.document_from_offsets``, ``& mods.causal()``
    with ``causal=True``), from the offsets in closed form: no element evaluation.

    ``offsets`` [n+1] (one packing for the batch) or [B, n+1] (one per sequence, the last
    offset repeated to pad rows with fewer documents), or ``lengths`` [n] / [B, n] instead.
    ``Q_LEN = KV_LEN = length`` (default: the largest total); tokens past a row's total are
    padding and attend to nothing, so attention costs the real (unpadded) work only.

    Per tile: its rows span documents ``d(q_lo) .. d(q_last)`` and every key of those
    documents (up to the diagonal with ``causal``) is attended by some row, so a q-block
    row's non-empty kv tiles form one range; a row inside one document has its full
    tiles where the keys lie inside that document (and below the diagonal). The exact
    attended-pair count comes from the document lengths. ``device`` as in
    ``create_block_mask``: on a GPU only the lists are built there (from these states).
    ``update(new_offsets)`` rebuilds for the next batch's packing.
    """
    from .mods import causal as causal_mod
    from .mods.builtins import document_from_lengths, document_from_offsets

    if (offsets is None) == (lengths is None):
        raise ValueError("varlen_block_mask: pass offsets or lengths (one of them)")
    if lengths is not None:
        lens = np.asarray(to_numpy(lengths)).astype(np.int64)
        if lens.ndim not in (1, 2) or np.any(lens < 0):
            raise ValueError("varlen_block_mask: lengths must be a [n] or [B, n] array of non-negative ints")
        offsets = np.concatenate([np.zeros(lens.shape[:-1] + (1,), np.int64), np.cumsum(lens, axis=-1)], axis=-1)
        mask = document_from_lengths(lens, length)
    else:
        mask = document_from_offsets(offsets, length)  # validates the offsets
    off = np.asarray(to_numpy(offsets)).astype(np.int64)
    rows = off.reshape(-1, off.shape[-1])
    L = int(mask.captures[0].shape[-1])
    if causal:
        mask = mask & causal_mod()
    qb, kvb = _block_size(BLOCK_SIZE)
    states = _varlen_states(rows, L, qb, kvb, bool(causal))
    docs = np.diff(rows, axis=-1)
    pairs = (docs * (docs + 1) // 2 if causal else docs * docs).sum(axis=-1)
    allowed = pairs.reshape(-1, 1)  # [B, 1]

    def rebuild(new_offsets):
        return varlen_block_mask(new_offsets, length=L, causal=causal, BLOCK_SIZE=(qb, kvb), device=device)

    arrays = _device_arrays(device)
    if arrays is None:
        bm = BlockMask(states, (L, L), (qb, kvb), mask, allowed)
    else:
        from .kernels.blockmask_sm90 import compact

        dev_states = arrays.to_device(states)
        built = compact(dev_states, arrays, _use_tvm_ffi(arrays))
        built["states"] = dev_states
        bm = BlockMask._on_device(built, (L, L), (qb, kvb), mask, arrays.device)
        bm._num_allowed = allowed
    bm._rebuild = rebuild
    return bm


def _varlen_states(rows: np.ndarray, L: int, qb: int, kvb: int, causal: bool) -> np.ndarray:
    """[R, 1, nQ, nKV] int8 tile states of packed documents with offsets ``rows`` [R, n+1]."""
    nq, nkv = -(-L // qb), -(-L // kvb)
    q_lo = np.arange(nq, dtype=np.int64) * qb
    q_hi = np.minimum(q_lo + qb, L) - 1
    out = np.zeros((rows.shape[0], 1, nq, nkv), dtype=np.int8)  # EMPTY
    for r, off in enumerate(rows):
        total = int(off[-1])
        valid = q_lo < total
        q_last = np.minimum(q_hi, total - 1)
        d_lo = np.searchsorted(off, q_lo, side="right") - 1  # document of a position (empty ones skipped)
        d_hi = np.searchsorted(off, q_last, side="right") - 1
        d_lo, d_hi = np.clip(d_lo, 0, len(off) - 2), np.clip(d_hi, 0, len(off) - 2)
        key_hi = off[d_hi + 1] - 1  # the last key any row of the tile attends
        if causal:
            key_hi = np.minimum(key_hi, q_last)
        first, last = off[d_lo] // kvb, key_hi // kvb
        # full tiles: every row valid and in one document; keys inside it (and below the diagonal)
        one_doc = valid & (d_lo == d_hi) & (q_hi < total)
        full_hi = off[d_lo + 1] - 1
        if causal:
            full_hi = np.minimum(full_hi, q_lo)
        f_first = -(-off[d_lo] // kvb)
        f_last = np.where(full_hi >= L - 1, nkv - 1, (full_hi + 1) // kvb - 1)
        # one slice assignment per q-block row beats [nQ, nKV] temporaries (3x at 128k tokens)
        grid = out[r, 0]
        has_full = one_doc & (f_first <= f_last)
        for i, a, z, f, fa, fz in zip(np.flatnonzero(valid).tolist(), *(x[valid].tolist() for x in (
                first, last, has_full, f_first, f_last))):
            grid[i, a:z + 1] = PARTIAL
            if f:
                grid[i, fa:fz + 1] = FULL
    return out
