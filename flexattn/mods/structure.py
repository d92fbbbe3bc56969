"""What a mask is, read from its IR, whatever door it came through.

The kernels have cheaper iterations than "evaluate the mask on every tile" for some masks:
the causal structure puts the diagonal mask on the loop bounds. Which iteration a call
gets must not depend on how the user spelled the mask — ``mods.causal()``,
``lambda b, h, q_idx, kv_idx: q_idx >= kv_idx``, ``kv_idx <= q_idx``, ``q_idx - kv_idx >= 0``,
a conjunction that repeats itself — so the choice is made here, from the expression.

``diagonal_band(expr)`` recognizes masks that are exactly a band of diagonals,
``lo <= q - kv <= hi`` (either side may be open): the conjunction of comparisons whose
operands are linear in ``q`` and ``kv`` with equal and opposite coefficients (integer
bounds: ``q - kv > 3`` is ``q - kv >= 4``; ``2*q - 2*kv >= 1`` is ``q - kv >= 1``).
Causal is the band ``(0, None)``; a causal sliding window of ``w`` is ``(0, w)``.
Anything else (captured values, other variables, disjunctions) is not a band.
"""

from __future__ import annotations

from typing import NamedTuple

from . import ir


class Band(NamedTuple):
    """``lo <= q - kv <= hi``; None leaves that side open."""

    lo: int | None
    hi: int | None

    @property
    def empty(self) -> bool:
        return self.lo is not None and self.hi is not None and self.lo > self.hi


CAUSAL = Band(0, None)
_NOT_A_BAND = "not a band"
_BANDS: dict = {}   # expr -> Band | None (structural keys: spellings of one IR share an entry)
_BANDS_CAPACITY = 512


def diagonal_band(expr: ir.Node) -> Band | None:
    """The band ``expr`` is exactly, or None. ``Band(None, None)``: no constraint (full)."""
    hit = _BANDS.get(expr, _NOT_A_BAND)
    if hit is not _NOT_A_BAND:
        return hit
    band = _band(expr)
    if len(_BANDS) >= _BANDS_CAPACITY:
        _BANDS.pop(next(iter(_BANDS)))
    _BANDS[expr] = band
    return band


def is_causal(mask) -> bool:
    """Whether a mask mod (or None) is exactly ``q_idx >= kv_idx`` (top-left causal)."""
    return mask is not None and diagonal_band(mask.expr) == CAUSAL


def _band(n: ir.Node) -> Band | None:
    if n.dtype != ir.BOOL:
        return None
    if n.op == "const":
        return Band(None, None) if n.attr else Band(1, 0)   # True: everything; False: empty
    if n.op == "and":
        a, b = _band(n.args[0]), _band(n.args[1])
        if a is None or b is None:
            return None
        return Band(_tighter(a.lo, b.lo, max), _tighter(a.hi, b.hi, min))
    if n.op == "not":
        inner = n.args[0]
        if inner.op in _FLIP:
            return _compare(_FLIP[inner.op], *inner.args)
        return None
    if n.op in ("lt", "le", "gt", "ge", "eq"):
        return _compare(n.op, *n.args)
    return None


_MAX_COEFFICIENT, _MAX_CONSTANT = 16, 1 << 24
_FLIP = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt"}


def _tighter(x, y, pick):
    if x is None:
        return y
    if y is None:
        return x
    return pick(x, y)


def _compare(op: str, a: ir.Node, b: ir.Node) -> Band | None:
    """``a op b`` as a band on ``d = q - kv``, or None."""
    la, lb = _linear(a), _linear(b)
    if la is None or lb is None:
        return None
    # a - b = cq * q + ckv * kv + c0, compared with 0
    cq, ckv, c0 = la[0] - lb[0], la[1] - lb[1], la[2] - lb[2]
    if cq == 0 and ckv == 0:   # a constant comparison (folded away in practice)
        return Band(None, None) if _holds(op, c0) else Band(1, 0)
    if cq != -ckv or abs(cq) > _MAX_COEFFICIENT or abs(c0) > _MAX_CONSTANT:
        return None   # (large values could wrap in the kernel's int32 arithmetic)
    if cq < 0:   # -k*d + c0 op 0  <=>  k*d - c0 (flipped op) 0
        cq, c0, op = -cq, -c0, {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq"}[op]
    # k*d + c0 op 0 with k > 0, d an integer
    k = cq
    if op == "ge":    # d >= -c0/k
        return Band(-(c0 // k), None)
    if op == "gt":    # d > -c0/k
        return Band(-c0 // k + 1, None)
    if op == "le":    # d <= -c0/k
        return Band(None, -c0 // k)
    if op == "lt":    # d < -c0/k
        return Band(None, (-c0 - 1) // k)
    if op == "eq":
        return Band(-c0 // k, -c0 // k) if c0 % k == 0 else Band(1, 0)
    return None


def _holds(op: str, c: int) -> bool:
    return {"lt": c < 0, "le": c <= 0, "gt": c > 0, "ge": c >= 0, "eq": c == 0}[op]


def _linear(n: ir.Node):
    """``n`` as ``(coefficient of q, coefficient of kv, constant)`` over the integers, or None."""
    if n.dtype != ir.INT:
        return None
    if n.op == "var":
        return {"q": (1, 0, 0), "kv": (0, 1, 0)}.get(n.attr)
    if n.op == "const":
        return (0, 0, n.attr)
    if n.op in ("add", "sub"):
        a, b = _linear(n.args[0]), _linear(n.args[1])
        if a is None or b is None:
            return None
        sign = 1 if n.op == "add" else -1
        return tuple(x + sign * y for x, y in zip(a, b))
    if n.op == "neg":
        a = _linear(n.args[0])
        return None if a is None else tuple(-x for x in a)
    if n.op == "mul":
        a, b = _linear(n.args[0]), _linear(n.args[1])
        if a is None or b is None:
            return None
        if a[:2] == (0, 0):
            return tuple(a[2] * y for y in b)
        if b[:2] == (0, 0):
            return tuple(b[2] * x for x in a)
    return None
