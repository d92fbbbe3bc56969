"""Built-in mods. Each is an ordinary traced function: numbers and arrays it closes over
become runtime inputs, so e.g. ``sliding_window(512)`` and ``sliding_window(1024)`` share
one compiled kernel.
"""

from __future__ import annotations

import functools
import math
import operator

import numpy as np

from ..arrays import to_numpy
from .mod import MaskMod, ScoreMod, as_mask, built_in, mask_mod, score_mod
from . import ir


@built_in
def full() -> MaskMod:
    """Every query attends to every key."""
    return MaskMod(ir.const(True), (), "full")


@built_in
def and_masks(*masks) -> MaskMod:
    """torch's ``and_masks``: a mask attending where every one of ``masks`` (mods or
    functions) does; none: every position."""
    return functools.reduce(operator.and_, (as_mask(m, "and_masks") for m in masks), full())


@built_in
def or_masks(*masks) -> MaskMod:
    """torch's ``or_masks``: a mask attending where any of ``masks`` does; none: nowhere."""
    return functools.reduce(operator.or_, (as_mask(m, "or_masks") for m in masks), as_mask(False))


noop_mask = MaskMod(ir.const(True), (), "noop_mask")   # torch's name for "every position"


@built_in
def causal(offset: int = 0) -> MaskMod:
    """``q_idx + offset >= kv_idx``. ``offset = KV_LEN - Q_LEN`` aligns bottom-right
    (a query block at the end of a longer key sequence)."""
    if offset == 0:
        return mask_mod(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, name="causal")
    return mask_mod(lambda b, h, q_idx, kv_idx: q_idx + offset >= kv_idx, name=f"causal(offset={offset})")


@built_in
def sliding_window(left: int | None, right: int | None = 0) -> MaskMod:
    """Keys within ``[q_idx - left, q_idx + right]``; ``None`` leaves that side open.

    ``sliding_window(w)`` is the usual causal window of ``w`` past tokens (+ the diagonal).
    """
    for name, v in (("left", left), ("right", right)):
        if v is not None and (not isinstance(v, (int, np.integer)) or v < 0):
            raise ValueError(f"sliding_window: {name} must be a non-negative int or None, got {v!r}")
    label = f"sliding_window({left}, {right})"
    if left is None and right is None:
        return full()
    if left is None:
        return mask_mod(lambda b, h, q_idx, kv_idx: kv_idx - q_idx <= right, name=label)
    if right is None:
        return mask_mod(lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= left, name=label)
    return mask_mod(
        lambda b, h, q_idx, kv_idx: (q_idx - kv_idx <= left) & (kv_idx - q_idx <= right), name=label
    )


@built_in
def document(ids, kv_ids=None) -> MaskMod:
    """Tokens attend within their own document: ``ids[q_idx] == kv_ids[kv_idx]``.

    ``ids`` is [S] (shared by the batch) or [B, S]; ``kv_ids`` defaults to ``ids``
    (pass it when queries and keys are different sequences).
    """
    kv_ids = ids if kv_ids is None else kv_ids
    _check_rank("document", ids, (1, 2))
    _check_rank("document", kv_ids, (1, 2))
    if len(ids.shape) == 1 and len(kv_ids.shape) == 1:
        return mask_mod(lambda b, h, q_idx, kv_idx: ids[q_idx] == kv_ids[kv_idx], name="document")
    qi = ids if len(ids.shape) == 2 else None
    ki = kv_ids if len(kv_ids.shape) == 2 else None

    def doc_mask(b, h, q_idx, kv_idx):
        dq = qi[b, q_idx] if qi is not None else ids[q_idx]
        dk = ki[b, kv_idx] if ki is not None else kv_ids[kv_idx]
        return dq == dk

    return mask_mod(doc_mask, name="document")


def document_ids_from_offsets(offsets, length: int | None = None) -> np.ndarray:
    """int32 document id per token from cumulative offsets ``[0, l0, l0+l1, ..., total]``.

    ``offsets`` is [n+1] (one packing for the whole batch) or [B, n+1] (one per sequence;
    repeat the last offset to pad rows with fewer documents). Tokens at or after a row's
    last offset (padding up to ``length``, default the largest total) get id -1.
    """
    off = np.asarray(to_numpy(offsets)).astype(np.int64)
    if off.ndim not in (1, 2) or off.shape[-1] < 2:
        raise ValueError(f"offsets must be [n+1] or [B, n+1] with n >= 1, got shape {off.shape}")
    rows = off.reshape(-1, off.shape[-1])
    if np.any(rows[:, 0] != 0) or np.any(np.diff(rows, axis=-1) < 0):
        raise ValueError("offsets must start at 0 and be non-decreasing, e.g. [0, 100, 250, 400]")
    totals = rows[:, -1]
    length = int(totals.max()) if length is None else int(length)
    if length < int(totals.max()):
        raise ValueError(f"length={length} is shorter than the last offset {int(totals.max())}")
    ids = np.full((rows.shape[0], length), -1, dtype=np.int32)
    docs = np.arange(rows.shape[1] - 1, dtype=np.int32)
    for r, row in enumerate(rows):
        ids[r, : row[-1]] = np.repeat(docs, np.diff(row))
    return ids[0] if off.ndim == 1 else ids


