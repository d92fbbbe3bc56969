"""Interval analysis: bounds of an expression over boxes of indices, without elements.

Every variable gets a range ``[lo, hi]`` (numpy arrays, so thousands of q-block × kv-block
boxes are analysed in one vectorized pass); every node gets sound bounds. Booleans are
intervals over {0, 1}: ``lo == 1`` means surely true, ``hi == 0`` surely false.
That is enough to prove ``q >= kv`` all-true below the diagonal, a sliding window empty
far from it, or ``doc[q] == doc[kv]`` all-true / all-false when a block lies inside one
document (buffer reads use range-min/max tables over the indexed span).

Bounds are sound, not tight: "unknown" only costs element evaluation later.

Float values may also be NaN (0 / 0, inf - inf, 0 * inf, log or sqrt of a negative, a NaN
in a buffer), which no range holds: bounds cover the values that are not NaN, and
``Interval.nan`` says where a NaN is possible. A comparison with a NaN is false (``!=``:
true), so it is never *surely true* (``!=``: surely false) where an operand may be NaN —
without that, ``minimum(x / y, 0) <= 0`` would read "all true" for a box where x / y is
0 / 0 somewhere.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from . import ir
from .evaluate import erf as _erf

_INC = {
    "exp": np.exp, "exp2": np.exp2, "log": np.log, "log2": np.log2, "tanh": np.tanh,
    "sqrt": np.sqrt, "sigmoid": lambda x: 0.5 * (1.0 + np.tanh(0.5 * x)),
}
# increasing, evaluated on the GPU by libdevice or (fast erf) Abramowitz & Stegun, within
# ~1.5e-7 of these: bounds with a little slack
_INC_LIBDEVICE = {"erf": _erf, "atan": np.arctan}
_PERIODIC = {"sin": np.sin, "cos": np.cos}
_INF = np.inf
# Above this many table entries a buffer is bounded by its global min/max instead.
_MAX_TABLE_ENTRIES = 1 << 25


class Interval:
    """Bounds ``[lo, hi]`` of the values that are not NaN; ``nan``: a NaN is possible."""

    __slots__ = ("lo", "hi", "nan")

    def __init__(self, lo, hi, nan=False):
        self.lo, self.hi = np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)
        self.nan = np.asarray(nan, dtype=bool)


def bounds(
    node: ir.Node,
    ranges: Mapping[str, tuple],
    values: Sequence = (),
) -> Interval:
    """Sound bounds of ``node`` when each variable ``v`` lies in ``ranges[v] = (lo, hi)``."""
    tables = _RangeTables(values)
    out: dict[int, Interval] = {}
    with np.errstate(all="ignore"):
        for n in node.walk():
            args = [out[id(a)] for a in n.args]
            iv = _bound(n, args, ranges, values, tables)
            iv.nan = _may_be_nan(n, args, iv) if n.dtype == ir.FLOAT else np.asarray(False)
            out[id(n)] = iv
    return out[id(node)]


def _unbounded(a: Interval):
    return (a.lo == -_INF) | (a.hi == _INF)


def _may_be_nan(n: ir.Node, args, iv: Interval):
    """Where float node ``n`` may evaluate to NaN, given its operands' bounds and flags
    (``iv``: its own bounds; a load or a captured number may hold a NaN itself)."""
    op = n.op
    if op in ("const", "scalar", "load"):    # set by _number / the tables
        return iv.nan
    if op == "cast":                       # from int or bool: a number
        return np.asarray(False)
    inherited = np.asarray(False)
    for node, a in zip(n.args, args):
        if node.dtype == ir.FLOAT:
            inherited = inherited | a.nan
    if op == "where":
        c, a, b = args
        return np.where(c.lo >= 1, a.nan, np.where(c.hi <= 0, b.nan, a.nan | b.nan))
    if op == "add":
        a, b = args
        return inherited | ((a.hi == _INF) & (b.lo == -_INF)) | ((a.lo == -_INF) & (b.hi == _INF))
    if op == "sub":
        a, b = args
        return inherited | ((a.hi == _INF) & (b.hi == _INF)) | ((a.lo == -_INF) & (b.lo == -_INF))
    if op == "mul":
        a, b = args
        return inherited | (~_excludes_zero(a) & _unbounded(b)) | (~_excludes_zero(b) & _unbounded(a))
    if op in ("truediv", "floordiv"):
        a, b = args
        return inherited | (~_excludes_zero(a) & ~_excludes_zero(b)) | (_unbounded(a) & _unbounded(b))
    if op == "mod":
        a, b = args
        return inherited | ~_excludes_zero(b) | _unbounded(a) | _unbounded(b)
    if op in ("log", "log2", "sqrt", "rsqrt"):
        return inherited | (args[0].lo < 0)
    if op in ("sin", "cos"):
        return inherited | _unbounded(args[0])     # sin(±inf) is NaN
    return inherited       # neg, abs, minimum, maximum (NaN propagates), exp, tanh, ...


def classify(node: ir.Node, ranges, values=()) -> np.ndarray:
    """For a boolean ``node``: 1 = surely true, 0 = surely false, -1 = undecided."""
    iv = bounds(node, ranges, values)
    return np.where(iv.lo >= 1, 1, np.where(iv.hi <= 0, 0, -1)).astype(np.int8)


def _point(v):
    return Interval(v, v)


def _number(v: float) -> Interval:
    """A constant or captured number (NaN: "anything", possibly NaN)."""
    if np.isnan(v):
        return Interval(-_INF, _INF, True)
    return _point(v)


def _unknown(like):
    shape = np.shape(like)
    return Interval(np.full(shape, -_INF), np.full(shape, _INF))


def _safe(lo, hi):
    """NaN bounds (inf - inf, 0 * inf) mean "anything"."""
    return Interval(np.where(np.isnan(lo), -_INF, lo), np.where(np.isnan(hi), _INF, hi))


def _corners(f, a: Interval, b: Interval):
    c = [f(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    lo = np.minimum(np.minimum(c[0], c[1]), np.minimum(c[2], c[3]))
    hi = np.maximum(np.maximum(c[0], c[1]), np.maximum(c[2], c[3]))
    nan = np.isnan(c[0]) | np.isnan(c[1]) | np.isnan(c[2]) | np.isnan(c[3])
    return _safe(np.where(nan, np.nan, lo), np.where(nan, np.nan, hi))


def _excludes_zero(b: Interval):
    return (b.lo > 0) | (b.hi < 0)


def _bound(n: ir.Node, args, ranges, values, tables) -> Interval:
    op = n.op
    if op == "var":
        lo, hi = ranges[n.attr]
        return Interval(lo, hi)
    if op == "const":
        return _number(float(n.attr))
    if op == "scalar":
        return _number(float(values[n.attr]))
    if op == "load":
        return tables.bound(n.attr, args)
    if op == "cast":
        return _cast(args[0], n.args[0].dtype, n.dtype)
    if op == "where":
        c, a, b = args
        lo = np.where(c.lo >= 1, a.lo, np.where(c.hi <= 0, b.lo, np.minimum(a.lo, b.lo)))
        hi = np.where(c.lo >= 1, a.hi, np.where(c.hi <= 0, b.hi, np.maximum(a.hi, b.hi)))
        return Interval(lo, hi)
    if op == "add":
        a, b = args
        return _safe(a.lo + b.lo, a.hi + b.hi)
    if op == "sub":
        a, b = args
        return _safe(a.lo - b.hi, a.hi - b.lo)
    if op == "neg":
        return Interval(-args[0].hi, -args[0].lo)
    if op == "mul":
        return _corners(np.multiply, *args)
    if op in ("truediv", "floordiv"):
        a, b = args
        q = _corners(np.divide, a, b)
        if op == "floordiv":
            q = Interval(np.floor(q.lo), np.floor(q.hi))
        ok = _excludes_zero(b)
        return Interval(np.where(ok, q.lo, -_INF), np.where(ok, q.hi, _INF))
    if op == "mod":
        return _mod(*args, is_int=n.dtype == ir.INT)
    if op == "minimum":
        a, b = args
        return Interval(np.minimum(a.lo, b.lo), np.minimum(a.hi, b.hi))
    if op == "maximum":
        a, b = args
        return Interval(np.maximum(a.lo, b.lo), np.maximum(a.hi, b.hi))
    if op == "abs":
        a = args[0]
        lo = np.where(a.lo >= 0, a.lo, np.where(a.hi <= 0, -a.hi, 0.0))
        hi = np.maximum(np.abs(a.lo), np.abs(a.hi))
        return Interval(lo, hi)
    if op in _INC:
        f = _INC[op]
        return _safe(f(args[0].lo), f(args[0].hi))
    if op in _INC_LIBDEVICE:
        f = _INC_LIBDEVICE[op]
        return _safe(f(args[0].lo) - 1e-6, f(args[0].hi) + 1e-6)
    if op == "rsqrt":
        a = args[0]
        return _safe(1.0 / np.sqrt(a.hi), 1.0 / np.sqrt(a.lo))
    if op in _PERIODIC:
        # [-1, 1]; tighter where the range holds no extremum (between the endpoints' values)
        return _periodic(_PERIODIC[op], args[0])
    if op in ir.COMPARE:
        return _compare(op, *args)
    if op == "not":
        a = args[0]
        if n.dtype == ir.BOOL:
            return Interval(1.0 - a.hi, 1.0 - a.lo)
        return _exact_or_unknown(np.invert, args)
    if op in ir.LOGIC:
        a, b = args
        if n.dtype != ir.BOOL:
            f = {"and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}[op]
            return _exact_or_unknown(f, args)
        if op == "and":
            return Interval(np.minimum(a.lo, b.lo), np.minimum(a.hi, b.hi))
        if op == "or":
            return Interval(np.maximum(a.lo, b.lo), np.maximum(a.hi, b.hi))
        known = (a.lo == a.hi) & (b.lo == b.hi)
        x = np.abs(a.lo - b.lo)
        return Interval(np.where(known, x, 0.0), np.where(known, x, 1.0))
    if op in ir.SHIFT:
        # Monotone in the shifted value for a known count: x << c = x * 2^c, x >> c =
        # floor(x / 2^c).
        a, b = args
        known = b.lo == b.hi
        factor = np.exp2(np.where(known, b.lo, 0.0))
        if op == "shl":
            lo, hi = a.lo * factor, a.hi * factor
        else:
            lo, hi = np.floor(a.lo / factor), np.floor(a.hi / factor)
        return Interval(np.where(known, lo, -np.inf), np.where(known, hi, np.inf))
    raise NotImplementedError(f"interval bounds of op {op!r}")


def _periodic(f, a: Interval) -> Interval:
    """Bounds of sin / cos over [lo, hi]: the endpoints' values, widened to ±1 where an
    extremum (sin: π/2 + kπ; cos: kπ) lies inside; [-1, 1] for ranges of a period or more,
    unbounded ones and where float32 evaluation could disagree (|x| > 2^20)."""
    shift = 0.5 * np.pi if f is np.sin else 0.0     # extrema of f at shift + k * pi
    lo, hi = np.broadcast_arrays(a.lo, a.hi)
    wide = ~((hi - lo) < 2 * np.pi) | (np.abs(lo) > 2.0 ** 20) | (np.abs(hi) > 2.0 ** 20)
    with np.errstate(invalid="ignore"):
        first = np.ceil((lo - shift) / np.pi)            # the first extremum index at or above lo
        inside = np.where(wide, True, shift + first * np.pi <= hi)
        ends_lo, ends_hi = np.minimum(f(lo), f(hi)), np.maximum(f(lo), f(hi))
        # an extremum inside: a maximum (f = 1) where its index is even for sin / cos at kπ
        # with k even; a minimum otherwise; a range of more than pi holds both
        two = np.where(wide, True, shift + (first + 1) * np.pi <= hi)
        is_max = np.where(np.isfinite(first), np.mod(first, 2) == 0, True)
    out_lo = np.where(wide | two | (inside & ~is_max), -1.0, ends_lo)
    out_hi = np.where(wide | two | (inside & is_max), 1.0, ends_hi)
    # a little slack: float32 evaluation on the GPU rounds differently near the endpoints
    return Interval(np.maximum(out_lo - 1e-6, -1.0), np.minimum(out_hi + 1e-6, 1.0))


def _cast(a: Interval, src: str, dst: str) -> Interval:
    if dst == ir.BOOL:  # nonzero → true (NaN too)
        surely_true = (a.lo > 0) | (a.hi < 0)
        surely_false = (a.lo == 0) & (a.hi == 0) & ~a.nan
        return Interval(np.where(surely_true, 1.0, 0.0), np.where(surely_false, 0.0, 1.0))
    if dst == ir.INT and src == ir.FLOAT:
        # trunc is monotone; a NaN converts to an arbitrary integer, and so does an infinity
        # (numpy: INT64_MIN for either sign; the GPU saturates to the int32 range)
        wild_lo = a.nan | (a.hi == _INF)
        wild_hi = a.nan | np.isinf(a.hi)
        return Interval(np.where(wild_lo, -_INF, np.trunc(a.lo)), np.where(wild_hi, _INF, np.trunc(a.hi)))
    return Interval(a.lo, a.hi, a.nan)


def _compare(op, a: Interval, b: Interval) -> Interval:
    nan = a.nan | b.nan        # a comparison with NaN is false (!=: true)
    if op in ("gt", "ge"):
        a, b, op = b, a, {"gt": "lt", "ge": "le"}[op]
    if op == "lt":
        true, false = a.hi < b.lo, a.lo >= b.hi
    elif op == "le":
        true, false = a.hi <= b.lo, a.lo > b.hi
    else:
        same_point = (a.lo == a.hi) & (b.lo == b.hi) & (a.lo == b.lo)
        disjoint = (a.hi < b.lo) | (b.hi < a.lo)
        true, false = (same_point, disjoint) if op == "eq" else (disjoint, same_point)
    if op == "ne":
        false = false & ~nan
    else:
        true = true & ~nan
    return Interval(np.where(true, 1.0, 0.0), np.where(false, 0.0, 1.0))


def _mod(a: Interval, b: Interval, is_int: bool) -> Interval:
    """Python modulo (sign of the divisor). Exact when the span stays in one period."""
    point = b.lo == b.hi
    c = b.lo
    same_period = point & _excludes_zero(b) & (np.floor(a.lo / np.where(c == 0, 1, c)) == np.floor(a.hi / np.where(c == 0, 1, c)))
    exact_lo, exact_hi = np.mod(a.lo, np.where(c == 0, 1, c)), np.mod(a.hi, np.where(c == 0, 1, c))
    exact_lo, exact_hi = np.minimum(exact_lo, exact_hi), np.maximum(exact_lo, exact_hi)
    top = np.maximum(np.abs(b.lo), np.abs(b.hi))
    top = np.maximum(top - 1, 0.0) if is_int else top  # x % 0 evaluates to 0: keep [0, 0], not [1, -1]
    gen_lo = np.where(b.lo > 0, 0.0, np.where(b.hi < 0, -top, -top))
    gen_hi = np.where(b.lo > 0, top, np.where(b.hi < 0, 0.0, top))
    lo = np.where(same_period, exact_lo, gen_lo)
    hi = np.where(same_period, exact_hi, gen_hi)
    return _safe(lo, hi)


def _exact_or_unknown(f, args) -> Interval:
    known = np.ones(np.broadcast(*[a.lo for a in args]).shape, dtype=bool)
    for a in args:
        known &= a.lo == a.hi
    safe = [np.where(known, a.lo, 0).astype(np.int64) for a in args]
    v = f(*safe).astype(np.float64)
    return Interval(np.where(known, v, -_INF), np.where(known, v, _INF))


class _RangeTables:
    """Min/max of buffer spans in O(1) per query via sparse tables along one axis, with
    only the levels the widest span asked needs (tile-sized spans of a long document-id
    array: 10 levels, not 20), in the buffer's own dtype where it is an integer (exact,
    and half the bytes of float64)."""

    def __init__(self, values):
        self.values = values
        self._tables: dict = {}
        self._arrays: dict = {}

    def _array(self, slot):
        """(the buffer as float64, as its own numpy array) — made once per slot."""
        hit = self._arrays.get(slot)
        if hit is None:
            from ..arrays import to_numpy

            native = np.asarray(to_numpy(self.values[slot]))
            hit = self._arrays[slot] = (np.asarray(native, dtype=np.float64), native)
        return hit

    def bound(self, buf: ir.BufferRef, index: list) -> Interval:
        """Min / max over the indexed span, and whether it holds a NaN (as the kernels'
        scan: a span's min / max tables propagate NaN; wider spans: any NaN in the buffer)."""
        arr, _ = self._array(buf.slot)
        return self._bound(buf.slot, arr, index)

    def _bound(self, slot, arr, index: list) -> Interval:
        if arr.ndim == 0:
            return _number(arr[()])
        if arr.size == 0:
            return _unknown(0.0)
        los, his = [], []
        for d, iv in enumerate(index):  # clip to the buffer: reads stay in bounds
            top = arr.shape[d] - 1
            los.append(np.clip(iv.lo, 0, top))
            his.append(np.clip(iv.hi, 0, top))
        los = np.broadcast_arrays(*los)
        his = np.broadcast_arrays(*[np.broadcast_to(h, los[0].shape) for h in his])
        span_dims = [d for d in range(arr.ndim) if np.any(los[d] != his[d])]
        if not span_dims:
            v = arr[tuple(lo.astype(np.int64) for lo in los)]
            nan = np.isnan(v)
            return Interval(np.where(nan, -_INF, v), np.where(nan, _INF, v), nan)
        levels = 0
        if len(span_dims) == 1:
            widest = int(np.max(his[span_dims[0]] - los[span_dims[0]])) + 1
            levels = int(np.floor(np.log2(max(widest, 1)))) + 1
        if len(span_dims) > 1 or arr.size * levels > _MAX_TABLE_ENTRIES:
            any_nan = bool(np.isnan(arr).any())
            gmin, gmax = (-_INF, _INF) if any_nan else (np.min(arr), np.max(arr))
            return Interval(np.full(los[0].shape, gmin), np.full(los[0].shape, gmax), any_nan)
        axis = span_dims[0]
        mins, maxs = self._table(slot, axis, levels)
        lo = los[axis].astype(np.int64)
        hi = his[axis].astype(np.int64)
        k = np.floor(np.log2(np.maximum(hi - lo + 1, 1))).astype(np.int64)
        second = hi - (1 << k) + 1
        pts = [x.astype(np.int64) for x in los]
        idx1 = tuple([k] + [lo if d == axis else pts[d] for d in range(arr.ndim)])
        idx2 = tuple([k] + [second if d == axis else pts[d] for d in range(arr.ndim)])
        vmin = np.minimum(mins[idx1], mins[idx2]).astype(np.float64, copy=False)
        vmax = np.maximum(maxs[idx1], maxs[idx2]).astype(np.float64, copy=False)
        iv = _safe(vmin, vmax)
        iv.nan = np.isnan(vmin) | np.isnan(vmax)
        return iv

    def _table(self, slot, axis, levels: int):
        """(mins, maxs) [levels, *shape]: level k holds the min / max of the 2^k entries
        from each index along ``axis`` (fewer at the end). Rebuilt deeper if a later
        query spans more."""
        key = (slot, axis)
        hit = self._tables.get(key)
        if hit is None or len(hit[0]) < levels:
            as_float, native = self._array(slot)
            arr = native if np.issubdtype(native.dtype, np.integer) else as_float
            n = arr.shape[axis]
            mins = np.empty((levels,) + arr.shape, dtype=arr.dtype)
            maxs = np.empty((levels,) + arr.shape, dtype=arr.dtype)
            mins[0] = maxs[0] = arr
            a = np.moveaxis(mins, axis + 1, -1)
            b = np.moveaxis(maxs, axis + 1, -1)
            for k in range(1, levels):
                step = 1 << (k - 1)
                a[k][..., n - step:] = a[k - 1][..., n - step:]
                b[k][..., n - step:] = b[k - 1][..., n - step:]
                np.minimum(a[k - 1][..., : n - step], a[k - 1][..., step:], out=a[k][..., : n - step])
                np.maximum(b[k - 1][..., : n - step], b[k - 1][..., step:], out=b[k][..., : n - step])
            hit = self._tables[key] = (mins, maxs)
        return hit
