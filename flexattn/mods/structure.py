"""What a mask is, read from its IR, whatever door it came through.

The kernels have cheaper iterations than "evaluate the mask on every tile" for some masks:
the causal structure puts the diagonal mask on the loop bounds. Which iteration a call
gets must not depend on how the user spelled the mask — ``mods.causal()``,
``lambda b, h, q_idx, kv_idx: q_idx >= kv_idx``, ``kv_idx <= q_idx``, ``q_idx - kv_idx >= 0``,
a conjunction that repeats itself — so the choice is made here, from the expression.

``diagonal_band(expr)`` recognizes masks that are exactly a band of diagonals,
``lo <= q - kv <= hi`` (either side may be open): the conjunction of comparisons whose
operands are linear in ``q`` and ``kv`` with equal and opposite coefficients (integer
bounds: ``q - kv > 3`` is ``q - kv >= 4``; ``2*q - 2*kv >= 1`` is ``q - kv >= 1``). A bound
may be a runtime scalar (a captured number, as ``mods.sliding_window(w)`` has): then it
is an ``Affine`` of the scalar slots, evaluated per call by ``band_values``.
Causal is the band ``(0, None)``; a causal sliding window of ``w`` is ``(0, w)``.
Anything else (buffer reads, other variables, disjunctions) is not a band.

``canonical_band(mask)``: a band mask rewritten to one fixed IR,
``(q - kv >= $0) & (q - kv <= $1)``, its bounds as captures — so every spelling of a
window (a lambda with literals, the built-in with runtime widths) compiles to one kernel.
"""

from __future__ import annotations

from typing import NamedTuple

from ..bounded import keep_bounded
from . import ir


class Affine(NamedTuple):
    """``const + sum(coef * $slot)``: a bound that reads runtime scalars."""

    const: int
    terms: tuple   # ((slot, coef), ...) sorted, no zero coefficients

    def value(self, captures, as_int=int):
        """The bound for ``captures`` (``as_int``: the integer type to read them as, e.g.
        a kernel's Int32 for runtime values)."""
        return self.const + sum(coef * as_int(captures[slot]) for slot, coef in self.terms)


class Band(NamedTuple):
    """``lo <= q - kv <= hi``; None leaves that side open; an int or an ``Affine`` of scalars."""

    lo: int | Affine | None
    hi: int | Affine | None

    @property
    def empty(self) -> bool:
        return isinstance(self.lo, int) and isinstance(self.hi, int) and self.lo > self.hi


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
    return keep_bounded(_BANDS, expr, band, _BANDS_CAPACITY)


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
        lo, hi = _tighter(a.lo, b.lo, max), _tighter(a.hi, b.hi, min)
        return None if _UNKNOWN in (lo, hi) else Band(lo, hi)
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


_UNKNOWN = object()   # two bounds that cannot be ordered statically


def _tighter(x, y, pick):
    if x is None:
        return y
    if y is None or x == y:
        return x
    if isinstance(x, int) and isinstance(y, int):
        return pick(x, y)
    return _UNKNOWN