@built_in
def document_from_offsets(offsets, length: int | None = None) -> MaskMod:
    """Packed sequences from cumulative offsets ([n+1], or [B, n+1] per sequence); padding
    tokens attend to nothing."""
    ids = document_ids_from_offsets(offsets, length)
    ids.flags.writeable = False  # ours alone: GPU adapters may keep one device copy
    if ids.ndim == 1:
        return mask_mod(lambda b, h, q_idx, kv_idx: (ids[q_idx] == ids[kv_idx]) & (ids[q_idx] >= 0), name="document")
    return mask_mod(lambda b, h, q_idx, kv_idx: (ids[b, q_idx] == ids[b, kv_idx]) & (ids[b, q_idx] >= 0), name="document")


@built_in
def document_from_lengths(lengths, length: int | None = None) -> MaskMod:
    """Packed sequences from per-document lengths ``[l0, l1, ...]`` (or [B, n] per sequence,
    zero-padded)."""
    lens = np.asarray(to_numpy(lengths)).astype(np.int64)
    if lens.ndim not in (1, 2) or np.any(lens < 0):
        raise ValueError("document lengths must be a [n] or [B, n] array of non-negative ints")
    zeros = np.zeros(lens.shape[:-1] + (1,), dtype=np.int64)
    return document_from_offsets(np.concatenate([zeros, np.cumsum(lens, axis=-1)], axis=-1), length)


@built_in
def prefix_lm(prefix_len) -> MaskMod:
    """Bidirectional over the first ``prefix_len`` keys, causal after: an int, or [B] per batch."""
    if isinstance(prefix_len, (int, np.integer)):
        return mask_mod(lambda b, h, q_idx, kv_idx: (kv_idx < prefix_len) | (q_idx >= kv_idx), name="prefix_lm")
    _check_rank("prefix_lm", prefix_len, (1,))
    return mask_mod(lambda b, h, q_idx, kv_idx: (kv_idx < prefix_len[b]) | (q_idx >= kv_idx), name="prefix_lm")


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The ALiBi paper's geometric slopes (interleaved for non-powers of two), float32 [H]."""
    if not isinstance(num_heads, (int, np.integer)) or num_heads <= 0:
        raise ValueError(f"alibi: num_heads must be a positive int, got {num_heads!r}")

    def power_of_two(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    p = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(p)
    if p < num_heads:
        slopes += power_of_two(2 * p)[0::2][: num_heads - p]
    return np.asarray(slopes, dtype=np.float32)


@built_in
def alibi(slopes=None, *, num_heads: int | None = None) -> ScoreMod:
    """ALiBi: ``score + slopes[h] * (kv_idx - q_idx)``. Pass ``slopes`` ([H], trainable if
    it is a tensor that requires grad) or ``num_heads`` for the paper's slopes."""
    if slopes is None:
        if num_heads is None:
            raise ValueError("alibi: pass slopes or num_heads")
        slopes = alibi_slopes(num_heads)
        slopes.flags.writeable = False  # ours alone: GPU adapters may keep one device copy
    elif isinstance(slopes, (int, np.integer)) and num_heads is None:
        slopes = alibi_slopes(int(slopes))  # alibi(16) reads as "16 heads"
        slopes.flags.writeable = False
    _check_rank("alibi", slopes, (1,))
    return score_mod(lambda score, b, h, q_idx, kv_idx: score + slopes[h] * (kv_idx - q_idx), name="alibi")


@built_in
def softcap(cap: float) -> ScoreMod:
    """Gemma-style soft capping: ``cap * tanh(score / cap)``."""
    if not cap > 0:
        raise ValueError(f"softcap: cap must be positive, got {cap!r}")
    cap = float(cap)
    inv_cap = 1.0 / cap  # a multiply per element in the kernel instead of an IEEE divide
    return score_mod(lambda score, b, h, q_idx, kv_idx: cap * (score * inv_cap).tanh(), name=f"softcap({cap:g})")


@built_in
def relative_bias(table) -> ScoreMod:
    """Learned relative-position bias: ``score + table[h, clamp(q-kv, -D, D) + D]``.

    ``table`` is [H, 2D+1] (per head) or [2D+1] (shared); distances beyond D clamp.
    """
    _check_rank("relative_bias", table, (1, 2))
    width = int(table.shape[-1])
    if width % 2 != 1:
        raise ValueError(f"relative_bias: the last dim of table must be odd (2*D+1), got {width}")
    d = (width - 1) // 2
    if len(table.shape) == 1:
        return score_mod(lambda score, b, h, q_idx, kv_idx: score + table[(q_idx - kv_idx).clamp(-d, d) + d], name="relative_bias")
    return score_mod(lambda score, b, h, q_idx, kv_idx: score + table[h, (q_idx - kv_idx).clamp(-d, d) + d], name="relative_bias")


@built_in
def bias(tensor) -> ScoreMod:
    """Additive bias broadcastable to [B, H, Q, KV] (rank 2 to 4; size-1 dims broadcast)."""
    _check_rank("bias", tensor, (2, 3, 4))
    shape = tuple(int(s) for s in tensor.shape)
    names = ("b", "h", "q", "kv")[4 - len(shape):]

    def add_bias(score, b, h, q_idx, kv_idx):
        value = {"b": b, "h": h, "q": q_idx, "kv": kv_idx}
        index = tuple(0 if size == 1 else value[n] for n, size in zip(names, shape))
        return score + tensor[index]

    return score_mod(add_bias, name="bias")


def _check_rank(fn, x, ranks):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{fn}: expected an array/tensor, got {type(x).__name__}")
    if len(x.shape) not in ranks:
        raise ValueError(f"{fn}: expected an array of rank {' or '.join(map(str, ranks))}, got shape {tuple(x.shape)}")
