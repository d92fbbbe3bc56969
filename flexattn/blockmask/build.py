"""Building a block mask on the host: interval analysis classifies every tile at once; tiles
it cannot decide are split into quadrants and analysed again, down to 8×8 boxes; only boxes
still undecided are evaluated element by element (vectorized over all of them, in chunks).
On a GPU device the registered builder does the same work in kernels (``device.py``)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..arrays import to_numpy
from ..mods import MaskMod, as_mask, full
from ..mods.evaluate import evaluate
from ..mods.intervals import classify
from .device import gpu_builder
from .layout import EMPTY, FULL, PARTIAL, BlockMask, _block_size

_CHUNK_ELEMENTS = 1 << 22  # elements evaluated per numpy pass for undecided boxes
_LEAF = 8  # boxes still undecided at this size are evaluated element by element


def _check_dims(fn, dims):
    for name, v, allow_none in dims:
        if v is None and allow_none:
            continue
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{fn}: {name} must be a positive int{' or None' if allow_none else ''}, got {v!r}")


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, _compile=False,
                      separate_full_blocks: bool = True, compute_dq_write_order: bool = False,
                      dq_kv_order: bool = True) -> BlockMask:
    """Block mask of ``mask_mod`` (a ``MaskMod`` or a function ``(b, h, q_idx, kv_idx) -> bool``).

    Argument order as ``torch.nn.attention.flex_attention.create_block_mask``; ``B`` or ``H``
    of ``None`` means the mask is the same for every batch / head (stored once).
    ``device=None`` (or "cpu") builds on the host (numpy lists). A GPU device (e.g. "cuda")
    that a registered adapter serves (``flexattn.torch`` imported, CUDA available) builds
    with the GPU kernels and keeps the lists there as that framework's arrays
    (``num_allowed`` is then counted on first access); any other device builds on the host,
    as torch-style code expects to run everywhere. ``_compile`` is accepted for compatibility.
    ``separate_full_blocks=False`` (torch's): every visited tile is listed as partial, so
    the mask is evaluated on all of them (the full lists are empty). torch's
    ``compute_dq_write_order`` / ``dq_kv_order`` order its FLASH backend's deterministic dQ
    writes; our deterministic backward orders its own (``kernels/bwd``): accepted, no lists
    are added.
    """
    mask = as_mask(mask_mod, "mask_mod") if mask_mod is not None else full()
    _check_dims("create_block_mask", (("B", B, True), ("H", H, True), ("Q_LEN", Q_LEN, False), ("KV_LEN", KV_LEN, False)))
    qb, kvb = _block_size(BLOCK_SIZE)
    B, H, Q_LEN, KV_LEN = int(B or 1), int(H or 1), int(Q_LEN), int(KV_LEN)
    builder, arrays = gpu_builder(device)
    if builder is not None:
        block_mask = builder.build(mask, B, H, Q_LEN, KV_LEN, (qb, kvb), arrays, separate_full_blocks)
    else:
        states, allowed = _classify_tiles(mask, B, H, Q_LEN, KV_LEN, qb, kvb)
        if not separate_full_blocks:
            states = np.where(states == FULL, PARTIAL, states).astype(states.dtype)
        block_mask = BlockMask(states, (Q_LEN, KV_LEN), (qb, kvb), mask, allowed)
    block_mask.from_mask = True   # every tile classified from the mask alone
    return block_mask



def dense_mask(mod_fn, B, H, Q_LEN, KV_LEN) -> np.ndarray:
    """torch's ``create_mask`` on the host: bool [B, H, Q_LEN, KV_LEN], where a mask mod
    attends or a score mod (``(score, b, h, q_idx, kv_idx)``, given a zero score) does not
    return -inf. ``B`` / ``H`` of None mean 1."""
    import inspect

    from ..mods import Mod, ScoreMod, as_score

    B, H = int(B or 1), int(H or 1)
    is_score = isinstance(mod_fn, ScoreMod) or (not isinstance(mod_fn, Mod) and callable(mod_fn)
                                                 and len(inspect.signature(mod_fn).parameters) == 5)
    env = {"b": np.arange(B).reshape(B, 1, 1, 1), "h": np.arange(H).reshape(1, H, 1, 1),
           "q": np.arange(Q_LEN).reshape(1, 1, Q_LEN, 1), "kv": np.arange(KV_LEN).reshape(1, 1, 1, KV_LEN)}
    mod = as_score(mod_fn, "mod_fn") if is_score else as_mask(mod_fn, "mod_fn")
    if is_score:
        env["score"] = np.zeros((1, 1, 1, 1))
    value = evaluate(mod.expr, env, [to_numpy(c) for c in mod.captures])
    attended = ~np.isneginf(value) if is_score else np.asarray(value, dtype=bool)
    return np.broadcast_to(attended, (B, H, Q_LEN, KV_LEN)).copy()


def _tile_bounds(Q_LEN, KV_LEN, qb, kvb):
    nq, nkv = -(-Q_LEN // qb), -(-KV_LEN // kvb)
    q_lo = np.arange(nq) * qb
    kv_lo = np.arange(nkv) * kvb
    return q_lo, np.minimum(q_lo + qb, Q_LEN) - 1, kv_lo, np.minimum(kv_lo + kvb, KV_LEN) - 1


def tile_verdicts(mask: MaskMod, B, H, Q_LEN, KV_LEN, qb, kvb, values=None, b_hi=None, h_hi=None) -> np.ndarray:
    """Interval analysis of every tile at once, [B, H, Q_BLOCKS, KV_BLOCKS]: 1 surely all
    attended, 0 surely none, -1 undecided (no element is evaluated). ``b_hi`` / ``h_hi``
    (with B / H = 1): one verdict over batches / heads 0..b_hi / 0..h_hi together."""
    values = [to_numpy(c) for c in mask.captures] if values is None else values
    q_lo, q_hi, kv_lo, kv_hi = _tile_bounds(Q_LEN, KV_LEN, qb, kvb)
    nq, nkv = len(q_lo), len(kv_lo)
    b = np.arange(B).reshape(B, 1, 1, 1)
    h = np.arange(H).reshape(1, H, 1, 1)
    ranges = {
        "b": (b, b if b_hi is None else b + b_hi), "h": (h, h if h_hi is None else h + h_hi),
        "q": (q_lo.reshape(1, 1, nq, 1), q_hi.reshape(1, 1, nq, 1)),
        "kv": (kv_lo.reshape(1, 1, 1, nkv), kv_hi.reshape(1, 1, 1, nkv)),
    }
    return np.broadcast_to(classify(mask.expr, ranges, values), (B, H, nq, nkv))


def _classify_tiles(mask: MaskMod, B, H, Q_LEN, KV_LEN, qb, kvb):
    values = [to_numpy(c) for c in mask.captures]
    q_lo, q_hi, kv_lo, kv_hi = _tile_bounds(Q_LEN, KV_LEN, qb, kvb)
    verdict = tile_verdicts(mask, B, H, Q_LEN, KV_LEN, qb, kvb, values)
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


