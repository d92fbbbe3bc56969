"""Block-sparse layout of a mask, in FlexAttention's format.

The attention matrix is cut into ``BLOCK_SIZE = (q_block, kv_block)`` tiles. Each tile is
*empty* (skipped), *full* (computed without evaluating the mask) or *partial* (computed
with the mask). Per (b, h, q-block) we store the partial kv-blocks
(``kv_num_blocks``, ``kv_indices``) and the full ones (``full_kv_*``); per kv-block the
q-side transposes (``q_*``, ``full_q_*``) serve the backward. Index lists are sorted
like torch's: the listed blocks in ascending order first, the rest after.

Building: interval analysis classifies every tile at once; tiles it cannot decide are
split into quadrants and analysed again, down to 8×8 boxes; only boxes still undecided
are evaluated element by element (vectorized over all of them, in chunks).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .arrays import to_numpy
from .mods import MaskMod, as_mask, full
from .mods.mod import LIVE_OBJECTS
from .mods.evaluate import evaluate
from .mods.intervals import classify

EMPTY, PARTIAL, FULL = 0, 1, 2
_CHUNK_ELEMENTS = 1 << 22  # elements evaluated per numpy pass for undecided boxes
_LEAF = 8  # boxes still undecided at this size are evaluated element by element


class BlockCounts(NamedTuple):
    num_blocks: np.ndarray  # [..., rows]
    indices: np.ndarray  # [..., rows, cols]


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
        self._states = states
        self.num_allowed = num_allowed  # [B, H] exact count of attended (q, kv) pairs, if known
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

    def update(self, *captures) -> "BlockMask":
        """The block mask of the same mask structure with new captured values (e.g. next
        step's document boundaries): no re-tracing, and kernels compiled for the old
        values serve the new ones."""
        b, h, q, kv = self.shape
        return create_block_mask(self.mask_mod.with_captures(captures), b, h, q, kv, BLOCK_SIZE=self.BLOCK_SIZE)

    # -- views ---------------------------------------------------------------------------------
    @property
    def shape(self):
        b, h = self._states.shape[:2]
        return (b, h) + self.seq_lengths

    def block_states(self) -> np.ndarray:
        """[B, H, Q_BLOCKS, KV_BLOCKS] int8: 0 empty, 1 partial, 2 full."""
        return self._states.copy()

    def to_dense(self) -> np.ndarray:
        """[B, H, Q_BLOCKS, KV_BLOCKS] int32: 1 where a tile is computed (partial or full)."""
        return (self._states != EMPTY).astype(np.int32)

    def sparsity(self) -> float:
        """Percentage of tiles skipped (torch's definition)."""
        return 100.0 * (1.0 - float(self.to_dense().mean()))

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
        for b in range(min(self._states.shape[0], 2)):
            for h in range(min(self._states.shape[1], 2)):
                grid = self._states[b, h, :max_blocks, :max_blocks]
                lines.append(f"b={b}, h={h}:")
                lines.extend("  |" + "".join(chars[int(s)] * 2 for s in row) + "|" for row in grid)
        return "\n".join(lines)

    def __repr__(self):
        b, h, q, kv = self.shape
        name = self.mask_mod.name or "custom"
        return (
            f"BlockMask(shape=(B={b}, H={h}, Q_LEN={q}, KV_LEN={kv}), BLOCK_SIZE={self.BLOCK_SIZE},"
            f" sparsity={self.sparsity():.2f}%, partial={int((self._states == PARTIAL).sum())},"
            f" full={int((self._states == FULL).sum())}, mask_mod={name})"
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


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, _compile=False) -> BlockMask:
    """Block mask of ``mask_mod`` (a ``MaskMod`` or a function ``(b, h, q_idx, kv_idx) -> bool``).

    Argument order as ``torch.nn.attention.flex_attention.create_block_mask``; ``B`` or ``H``
    of ``None`` means the mask is the same for every batch / head (stored once).
    ``device`` and ``_compile`` are accepted for compatibility; building happens on the host.
    """
    mask = as_mask(mask_mod, "mask_mod") if mask_mod is not None else full()
    for name, v, allow_none in (("B", B, True), ("H", H, True), ("Q_LEN", Q_LEN, False), ("KV_LEN", KV_LEN, False)):
        if v is None and allow_none:
            continue
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"create_block_mask: {name} must be a positive int{' or None' if allow_none else ''}, got {v!r}")
    qb, kvb = _block_size(BLOCK_SIZE)
    B, H, Q_LEN, KV_LEN = int(B or 1), int(H or 1), int(Q_LEN), int(KV_LEN)
    states, allowed = _classify_tiles(mask, B, H, Q_LEN, KV_LEN, qb, kvb)
    return BlockMask(states, (Q_LEN, KV_LEN), (qb, kvb), mask, allowed)


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
