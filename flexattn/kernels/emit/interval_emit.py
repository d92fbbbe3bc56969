"""IR → CuTeDSL interval analysis: sound bounds of a mask over one tile, inside a kernel.

The GPU twin of ``mods.intervals`` (read that first): every node gets ``(lo, hi)`` bounds
as Float64 values, so one thread decides in a few instructions whether a q×kv tile is
surely all-true, all-false, or undecided. Float64 holds every int32 index expression
exactly, as the host's numpy analysis does. Bounds are sound, not tight; where this
emitter knows less than the host (transcendental functions, buffer reads over long or
multi-dimensional spans) it answers "anything", which only costs element evaluation.

Buffer reads take the exact min/max over the indexed span by scanning it (at most
``SCAN_LIMIT`` elements along one dimension): ``doc[q_idx]`` over a 128-row tile reads
128 cached values, and a tile inside one document is decided without element work.

NaN, as on the host: bounds cover the values that are not NaN, and each float node also
gets a Boolean "surely not NaN" (``_not_nan``); a comparison is surely true (``!=``:
surely false) only where both operands are surely not NaN.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float64, Int32, const_expr

from flexattn.mods import ir

SCAN_LIMIT = 4096  # longest buffer span scanned for its min/max; longer: unbounded

_INF = float("inf")


def _f64(x):
    return Float64(x)


def _sel(c, a, b):
    return Float64(cutlass.select_(c, Float64(a), Float64(b)))


def _min(a, b):
    return _sel(a < b, a, b)


def _max(a, b):
    return _sel(a > b, a, b)


def _isnan(x):
    return x != x


def _safe(lo, hi):
    """NaN bounds (inf - inf, 0 * inf, inf / inf) mean "anything"."""
    return _sel(_isnan(lo), -_INF, lo), _sel(_isnan(hi), _INF, hi)


def _unknown():
    return _f64(-_INF), _f64(_INF)


def _bool_iv(surely_true, surely_false):
    """A boolean interval: [1, 1] surely true, [0, 0] surely false, else [0, 1]."""
    return _sel(surely_true, 1.0, 0.0), _sel(surely_false, 0.0, 1.0)


def _excludes_zero(b):
    return (b[0] > 0.0) | (b[1] < 0.0)


def _corners(f, a, b):
    c = [f(x, y) for x in a for y in b]
    nan = _isnan(c[0]) | _isnan(c[1]) | _isnan(c[2]) | _isnan(c[3])
    lo = _min(_min(c[0], c[1]), _min(c[2], c[3]))
    hi = _max(_max(c[0], c[1]), _max(c[2], c[3]))
    return _sel(nan, -_INF, lo), _sel(nan, _INF, hi)


def _floor(x):
    return Float64(cute.math.floor(x))


def _pymod(x, c):
    """Python's modulo on Float64 (the divisor's sign)."""
    return x - _floor(x / c) * c


def bounds(node: ir.Node, ranges: dict, args, scan_limit: int = SCAN_LIMIT) -> tuple:
    """Emit ``(lo, hi)`` Float64 bounds of ``node`` when each index variable ``v`` lies in
    ``ranges[v] = (lo, hi)`` (DSL integers); ``args`` are the mod's captured inputs by slot;
    buffer spans longer than ``scan_limit`` are unbounded (callers on a hot path lower it)."""
    out: dict[int, tuple] = {}
    not_nan: dict[int, object] = {}
    for n in node.walk():
        a = [out[id(x)] for x in n.args]
        ok = [not_nan[id(x)] for x in n.args]
        if n.op == "load":
            lo, hi, ok_n = _load(args[n.attr.slot], a, scan_limit)
            out[id(n)] = (lo, hi)
        else:
            out[id(n)] = _bound(n, a, ok, ranges, args, scan_limit)
            ok_n = _not_nan(n, a, ok, out[id(n)], args) if n.dtype == ir.FLOAT else Boolean(True)
        not_nan[id(n)] = ok_n if n.dtype == ir.FLOAT else Boolean(True)
    return out[id(node)]


def _bounded(x):
    return (x[0] > -_INF) & (x[1] < _INF)


def _not_nan(n: ir.Node, a: list, ok: list, own, args):
    """Boolean: float node ``n`` is surely not NaN over the box (the host's
    ``intervals._may_be_nan``, negated)."""
    op = n.op
    if op == "const":
        return Boolean(float(n.attr) == float(n.attr))
    if op == "scalar":
        v = _f64(args[n.attr])
        return v == v
    if op == "cast":
        return Boolean(True)
    inherited = Boolean(True)
    for node, flag in zip(n.args, ok):
        if node.dtype == ir.FLOAT:
            inherited = inherited & flag
    if op == "where":
        c = a[0]
        t, f = c[0] >= 1.0, c[1] <= 0.0
        return (t & ok[1]) | (f & ok[2]) | (ok[1] & ok[2])
    if op == "add":
        x, y = a
        return inherited & ((x[1] < _INF) | (y[0] > -_INF)) & ((x[0] > -_INF) | (y[1] < _INF))
    if op == "sub":
        x, y = a
        return inherited & ((x[1] < _INF) | (y[1] < _INF)) & ((x[0] > -_INF) | (y[0] > -_INF))
    if op == "mul":
        x, y = a
        return inherited & (_excludes_zero(x) | _bounded(y)) & (_excludes_zero(y) | _bounded(x))
    if op in ("truediv", "floordiv"):
        x, y = a
        return inherited & (_excludes_zero(x) | _excludes_zero(y)) & (_bounded(x) | _bounded(y))
    if op == "mod":
        x, y = a
        return inherited & _excludes_zero(y) & _bounded(x) & _bounded(y)
    if op in ("log", "log2", "sqrt", "rsqrt"):
        return inherited & (a[0][0] >= 0.0)
    return inherited


def classify(node: ir.Node, ranges: dict, args, scan_limit: int = SCAN_LIMIT):
    """For a boolean ``node``: Int32 1 = surely true, 0 = surely false, -1 = undecided."""
    lo, hi = bounds(node, ranges, args, scan_limit)
    return Int32(cutlass.select_(lo >= 1.0, Int32(1), cutlass.select_(hi <= 0.0, Int32(0), Int32(-1))))


def _bound(n: ir.Node, a: list, ok: list, ranges, args, scan_limit: int = SCAN_LIMIT):
    """``(lo, hi)`` of node ``n`` from its operands' bounds ``a`` and "surely not NaN"
    flags ``ok``."""
    op = n.op
    if op == "var":
        lo, hi = ranges[n.attr]
        return _f64(lo), _f64(hi)
    if op == "const":
        v = float(n.attr)
        return _f64(v), _f64(v)
    if op == "scalar":
        v = _f64(args[n.attr])
        return v, v
    if op == "cast":
        return _cast(a[0], ok[0], n.args[0].dtype, n.dtype)
    if op == "where":
        c, x, y = a
        t, f = c[0] >= 1.0, c[1] <= 0.0
        lo = _sel(t, x[0], _sel(f, y[0], _min(x[0], y[0])))
        hi = _sel(t, x[1], _sel(f, y[1], _max(x[1], y[1])))
        return lo, hi
    if op == "add":
        return _safe(a[0][0] + a[1][0], a[0][1] + a[1][1])
    if op == "sub":
        return _safe(a[0][0] - a[1][1], a[0][1] - a[1][0])
    if op == "neg":
        return -a[0][1], -a[0][0]
    if op == "mul":
        return _corners(lambda x, y: x * y, a[0], a[1])
    if op in ("truediv", "floordiv"):
        x, y = a
        lo, hi = _corners(lambda p, q: p / q, x, y)
        if op == "floordiv":
            lo, hi = _floor(lo), _floor(hi)
        ok = _excludes_zero(y)
        return _sel(ok, lo, -_INF), _sel(ok, hi, _INF)
    if op == "mod":
        return _mod(a[0], a[1], is_int=n.dtype == ir.INT)
    if op == "minimum":
        return _min(a[0][0], a[1][0]), _min(a[0][1], a[1][1])
    if op == "maximum":
        return _max(a[0][0], a[1][0]), _max(a[0][1], a[1][1])
    if op == "abs":
        lo, hi = a[0]
        abs_lo = _sel(lo >= 0.0, lo, _sel(hi <= 0.0, -hi, 0.0))
        return abs_lo, _max(_sel(lo < 0.0, -lo, lo), _sel(hi < 0.0, -hi, hi))
    if op in ir.COMPARE:
        return _compare(op, a[0], a[1], ok[0] & ok[1])
    if op == "not":
        if n.dtype == ir.BOOL:
            return 1.0 - a[0][1], 1.0 - a[0][0]
        return _exact_or_unknown(lambda x: ~x, a)
    if op in ir.LOGIC:
        x, y = a
        if n.dtype != ir.BOOL:
            f = {"and": lambda p, q: p & q, "or": lambda p, q: p | q, "xor": lambda p, q: p ^ q}[op]
            return _exact_or_unknown(f, a)
        if op == "and":
            return _min(x[0], y[0]), _min(x[1], y[1])
        if op == "or":
            return _max(x[0], y[0]), _max(x[1], y[1])
        known = (x[0] == x[1]) & (y[0] == y[1])
        d = x[0] - y[0]
        d = _sel(d < 0.0, -d, d)
        return _sel(known, d, 0.0), _sel(known, d, 1.0)
    if op in ir.SHIFT:
        # Monotone in the shifted value for a known count (clamped to [0, 62] here: the
        # element code's counts lie in [0, 31]): x << c = x * 2^c, x >> c = floor(x / 2^c).
        (lo, hi), (c_lo, c_hi) = a
        known = c_lo == c_hi
        count = cutlass.Int64(_min(_max(_sel(known, c_lo, 0.0), 0.0), 62.0))
        factor = _f64(cutlass.Int64(1) << count)
        if op == "shl":
            lo, hi = lo * factor, hi * factor
        else:
            lo, hi = _floor(lo / factor), _floor(hi / factor)
        return _safe(_sel(known, lo, -_INF), _sel(known, hi, _INF))
    # exp, log, tanh, sqrt, ...: monotone, but the element evaluation runs them in float32
    # with approximations; rather than reason about their rounding, say "anything".
    return _unknown()


def _cast(x, not_nan, src: str, dst: str):
    lo, hi = x
    if dst == ir.BOOL:  # nonzero → true (NaN too)
        return _bool_iv((lo > 0.0) | (hi < 0.0), (lo == 0.0) & (hi == 0.0) & not_nan)
    if dst == ir.INT and src == ir.FLOAT:
        # trunc is monotone; floor/ceil bracket it; a NaN converts to an arbitrary integer,
        # and so does an infinity (saturated to the int32 range here, INT64_MIN in numpy)
        hi_finite = (hi < _INF) & (hi > -_INF)
        return (_sel(not_nan & (hi < _INF), _floor(lo), -_INF),
                _sel(not_nan & hi_finite, Float64(cute.math.ceil(hi)), _INF))
    return lo, hi


def _compare(op: str, a, b, not_nan):
    """A comparison with NaN is false (``!=``: true): surely true (``!=``: surely false)
    needs both operands surely not NaN (``not_nan``)."""
    if op in ("gt", "ge"):
        a, b, op = b, a, {"gt": "lt", "ge": "le"}[op]
    if op == "lt":
        return _bool_iv((a[1] < b[0]) & not_nan, a[0] >= b[1])
    if op == "le":
        return _bool_iv((a[1] <= b[0]) & not_nan, a[0] > b[1])
    same_point = (a[0] == a[1]) & (b[0] == b[1]) & (a[0] == b[0])
    disjoint = (a[1] < b[0]) | (b[1] < a[0])
    if op == "eq":
        return _bool_iv(same_point & not_nan, disjoint)
    return _bool_iv(disjoint, same_point & not_nan)


def _mod(a, b, is_int: bool):
    """As ``intervals._mod``: exact when the span stays in one period of a constant divisor."""
    point = b[0] == b[1]
    c = _sel(b[0] == 0.0, 1.0, b[0])
    same_period = point & _excludes_zero(b) & (_floor(a[0] / c) == _floor(a[1] / c))
    m_lo, m_hi = _pymod(a[0], c), _pymod(a[1], c)
    exact_lo, exact_hi = _min(m_lo, m_hi), _max(m_lo, m_hi)
    top = _max(_sel(b[0] < 0.0, -b[0], b[0]), _sel(b[1] < 0.0, -b[1], b[1]))
    if is_int:  # x % 0 evaluates to 0: keep [0, 0], not [1, -1]
        top = _max(top - 1.0, 0.0)
    gen_lo = _sel(b[0] > 0.0, 0.0, -top)
    gen_hi = _sel(b[0] > 0.0, top, _sel(b[1] < 0.0, 0.0, top))
    return _safe(_sel(same_period, exact_lo, gen_lo), _sel(same_period, exact_hi, gen_hi))


def _exact_or_unknown(f, args):
    """Integer bitwise ops: exact on points, unknown otherwise."""
    known = Boolean(True)
    for lo, hi in args:
        known = known & (lo == hi)
    ints = [cutlass.Int64(_sel(known, lo, 0.0)) for lo, _ in args]
    v = _f64(f(*ints))
    return _sel(known, v, -_INF), _sel(known, v, _INF)


def _load(buf, index: list, scan_limit: int = SCAN_LIMIT):
    """``(min, max, surely not NaN)`` of ``buf`` over the index box, by scanning a span
    along at most one dimension (0-d buffers travel as [1]); "anything" for longer or
    wider spans."""
    ndim = max(1, len(index))
    if not index:
        index = [(_f64(0.0), _f64(0.0))]
    los, spans = [], []
    n_span = Int32(0)
    length = Int32(1)
    for d in range(ndim):
        top = _f64(Int32(buf.shape[d]) - 1)
        lo = _min(_max(index[d][0], 0.0), top)  # clipped: reads stay in range (as the host)
        hi = _min(_max(index[d][1], 0.0), top)
        lo_i, hi_i = Int32(lo), Int32(hi)
        los.append(lo_i)
        spans.append(Int32(cutlass.select_(hi_i > lo_i, Int32(1), Int32(0))))
        n_span += spans[-1]
        length = cutlass.max(length, hi_i - lo_i + 1)
    ok = (n_span <= 1) & (length <= scan_limit)
    count = Int32(cutlass.select_(ok, length, Int32(1)))
    vmin, vmax, nan = _scan(buf, tuple(los), tuple(spans), count, ndim, buf.element_type is cutlass.Boolean)
    good = ok & (nan == Int32(0))
    # surely not NaN: an integer buffer, or a float span scanned whole without one
    floats = (cutlass.Float16, cutlass.BFloat16, cutlass.Float32, cutlass.Float64)
    not_nan = good if buf.element_type in floats else Boolean(True)
    return _sel(good, vmin, -_INF), _sel(good, vmax, _INF), not_nan


@cute.jit
def _scan(buf, los, spans, count, ndim: cutlass.Constexpr[int], is_bool: cutlass.Constexpr[bool]):
    """(min, max, saw NaN) of buf[los + t * spans] for t < count."""
    vmin = _f64(_INF)
    vmax = _f64(-_INF)
    nan = Int32(0)
    for t in cutlass.range(count, unroll=1):
        if const_expr(ndim == 1):
            raw = buf[los[0] + t * spans[0]]
        else:
            raw = buf[tuple(los[d] + t * spans[d] for d in range(ndim))]
        if const_expr(is_bool):
            v = _sel(Boolean(raw), 1.0, 0.0)
        else:
            v = _f64(raw)
        nan = nan | Int32(cutlass.select_(_isnan(v), Int32(1), Int32(0)))
        vmin = _min(vmin, v)
        vmax = _max(vmax, v)
    return vmin, vmax, nan
