"""Packed variable-length batches: tile states in closed form from the document offsets,
no element evaluation."""

from __future__ import annotations

import numpy as np

from ..arrays import to_numpy
from .device import gpu_builder
from .layout import FULL, PARTIAL, BlockMask, _block_size


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
    from ..mods import causal as causal_mod
    from ..mods.builtins import document_from_lengths, document_from_offsets

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

    builder, arrays = gpu_builder(device)
    if builder is None:
        bm = BlockMask(states, (L, L), (qb, kvb), mask, allowed)
    else:
        dev_states = arrays.to_device(states)
        built = builder.compact(dev_states, arrays)
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