def _compare(op: str, a: ir.Node, b: ir.Node) -> Band | None:
    """``a op b`` as a band on ``d = q - kv``, or None."""
    la, lb = _linear(a), _linear(b)
    if la is None or lb is None:
        return None
    # a - b = cq * q + ckv * kv + c0, compared with 0 (c0 an int or, with scalars, a dict)
    cq, ckv, c0 = la[0] - lb[0], la[1] - lb[1], _add(la[2], lb[2], -1)
    if cq == 0 and ckv == 0:
        if isinstance(c0, int):   # a constant comparison (folded away in practice)
            return Band(None, None) if _holds(op, c0) else Band(1, 0)
        return None
    if cq != -ckv or abs(cq) > _MAX_COEFFICIENT or abs(_const(c0)) > _MAX_CONSTANT:
        return None   # (large values could wrap in the kernel's int32 arithmetic)
    if cq < 0:   # -k*d + c0 op 0  <=>  k*d - c0 (flipped op) 0
        cq, c0, op = -cq, _add(0, c0, -1), {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq"}[op]
    k = cq   # k*d + c0 op 0 with k > 0, d an integer
    if not isinstance(c0, int):
        if k != 1:
            return None   # a symbolic bound divided by k: not an integer expression
        bound = _affine(_add(0, c0, -1))   # d op -c0
        return {"ge": Band(bound, None), "le": Band(None, bound), "eq": Band(bound, bound),
                "gt": Band(_affine(_add(_bound_dict(bound), 1, 1)), None),
                "lt": Band(None, _affine(_add(_bound_dict(bound), 1, -1)))}.get(op)
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


# Constant terms with scalars are dicts {slot: coef, None: const} while being combined.

def _const(c) -> int:
    return c if isinstance(c, int) else c.get(None, 0)


def _add(a, b, sign: int):
    """``a + sign * b`` for ints or scalar dicts."""
    if isinstance(a, int) and isinstance(b, int):
        return a + sign * b
    out = dict(a) if isinstance(a, dict) else {None: a}
    for key, coef in (b.items() if isinstance(b, dict) else ((None, b),)):
        out[key] = out.get(key, 0) + sign * coef
    out = {k: v for k, v in out.items() if v != 0 or k is None}
    return out.get(None, 0) if set(out) <= {None} else out


def _scale(c, factor: int):
    return c * factor if isinstance(c, int) else {k: v * factor for k, v in c.items()}


def _affine(c):
    if isinstance(c, int):
        return c
    return Affine(c.get(None, 0), tuple(sorted((k, v) for k, v in c.items() if k is not None)))


def _bound_dict(bound):
    if isinstance(bound, int):
        return bound
    return dict(bound.terms) | {None: bound.const}


def _holds(op: str, c: int) -> bool:
    return {"lt": c < 0, "le": c <= 0, "gt": c > 0, "ge": c >= 0, "eq": c == 0}[op]


def _linear(n: ir.Node):
    """``n`` as ``(coefficient of q, coefficient of kv, constant)`` over the integers, the
    constant an int or a dict of scalar slots (runtime numbers) and ``None`` for the
    literal part; or None."""
    if n.dtype != ir.INT:
        return None
    if n.op == "var":
        return {"q": (1, 0, 0), "kv": (0, 1, 0)}.get(n.attr)
    if n.op == "const":
        return (0, 0, n.attr)
    if n.op == "scalar":
        return (0, 0, {n.attr: 1, None: 0})
    if n.op in ("add", "sub"):
        a, b = _linear(n.args[0]), _linear(n.args[1])
        if a is None or b is None:
            return None
        sign = 1 if n.op == "add" else -1
        return (a[0] + sign * b[0], a[1] + sign * b[1], _add(a[2], b[2], sign))
    if n.op == "neg":
        a = _linear(n.args[0])
        return None if a is None else (-a[0], -a[1], _scale(a[2], -1))
    if n.op == "mul":
        a, b = _linear(n.args[0]), _linear(n.args[1])
        if a is None or b is None:
            return None
        for x, y in ((a, b), (b, a)):   # a literal factor only: scalar * q is not a band
            if x[:2] == (0, 0) and isinstance(x[2], int):
                return (x[2] * y[0], x[2] * y[1], _scale(y[2], x[2]))
    return None


def band_values(band: Band, captures, as_int=int) -> tuple:
    """``(lo, hi)`` as numbers for a call's captures (None stays None)."""
    return tuple(b.value(captures, as_int) if isinstance(b, Affine) else b for b in band)


_CANONICAL: dict = {}   # (has lo, has hi) -> the canonical IR (one object: plans key on it)


def canonical_band(mask):
    """A band ``mask`` (``MaskMod``) as the one IR ``(q - kv >= $0) & (q - kv <= $1)``
    (one side when the other is open), its bounds this mask's values, or None when
    ``mask`` is not a band with at least one bound (full, causal and empty are their own
    structures)."""
    band = diagonal_band(mask.expr)
    if band is None or band.empty or band == CAUSAL or band == Band(None, None):
        return None
    lo, hi = band_values(band, mask.captures)
    shape = (lo is not None, hi is not None)
    expr = _CANONICAL.get(shape)
    if expr is None:
        d = ir.binary("sub", ir.var("q"), ir.var("kv"))
        parts = []
        if shape[0]:
            parts.append(ir.binary("ge", d, ir.scalar(0, ir.INT)))
        if shape[1]:
            parts.append(ir.binary("le", d, ir.scalar(len(parts), ir.INT)))
        expr = _CANONICAL[shape] = parts[0] if len(parts) == 1 else ir.binary("and", *parts)
    return type(mask)(expr, tuple(v for v in (lo, hi) if v is not None), "band")
