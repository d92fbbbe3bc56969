"""Mods used across reference/adapter tests, each paired with an independent torch formula.

A case builds (mask mod or None, score mod or None, torch mask fn, torch score fn) for a
given problem size, with fresh random captured data from ``rng``.
"""

from __future__ import annotations

import numpy as np
import torch

from flexattn import mods


# The block structures the forward planner tells apart, one call each (``structure_mods``):
# dense, the built-in causal, a band (a lambda), block-sparse documents, causal + a score mod.
STRUCTURES = ("dense", "causal", "band", "documents", "scored")


def structure_mods(kind, rng, Hq, S):
    """(score mod, mask) of a ``STRUCTURES`` kind, with fresh random bounds and data."""
    if kind == "dense":
        return None, None
    if kind == "causal":
        return None, mods.causal()
    if kind == "band":
        w = int(rng.integers(20, 300))
        return None, mods.mask_mod(lambda b, h, q, kv: (q - kv <= w) & (kv <= q))
    if kind == "documents":
        ids = np.sort(rng.integers(0, 4, size=S)).astype(np.int32)
        return None, mods.document(ids)
    return mods.alibi(num_heads=Hq) >> mods.softcap(float(rng.uniform(5, 30))), mods.causal()


def _doc_ids(rng, S, n_docs):
    cuts = np.sort(rng.choice(np.arange(1, S), size=min(n_docs - 1, S - 1), replace=False))
    return np.searchsorted(cuts, np.arange(S), side="right").astype(np.int32)


def case_none(rng, B, H, Q, KV):
    return None, None, None, None


def case_causal(rng, B, H, Q, KV):
    return mods.causal(), None, (lambda b, h, q, kv: q >= kv), None


def case_sliding_window(rng, B, H, Q, KV):
    w = int(rng.integers(1, max(2, KV // 2)))
    return mods.sliding_window(w), None, (lambda b, h, q, kv: (q - kv <= w) & (q >= kv)), None


def case_band(rng, B, H, Q, KV):
    """A band of diagonals written as a lambda: both edges anywhere (the diagonal itself
    may lie outside it), or one edge open; the kernels walk its blocks by arithmetic."""
    lo = int(rng.integers(-300, 60))
    hi = lo + int(rng.integers(0, 400))
    side = rng.integers(0, 3)

    def mask(b, h, q, kv):
        if side == 1:
            return q - kv >= lo
        if side == 2:
            return kv >= q - hi
        return (q - kv >= lo) & (kv - q >= -hi)

    return mods.mask_mod(mask), None, mask, None


def case_document(rng, B, H, Q, KV):
    S = max(Q, KV)
    ids = _doc_ids(rng, S, 4)
    t = torch.from_numpy(ids).long()
    return mods.document(ids), None, (lambda b, h, q, kv: t[q] == t[kv]), None


def case_document_batched(rng, B, H, Q, KV):
    S = max(Q, KV)
    ids = np.stack([_doc_ids(rng, S, 3) for _ in range(B)])
    t = torch.from_numpy(ids).long()
    return mods.document(torch.from_numpy(ids)), None, (lambda b, h, q, kv: t[b, q] == t[b, kv]), None


def case_prefix_lm(rng, B, H, Q, KV):
    prefix = torch.from_numpy(rng.integers(0, KV, size=B))
    return mods.prefix_lm(prefix), None, (lambda b, h, q, kv: (kv < prefix[b]) | (q >= kv)), None


def case_alibi(rng, B, H, Q, KV):
    slopes = mods.alibi_slopes(H)
    t = torch.from_numpy(slopes).double()
    return None, mods.alibi(num_heads=H), None, (lambda s, b, h, q, kv: s + t[h] * (kv - q))


def case_softcap(rng, B, H, Q, KV):
    cap = float(rng.uniform(0.5, 3.0))
    return None, mods.softcap(cap), None, (lambda s, b, h, q, kv: cap * torch.tanh(s / cap))


def case_relative_bias(rng, B, H, Q, KV):
    D = 7
    table = rng.standard_normal((H, 2 * D + 1))
    t = torch.from_numpy(table)
    return None, mods.relative_bias(table), None, (lambda s, b, h, q, kv: s + t[h, (q - kv).clamp(-D, D) + D])


def case_causal_relative_bias(rng, B, H, Q, KV):
    """Causal + a table wide enough for every distance (no clamping): many distinct
    diagonals per tile, each its own table entry."""
    m, _, mf, _ = case_causal(rng, B, H, Q, KV)
    D = max(Q, KV)
    table = rng.standard_normal((H, 2 * D + 1))
    t = torch.from_numpy(table)
    return m, mods.relative_bias(table), mf, (lambda s, b, h, q, kv: s + t[h, (q - kv).clamp(-D, D) + D])


def case_bias(rng, B, H, Q, KV):
    bias = rng.standard_normal((1, H, Q, KV))
    t = torch.from_numpy(bias)
    return None, mods.bias(bias), None, (lambda s, b, h, q, kv: s + t)


def case_causal_softcap(rng, B, H, Q, KV):
    m, _, mf, _ = case_causal(rng, B, H, Q, KV)
    _, s, _, sf = case_softcap(rng, B, H, Q, KV)
    return m, s, mf, sf


def case_window_document_alibi_softcap(rng, B, H, Q, KV):
    m1, _, f1, _ = case_sliding_window(rng, B, H, Q, KV)
    m2, _, f2, _ = case_document(rng, B, H, Q, KV)
    _, s1, _, g1 = case_alibi(rng, B, H, Q, KV)
    _, s2, _, g2 = case_softcap(rng, B, H, Q, KV)
    return (m1 & m2, s1 >> s2, (lambda b, h, q, kv: f1(b, h, q, kv) & f2(b, h, q, kv)),
            (lambda s, b, h, q, kv: g2(g1(s, b, h, q, kv), b, h, q, kv)))


def case_not_causal_or_prefix(rng, B, H, Q, KV):
    m1, _, f1, _ = case_causal(rng, B, H, Q, KV)
    m2, _, f2, _ = case_prefix_lm(rng, B, H, Q, KV)
    return ~m1 | m2, None, (lambda b, h, q, kv: ~f1(b, h, q, kv) | f2(b, h, q, kv)), None


def case_custom_function(rng, B, H, Q, KV):
    """A FlexAttention-style user function with torch ops and a captured tensor."""
    scale_per_head = torch.from_numpy(rng.uniform(0.5, 1.5, size=H))

    def score(s, b, h, q, kv):
        return torch.where(q >= kv, s * scale_per_head[h], s - (q - kv).abs().to(s.dtype) * 0.1)

    def mask(b, h, q, kv):
        return (q - kv) % 3 != 1

    return mods.mask_mod(mask), mods.score_mod(score), mask, score


def case_torch_style_causal_softcap(rng, B, H, Q, KV):
    """Causal and softcap as torch users write them: another spelling of the diagonal
    (recognized from the IR: the kernel's causal structure) and an IEEE division by a
    constant (a reciprocal multiply in the kernel)."""
    cap = float(rng.uniform(5, 30))

    def mask(b, h, q, kv):
        return kv <= q

    def score(s, b, h, q, kv):
        return cap * torch.tanh(s / cap)

    return mods.mask_mod(mask), mods.score_mod(score), mask, score


def case_integer_division(rng, B, H, Q, KV):
    """Mostly partial tiles with integer // and % by constants (powers of two and not) on
    dividends of both signs: a dilated band and a 2-D neighbourhood on a 12-wide image,
    and a band of every fourth key far from the diagonal (compares of q - kv, its abs and
    its residues with constants: the kernels' AffineIndex route)."""
    def mask(b, h, q, kv):
        dilated = ((q - kv).abs() <= 40) & ((q - kv) % 2 == 0)
        near = (((q // 12) - (kv // 12)).abs() <= 2) & (((q % 12) - (kv % 12)).abs() <= 2)
        far = ((kv - q) % 4 == 3) & ((q - kv).abs() > 100) & (kv - q < 140)
        return dilated | near | ((q - kv) // 16 == -1) | far

    def score(s, b, h, q, kv):
        return s + ((q - kv) // 8).to(s.dtype) * 0.05 - ((kv % 6) == 1).to(s.dtype) * 0.5

    return mods.mask_mod(mask), mods.score_mod(score), mask, score


def case_bit_shifts(rng, B, H, Q, KV):
    """Morton-style blocks and shifts of signed differences (torch's >> is arithmetic):
    the operators and torch's named functions."""
    k = int(rng.integers(2, 6))

    def mask(b, h, q, kv):
        same_block = (q >> k) == (kv >> k)
        return same_block | (torch.bitwise_right_shift(q - kv, 4) == -1) | ((kv << 1) == q)

    def score(s, b, h, q, kv):
        return s + ((q - kv) >> 5).to(s.dtype) * 0.1 - torch.bitwise_left_shift(kv & 3, 1).to(s.dtype) * 0.2

    return mods.mask_mod(mask), mods.score_mod(score), mask, score


CASES = {name[5:]: fn for name, fn in dict(globals()).items() if name.startswith("case_")}
