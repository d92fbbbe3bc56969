"""IR → CuTeDSL: emit a mod's expression inline, one element at a time.

``IRModHook`` implements the kernels' ``ModHook`` interface for any traced mask / score
mod: while a kernel is being traced it is called with CuTeDSL scalars (``b h q kv`` Int32,
``score`` Float32) and returns the emitted value. Captured buffers and scalars arrive in
the kernel's runtime ``args`` tuple (score-mod captures first, then mask-mod captures), so
new values never recompile; only ``key()`` (the mods' structure keys) does.

Semantics follow ``mods.evaluate`` (the numpy oracle): Python floor division and modulo,
float→int casts truncate, ``sigmoid`` / ``rsqrt`` as written there. Integer maths is
int32 in the kernel (the oracle uses int64; indices never come near 2³¹). The hook emits
its mods' expressions after ``mods.optimize`` (division by a constant as a multiply by
its reciprocal: within 1 ulp of the quotient) and lowers integer ``//``/``%`` by constants
to shifts, masks and truncating division where that is exact.
"""

from __future__ import annotations

import copy
import functools
import math
import operator
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32

from flexattn.bounded import keep_bounded
from flexattn.mods import MaskMod, ScoreMod, ir
from flexattn.mods.optimize import divisor_shift, nonnegative, optimize, positive_constant
from flexattn.kernels.emit.affine_index import (AffineIndex, IndexForm, casts_index_affinely, emit_affine, plain,
                                                 plain_value)
from flexattn.kernels.emit.mod_hook import ModHook

_TYPE = {ir.INT: Int32, ir.FLOAT: Float32, ir.BOOL: Boolean}

# Storage dtype of a captured buffer → CuTeDSL element type.
STORAGE_TYPES = {
    "int8": cutlass.Int8, "int16": cutlass.Int16, "int32": cutlass.Int32, "int64": cutlass.Int64,
    "uint8": cutlass.Uint8, "float16": cutlass.Float16, "bfloat16": cutlass.BFloat16,
    "float32": cutlass.Float32, "float64": cutlass.Float64, "bool": cutlass.Boolean,
}


def _typed(value, dtype: str):
    """A DSL value of IR type ``dtype`` from a DSL value, an MLIR value or a Python literal."""
    t = _TYPE[dtype]
    if dtype == ir.BOOL and not isinstance(value, (bool, int, float)) and not isinstance(value, Boolean):
        if isinstance(value, cutlass.Numeric) and not isinstance(value, Boolean):
            return value != type(value)(0)
    return t(value)


def _select(cond, a, b, dtype):
    return _typed(cutlass.select_(cond, _typed(a, dtype), _typed(b, dtype)), dtype)


def _floordiv(a, b, dtype):
    """Python's floor division. On the H100, DSL ``//`` on Int32 truncated towards zero
    ((-1)//4 gave 0), so the quotient is corrected whenever the remainder's sign differs
    from the divisor's; a floor ``//`` needs no correction, so this is right either way.
    Floats lower to floor(a / b) already."""
    t = a // b
    if dtype != ir.INT:
        return t
    r = a - t * b
    off = (r != Int32(0)) & ((r < Int32(0)) != (b < Int32(0)))
    return _select(off, t - Int32(1), t, dtype)


def _mod(a, b, dtype):
    return a - _floordiv(a, b, dtype) * b  # Python's modulo takes the divisor's sign


def _constant_divmod(n: ir.Node, a: list, vector: bool):
    """Integer ``//`` or ``%`` of node ``n`` by a positive constant, lowered (see
    mods/optimize.py): a power of two by a shift or a mask (floor semantics for every
    sign), other constants by truncating division when the dividend is not negative.
    None where the general (sign-corrected) form is needed."""
    divisor = n.args[1]
    if n.dtype != ir.INT or not positive_constant(divisor):
        return None
    binary = _vbinary if vector else (lambda f, x, y: f(x, y))
    k = divisor_shift(divisor)
    if k is not None:
        if n.op == "floordiv":
            if _is_vec(a[0]):   # TensorSSA has no >> operator; its apply_op lowers one
                return a[0].apply_op(operator.rshift, Int32(k))
            return a[0] >> Int32(k)
        return binary(operator.and_, a[0], Int32(divisor.attr - 1))
    if not nonnegative(n.args[0]):
        return None
    quotient = binary(operator.floordiv, a[0], Int32(divisor.attr))
    if n.op == "floordiv":
        return quotient
    return binary(operator.sub, a[0], binary(operator.mul, quotient, Int32(divisor.attr)))


# erf by Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7): branch-free, one approximate
# reciprocal, five FMAs and an exponential, where libdevice's erff costs registers the
# backward (value and derivative in one step) does not have
_ERF_P = 0.3275911
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def _erf_fast(x):
    """(scalars and the row emission's vectors alike: cute.math throughout)"""
    ax = cute.math.absf(x)
    t = cute.math.rcp(Float32(1.0) + Float32(_ERF_P) * ax, approx=True, ftz=True)
    poly = Float32(_ERF_A[-1]) * t + Float32(_ERF_A[-2])
    for a in reversed(_ERF_A[:-2]):
        poly = poly * t + Float32(a)
    y = Float32(1.0) - poly * t * cute.math.exp(-(ax * ax), fastmath=True)
    return cute.math.copysign(y, x)


_UNARY_MATH = {
    "exp": lambda x, fast: cute.math.exp(x),
    "exp2": lambda x, fast: cute.math.exp2(x),
    "log": lambda x, fast: cute.math.log(x),
    "log2": lambda x, fast: cute.math.log2(x),
    # fast: tanh.approx.f32 (max rel. error ~2^-11, below bf16's half ulp), as FA4's softcap
    "tanh": lambda x, fast: cute.math.tanh(x, fastmath=fast),
    "sqrt": lambda x, fast: cute.math.sqrt(x),
    "rsqrt": lambda x, fast: cute.math.rsqrt(x),
    # sin / cos: the accurate forms (range reduction), not sin.approx's absolute ~2^-20.9 near 0 only
    "sin": lambda x, fast: cute.math.sin(x),
    "cos": lambda x, fast: cute.math.cos(x),
    # erf: fast, Abramowitz & Stegun (above); else libdevice's erff. atan: libdevice's atanf
    "erf": lambda x, fast: _erf_fast(x) if fast else cute.math.erf(x),
    "atan": lambda x, fast: cute.math.atan(x),
    "sigmoid": lambda x, fast: Float32(0.5) * (Float32(1.0) + cute.math.tanh(Float32(0.5) * x, fastmath=fast)),
}

_COMPARE = {
    "lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b, "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
}


def emit(node: ir.Node, env: dict, args, fast_math: bool = False, known: dict | None = None) -> object:
    """Emit ``node`` with variable values ``env`` and captured inputs ``args`` (by slot).
    ``fast_math`` uses the hardware's approximate tanh (for tanh and sigmoid). ``known``:
    values already emitted for some subexpressions ({id(node): value}, e.g. hoisted out of
    a loop by ``row_invariant_roots``); their subtrees are not emitted again."""
    known = known or {}
    values: dict[int, object] = {}
    for n in _walk_pruned(node, known):
        values[id(n)] = known[id(n)] if id(n) in known else \
            _emit_node_affine(n, [values[id(a)] for a in n.args], env, args, fast_math, _emit_node)
    return _typed(plain_value(values[id(node)]), node.dtype)


def _emit_node_affine(n: ir.Node, a: list, env: dict, args, fast_math: bool, emit_node):
    """``emit_node(n, a, ...)``, keeping an ``AffineIndex`` variable (a kernel's ``kv``)
    in its form where that pays (``affine_index``); elsewhere it is the plain integer."""
    if n.op == "var" and isinstance(env.get(n.attr), AffineIndex):
        return env[n.attr]
    if any(isinstance(x, IndexForm) for x in a):
        value = emit_affine(n, a, lambda: emit_node(n, plain(a), env, args, fast_math))
        if value is not None:
            return value
        a = plain(a)
    return emit_node(n, a, env, args, fast_math)


def _walk_pruned(root: ir.Node, known: dict) -> list:
    """``root.walk()`` without the subtrees of the ``known`` nodes (which stay in it)."""
    if not known:
        return root.walk()
    seen, order = set(), []

    def visit(n):
        if id(n) in seen:
            return
        seen.add(id(n))
        if id(n) not in known:
            for a in n.args:
                visit(a)
        order.append(n)

    visit(root)
    return order


def row_invariant_roots(expr: ir.Node) -> list:
    """The largest subexpressions of ``expr`` that read a buffer but neither kv nor the
    score (ALiBi's ``slopes[h]``, ``q + q_offset[b]`` of a mod shifted to true positions):
    constant along a query row, so a kernel can emit them once per row before its kv loop
    (``IRModHook.row_invariants``). Buffer-free ones are left to the compiler."""
    varying = _varying_nodes(expr)
    invariant = {id(n) for n in expr.walk() if id(n) not in varying}
    return _largest_reads(expr, invariant, invariant)


def _largest_reads(expr: ir.Node, invariant: set, wanted: set) -> list:
    """The largest subexpressions of ``expr`` among the ``invariant`` ones (ids) that read
    a buffer and are ``wanted`` (ids), in walk order, each once: ``expr`` itself if it is
    one, else the invariant arguments of the nodes that are not."""
    reads = set()
    for n in expr.walk():
        if n.op == "load" or any(id(a) in reads for a in n.args):
            reads.add(id(n))
    candidates = [expr] if id(expr) in invariant else \
        [a for n in expr.walk() if id(n) not in invariant for a in n.args]
    roots, seen = [], set()
    for n in candidates:
        if id(n) in wanted and id(n) in invariant and id(n) in reads and id(n) not in seen:
            seen.add(id(n))
            roots.append(n)
    return roots


class TileValues(NamedTuple):
    """``IRModHook.tile_invariants``' values: the score's and the mask's roots (None: not
    emitted), at tiles of ``tile_n`` keys."""

    tile_n: int
    score: tuple | None
    mask: tuple | None


def tile_invariant_roots(expr: ir.Node, tile_n: int) -> list:
    """The largest subexpressions of ``expr`` that read a buffer, depend on kv, and read kv
    only as ``kv // P`` with ``P`` a multiple of ``tile_n`` (and not the score): constant
    over an aligned tile of ``tile_n`` keys, so a kernel can emit them once per tile at
    the tile's first key instead of once per key (``IRModHook.tile_invariants``): a walk's
    table and the page map behind a torch ``PagedAttention`` mask (``table[b, kv // 128]``,
    ``page_map[b, table[b, kv // 128]]``: two dependent loads per key otherwise)."""
    constant = set()     # ids of nodes constant over a tile (kv-free ones included)
    keyed = set()        # ... of those, the ones that read kv (through kv // P)
    for n in expr.walk():
        if n.op == "var":
            if n.attr not in _VARYING:
                constant.add(id(n))
        elif (n.op == "floordiv" and n.args[0].op == "var" and n.args[0].attr == "kv"
              and n.args[1].op == "const" and n.args[1].dtype == ir.INT
              and n.args[1].attr > 0 and n.args[1].attr % tile_n == 0):
            constant.add(id(n))
            keyed.add(id(n))
        elif all(id(a) in constant for a in n.args):
            constant.add(id(n))
            if any(id(a) in keyed for a in n.args):
                keyed.add(id(n))
    return _largest_reads(expr, constant, keyed)


def emit_many(nodes, env: dict, args, fast_math: bool = False, known: dict | None = None) -> list:
    """Emit several expressions with one memo, so subexpressions they share (a derivative
    reuses its forward's nodes, e.g. ``tanh`` in softcap's) are emitted once. ``known``:
    as ``emit``'s."""
    values: dict[int, object] = dict(known or {})
    for root in nodes:
        for n in _walk_pruned(root, values):
            if id(n) not in values:
                values[id(n)] = _emit_node_affine(n, [values[id(a)] for a in n.args], env, args, fast_math,
                                                  _emit_node)
    return [_typed(plain_value(values[id(r)]), r.dtype) for r in nodes]


def _emit_node(n: ir.Node, a: list, env: dict, args, fast_math: bool):
    op, dt = n.op, n.dtype
    if op == "var":
        return _typed(env[n.attr], dt)
    if op == "const":
        v = n.attr
        if dt == ir.FLOAT and math.isinf(v):
            return Float32.inf if v > 0 else -Float32.inf
        return _typed(v, dt)
    if op == "scalar":
        return _typed(args[n.attr], dt)
    if op == "load":
        buf = args[n.attr.slot]
        index = tuple(_typed(i, ir.INT) for i in a) or (Int32(0),)  # 0-d buffers travel as [1]
        value = buf[index if len(index) > 1 else index[0]]
        if dt == ir.BOOL:
            return _typed(value, ir.BOOL)
        return _TYPE[dt](value)
    if op == "cast":
        src = n.args[0].dtype
        x = a[0]
        if dt == ir.BOOL:
            return x != _TYPE[src](0)
        return _TYPE[dt](x)  # float→int: fptosi truncates towards zero, like the oracle
    if op == "where":
        return _select(a[0], a[1], a[2], dt)
    if op == "add":
        return a[0] + a[1]
    if op == "sub":
        return a[0] - a[1]
    if op == "mul":
        return a[0] * a[1]
    if op == "truediv":
        return a[0] / a[1]
    if op in ("floordiv", "mod"):
        lowered = _constant_divmod(n, a, vector=False)
        if lowered is not None:
            return lowered
        return _floordiv(a[0], a[1], dt) if op == "floordiv" else _mod(a[0], a[1], dt)
    if op in ("minimum", "maximum"):
        pick_first = a[0] < a[1] if op == "minimum" else a[0] > a[1]
        if dt == ir.FLOAT:   # NaN propagates (torch.minimum, numpy, the reference)
            pick_first = pick_first | (a[0] != a[0])
        return _select(pick_first, a[0], a[1], dt)
    if op == "neg":
        return -a[0]
    if op == "abs":
        return _select(a[0] < _TYPE[dt](0), -a[0], a[0], dt)
    if op in _UNARY_MATH:
        return _UNARY_MATH[op](a[0], fast_math)
    if op in _COMPARE:
        return _COMPARE[op](a[0], a[1])
    if op == "not":
        return (a[0] == Boolean(False)) if dt == ir.BOOL else ~a[0]
    if op == "and":
        return a[0] & a[1]
    if op == "or":
        return a[0] | a[1]
    if op == "xor":
        return a[0] ^ a[1]
    if op == "shl":
        return a[0] << a[1]
    if op == "shr":   # signed Int32: arithmetic
        return a[0] >> a[1]
    raise NotImplementedError(f"CuTeDSL emission of IR op {op!r}")


# ---- rows: one expression for all the elements of a fragment row --------------------
# ``emit_row`` emits an IR expression once per row instead of once per element: the
# variables that differ along the row (``kv``, ``score``) are TensorSSA vectors, the others
# (``b``, ``h``, ``q``, captured scalars, constants) scalars, and an operation on a vector
# is one vector op (MLIR unrolls it to the same per-element instructions when it lowers to
# LLVM). Tracing then costs about a row's worth of per-element tracing, and the MLIR
# passes before LLVM see as many fewer ops. Buffer reads at a varying index stay per
# element (a gather), put back together as a vector.

def _is_vec(x) -> bool:
    return isinstance(x, cute.TensorSSA)


def _vtyped(value, dtype: str):
    """``_typed`` for scalars and vectors."""
    if not _is_vec(value):
        return _typed(value, dtype)
    t = _TYPE[dtype]
    if value.dtype is t:
        return value
    if dtype == ir.BOOL:
        return value != value.dtype(0)
    return value.to(t)


def _vbinary(op, x, y):
    """``op(x, y)`` where either may be a vector (a scalar operand is broadcast)."""
    if _is_vec(y) and not _is_vec(x):
        return y.apply_op(op, x, flip=True)
    return op(x, y)


def _vselect(cond, a, b, dtype):
    if not (_is_vec(cond) or _is_vec(a) or _is_vec(b)):
        return _select(cond, a, b, dtype)
    a, b = _vtyped(a, dtype), _vtyped(b, dtype)
    shape = next(v.shape for v in (cond, a, b) if _is_vec(v))
    if not _is_vec(cond):
        cond = cute.full(shape, _typed(cond, ir.BOOL), Boolean)
    if not _is_vec(a):
        a = cute.full(shape, a, _TYPE[dtype])
    if not _is_vec(b):
        b = cute.full(shape, b, _TYPE[dtype])
    return cute.where(cond, a, b)


def _vfloordiv(a, b, dtype):
    if not (_is_vec(a) or _is_vec(b)):
        return _floordiv(a, b, dtype)
    t = _vbinary(operator.floordiv, a, b)
    if dtype != ir.INT:
        return t
    r = _vbinary(operator.sub, a, _vbinary(operator.mul, t, b))
    zero = Int32(0)
    off = _vbinary(operator.and_, _vbinary(operator.ne, r, zero),
                   _vbinary(operator.ne, _vbinary(operator.lt, r, zero), _vbinary(operator.lt, b, zero)))
    return _vselect(off, _vbinary(operator.sub, t, Int32(1)), t, dtype)


_VBINARY = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
    "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
    "eq": operator.eq, "ne": operator.ne, "and": operator.and_, "or": operator.or_,
    "xor": operator.xor,
}
_SHIFTS = {"shl": operator.lshift, "shr": operator.rshift}


def _vshift(op, a, b):
    """A shift where either operand may be a vector: element by element (the DSL's vector
    types have no shift; each element is one shl / shr.s32 either way)."""
    f = _SHIFTS[op]
    if not (_is_vec(a) or _is_vec(b)):
        return f(a, b)
    shape = next(v.shape for v in (a, b) if _is_vec(v))
    n = cute.size(shape)
    xs = [Int32(a[i]) for i in range(n)] if _is_vec(a) else [a] * n
    ys = [Int32(b[i]) for i in range(n)] if _is_vec(b) else [b] * n
    return _from_elements([f(x, y) for x, y in zip(xs, ys)], Int32, shape)


def _gather(n: ir.Node, row_env: dict, element_env, args, fast_math: bool):
    """Load node ``n`` (an index varies along the row), element by element: each
    element's index expressions emitted for that element (as per-element emission
    does, so index arithmetic and reads interleave the same way), then its read; the
    values put back together as a vector of the row's shape."""
    buf = args[n.attr.slot]
    shape = row_env["shape"]
    values = []
    for i in range(cute.size(shape)):
        env = element_env(i)
        memo: dict[int, object] = {}
        index = []
        for root in n.args:
            for m in root.walk():
                if id(m) not in memo:
                    memo[id(m)] = _emit_node(m, [memo[id(x)] for x in m.args], env, args, fast_math)
            index.append(_typed(memo[id(root)], ir.INT))
        index = tuple(index) or (Int32(0),)
        values.append(_emit_load_value(buf[index if len(index) > 1 else index[0]], n.dtype))
    return _from_elements(values, _TYPE[n.dtype], shape)


def _from_elements(values, t, shape):
    """A vector of row shape ``shape`` from its elements (in flat index order)."""
    from cutlass._mlir import ir as mlir_ir
    from cutlass._mlir.dialects import vector

    ty = mlir_ir.VectorType.get([len(values)], t.mlir_type)
    return cute.TensorSSA(vector.from_elements(ty, [t(v).ir_value() for v in values]), shape, t)


def _emit_load_value(value, dtype):
    if dtype == ir.BOOL:
        return _typed(value, ir.BOOL)
    return _TYPE[dtype](value)


_VARYING = frozenset(("kv", "score"))
_BOOLEAN_LOGIC = frozenset(("and", "or", "xor", "not"))


# Buffer reads that vary along a row (gathers at kv) up to which row emission pays: each is
# a whole row of loaded values live at once. A vector read reduced per element (a dot of
# embedding rows, mods/vectors.py) has one per trailing index: 8 of them spilled 1.6 KB in
# the forward (CPU compile, 2026-11-26), where per-element code uses each load at once.
MAX_ROW_GATHERS = 2


def row_friendly(expr: ir.Node) -> bool:
    """Whether ``emit_row`` gives ``expr`` the code per-element emission gives it. Not
    where boolean logic combines varying values: LLVM turns a vector select on an ``and``
    of two compares into two selects per element (a sliding window: +64 FSEL per tile
    and thread), where per-element code keeps one select on a predicate ``or``; nor with
    more than ``MAX_ROW_GATHERS`` varying buffer reads."""
    varying = _varying_nodes(expr)
    nodes = list(expr.walk())
    if sum(1 for n in nodes if n.op == "load" and id(n) in varying) > MAX_ROW_GATHERS:
        return False
    return not any(n.op in _BOOLEAN_LOGIC and id(n) in varying for n in nodes)


def emit_row(node: ir.Node, env: dict, element_env, args, fast_math: bool = False,
             known: dict | None = None) -> object:
    """``emit`` with vector variables in ``env`` (see above; ``env["shape"]`` is the
    row's shape): a scalar where the expression does not vary along the row, else a
    vector of that shape. ``element_env(i)``: the scalar variables of element i, for
    buffer reads at varying indices. ``known``: as ``emit``'s (scalars constant along
    the row: a tile's ``tile_invariants``)."""
    known = known or {}
    varying = _varying_nodes(node)
    # Nodes needed as values: not the index expressions of varying reads (per element),
    # nor what a known value stands for.
    needed, stack = set(), [node]
    while stack:
        n = stack.pop()
        if id(n) in needed:
            continue
        needed.add(id(n))
        if id(n) not in known and not (n.op == "load" and id(n) in varying):
            stack.extend(n.args)
    values: dict[int, object] = {}
    for n in node.walk():
        if id(n) not in needed:
            continue
        if id(n) in known:
            values[id(n)] = known[id(n)]
        elif n.op == "load" and id(n) in varying:
            values[id(n)] = _gather(n, env, element_env, args, fast_math)
        else:
            values[id(n)] = _emit_node_affine(n, [values[id(a)] for a in n.args], env, args, fast_math,
                                              _emit_row_node)
    return _vtyped(plain_value(values[id(node)]), node.dtype)


class ElementCost(NamedTuple):
    """What a mod costs per score element, from its optimized IR: the operations that
    depend on kv or the score (variables and constants not counted), of those the buffer
    reads (gathers: a load per element, and a row of loaded values live at once when a
    row is emitted together), the integer ``//`` and ``%`` by other than a power of two
    (divisions: a multiply-high or a sign-corrected division sequence each, where powers
    of two are a shift or a mask, ``_constant_divmod``), and their kinds (``op`` names)."""

    ops: int
    gathers: int
    divisions: int
    kinds: frozenset


_ELEMENT_COSTS: dict = {}   # id(mod.expr) -> (that expr, its ElementCost): planners ask per call


def element_cost(mod) -> ElementCost:
    """``ElementCost`` of ``mod`` (a score or mask mod), after ``mods.optimize``: softcap
    3 ops, ALiBi 4, both 7, a relative-bias table read 4 with one gather. Cached by the
    IR object (shared by every ``with_captures`` copy of a mod): a hit is a dict lookup."""
    hit = _ELEMENT_COSTS.get(id(mod.expr))
    if hit is not None and hit[0] is mod.expr:
        return hit[1]
    cost = _element_cost(optimize(mod.expr))
    keep_bounded(_ELEMENT_COSTS, id(mod.expr), (mod.expr, cost), 1024)
    return cost


def _element_cost(expr: ir.Node) -> ElementCost:
    varying = _varying_nodes(expr)
    ops = [n for n in expr.walk() if id(n) in varying and n.op not in ("var", "const")]
    divisions = sum(1 for n in ops if n.op in ("floordiv", "mod") and n.dtype == ir.INT
                    and divisor_shift(n.args[1]) is None)
    return ElementCost(len(ops), sum(1 for n in ops if n.op == "load"), divisions, frozenset(n.op for n in ops))


def _varying_nodes(expr: ir.Node) -> set:
    """ids of the nodes of ``expr`` that depend on kv or the score."""
    varying = set()
    for n in expr.walk():
        if (n.op == "var" and n.attr in _VARYING) or any(id(a) in varying for a in n.args):
            varying.add(id(n))
    return varying


def _emit_row_node(n: ir.Node, a: list, env: dict, args, fast_math: bool):
    if not any(_is_vec(x) for x in a) and not (n.op == "var" and _is_vec(env[n.attr])):
        return _emit_node(n, a, env, args, fast_math)      # nothing varies here: scalar
    op, dt = n.op, n.dtype
    if op == "var":
        return _vtyped(env[n.attr], dt)
    if op == "cast":
        if dt == ir.BOOL:
            return _vbinary(operator.ne, a[0], _TYPE[n.args[0].dtype](0))
        return _vtyped(a[0], dt)
    if op == "where":
        return _vselect(a[0], a[1], a[2], dt)
    if op in _VBINARY:
        return _vbinary(_VBINARY[op], a[0], a[1])
    if op in _SHIFTS:
        return _vshift(op, _vtyped(a[0], ir.INT), _vtyped(a[1], ir.INT))
    if op in ("floordiv", "mod"):
        lowered = _constant_divmod(n, a, vector=True)
        if lowered is not None:
            return lowered
    if op == "floordiv":
        return _vfloordiv(a[0], a[1], dt)
    if op == "mod":
        return _vbinary(operator.sub, a[0], _vbinary(operator.mul, _vfloordiv(a[0], a[1], dt), a[1]))
    if op in ("minimum", "maximum"):
        pick_first = _vbinary(operator.lt if op == "minimum" else operator.gt, a[0], a[1])
        if dt == ir.FLOAT:   # NaN propagates, as in the scalar path
            pick_first = _vbinary(operator.or_, pick_first, _vbinary(operator.ne, a[0], a[0]))
        return _vselect(pick_first, a[0], a[1], dt)
    if op == "neg":
        return -a[0]
    if op == "abs":
        return _vselect(_vbinary(operator.lt, a[0], _TYPE[dt](0)), -a[0], a[0], dt)
    if op in _UNARY_MATH:
        return _UNARY_MATH[op](a[0], fast_math)
    if op == "not":   # (a vector's ~ gives no TensorSSA back: xor with all ones, as ~ emits)
        return _vbinary(operator.eq, a[0], Boolean(False)) if dt == ir.BOOL else _vbinary(operator.xor, a[0], Int32(-1))
    raise NotImplementedError(f"CuTeDSL row emission of IR op {op!r}")


class _ElementEnv:
    """``element_env`` for ``emit_row``: element i's variables, the varying ones (given
    as functions of i) emitted only when an index expression reads them."""

    def __init__(self, kv=None, score=None, **scalars):
        self.scalars, self.varying = scalars, {"kv": kv, "score": score}

    def __call__(self, i):
        env = self

        class _Env(dict):
            def __missing__(self, name):
                value = self[name] = env.varying[name](i)
                return value
        return _Env(env.scalars)


def _optimized(mod):
    """``mod`` with its expression through ``mods.optimize`` (the same mod if unchanged)."""
    if mod is None:
        return None
    expr = optimize(mod.expr)
    return mod if expr is mod.expr else type(mod)(expr, mod.captures, mod.name)


class IRModHook(ModHook):
    """A ``ModHook`` emitting traced mods; ``args`` = score captures + mask captures.

    ``fast_math`` (default) emits tanh/sigmoid with the approximate hardware tanh, as
    FlashAttention-4 does for softcap; ``False`` gives the precise libdevice version.
    """

    def __init__(self, score: ScoreMod | None = None, mask: MaskMod | None = None, fast_math: bool = True,
                 scaled_indices: bool = False):
        self.fast_math = fast_math
        self.scaled_indices = scaled_indices   # (ModHook.scaled_indices: FloatAffine products)
        # The IR objects as given: planners key their caches by these objects' ids and rely
        # on the cached configs' hooks to keep them alive (the optimized ones may be others).
        self._sources = tuple(m.expr for m in (score, mask) if m is not None)
        self._score = _optimized(score)
        self._mask = _optimized(mask)
        self.has_score = score is not None
        self.has_mask = mask is not None
        self._n_score_args = len(score.captures) if score is not None else 0
        self.capture_kinds = None  # set by planners that cache them (see capture_kinds)
        # Holds the derivative once computed; planners share one box between the hooks of
        # one IR (differentiating costs ~0.1-0.3 ms per backward call otherwise).
        self.derivative_box = []
        # Capture slots whose gradients are wanted (None: every float buffer the score
        # reads). Part of the key: a filtered-out buffer costs the backward nothing.
        self.grad_filter = None

    def key(self):
        return (
            "ir",
            self.fast_math,
            self._score.structure_key if self._score is not None else None,
            self._mask.structure_key if self._mask is not None else None,
        ) + (() if self.grad_filter is None else (("grads", self.grad_filter),)) \
            + ((("scaled_indices",),) if self.scaled_indices else ())

    def with_grad_filter(self, slots) -> "IRModHook":
        """This hook, differentiating only the float buffers at capture ``slots`` (e.g. the
        captured tensors that require grad): fixed ALiBi slopes or bias tables then cost
        the backward no scatter at all."""
        new = copy.copy(self)
        new.grad_filter = tuple(sorted(int(s) for s in slots))
        return new

    def index_vars(self, score: bool, mask: bool) -> frozenset:
        found = frozenset()
        for use, mod in ((score, self._score), (mask, self._mask)):
            if use and mod is not None:
                found |= mod.expr.free_vars()
        return found & frozenset(("b", "h", "q", "kv"))

    def affine_index(self, var: str, score: bool, mask: bool) -> bool:
        return any(casts_index_affinely(mod.expr, var) for use, mod in ((score, self._score), (mask, self._mask))
                   if use and mod is not None)

    def load_index_vars(self, score: bool, mask: bool) -> frozenset:
        found = set()
        for use, mod in ((score, self._score), (mask, self._mask)):
            if use and mod is not None:
                for n in mod.expr.walk():
                    if n.op == "load":
                        for index in n.args:
                            found |= index.free_vars()
        return frozenset(found) & frozenset(("b", "h", "q", "kv"))

    def captures(self) -> tuple:
        """The runtime values in ``args`` order."""
        s = self._score.captures if self._score is not None else ()
        m = self._mask.captures if self._mask is not None else ()
        return tuple(s) + tuple(m)

    @property
    def mask_expr(self):
        """The traced mask's IR (kernels run interval analysis on it), or None."""
        return self._mask.expr if self._mask is not None else None

    def mask_args(self, args) -> tuple:
        """The mask's captures out of this hook's ``args``."""
        return tuple(args[self._n_score_args:]) if args else ()

    def score(self, s, b, h, q, kv, args, row=None, tile=None):
        env = {"score": s, "b": b, "h": h, "q": q, "kv": kv}
        return emit(self._score.expr, env, args[: self._n_score_args] if args else (), self.fast_math,
                    self._known(row, 0, tile))

    def mask(self, b, h, q, kv, args, row=None, tile=None):
        env = {"b": b, "h": h, "q": q, "kv": kv}
        return emit(self._mask.expr, env, args[self._n_score_args:] if args else (), self.fast_math,
                    self._known(row, 1, tile))

    @functools.cached_property
    def _invariant_roots(self) -> tuple:
        """(score's, mask's) ``row_invariant_roots``, found once (the nodes stay alive with
        the mods, so their ids stay valid)."""
        return tuple(row_invariant_roots(mod.expr) if mod is not None else [] for mod in (self._score, self._mask))

    def row_invariants(self, b, h, q, args):
        score_roots, mask_roots = self._invariant_roots
        if not score_roots and not mask_roots:
            return None
        env = {"b": b, "h": h, "q": q}
        args = args or ()
        return (tuple(emit_many(score_roots, env, args[: self._n_score_args], self.fast_math)),
                tuple(emit_many(mask_roots, env, args[self._n_score_args:], self.fast_math)))

    def tile_invariants(self, b, h, q, kv_start, tile_n: int, args, row=None, score=True, mask=True):
        roots = self._tile_roots(tile_n)
        score, mask = score and bool(roots[0]), mask and bool(roots[1])
        if not score and not mask:
            return None
        env = {"b": b, "h": h, "q": q, "kv": kv_start}
        args = args or ()
        score_args, mask_args = args[: self._n_score_args], args[self._n_score_args:]
        return TileValues(tile_n,
                          tuple(emit_many(roots[0], env, score_args, self.fast_math, self._known(row, 0))) if score else None,
                          tuple(emit_many(roots[1], env, mask_args, self.fast_math, self._known(row, 1))) if mask else None)

    def tile_invariant_count(self, tile_n: int) -> int:
        return sum(len(roots) for roots in self._tile_roots(tile_n))

    def _tile_roots(self, tile_n: int) -> tuple:
        """(score's, mask's) ``tile_invariant_roots`` for tiles of ``tile_n`` keys, found
        once per tile size (the nodes stay alive with the mods)."""
        cache = self.__dict__.setdefault("_tile_roots_by_n", {})
        if tile_n not in cache:
            cache[tile_n] = tuple(tile_invariant_roots(mod.expr, tile_n) if mod is not None else []
                                  for mod in (self._score, self._mask))
        return cache[tile_n]

    def _known(self, row, which: int, tile=None):
        known = {}
        if row is not None:
            known.update((id(n), v) for n, v in zip(self._invariant_roots[which], row[which]))
        if tile is not None and tile[1 + which] is not None:
            known.update((id(n), v) for n, v in zip(self._tile_roots(tile.tile_n)[which], tile[1 + which]))
        return known or None

    def rows(self, score: bool, mask: bool) -> bool:
        return all(row_friendly(mod.expr) for use, mod in ((score, self._score), (mask, self._mask))
                   if use and mod is not None)

    def score_row(self, s, b, h, q, kv, args, kv_at=None, tile=None):
        """``score`` for a row: ``s`` and ``kv`` vectors; ``kv_at(i)`` element i's kv (for
        buffer reads at kv); ``tile``: this row's ``tile_invariants``."""
        env = {"score": s, "b": b, "h": h, "q": q, "kv": kv, "shape": s.shape}
        element = _ElementEnv(b=b, h=h, q=q, kv=kv_at, score=lambda i: Float32(s[i]))
        out = emit_row(self._score.expr, env, element, args[: self._n_score_args] if args else (),
                       self.fast_math, self._known(None, 0, tile))
        return out if _is_vec(out) else cute.full(s.shape, out, Float32)   # s not read

    def mask_row(self, b, h, q, kv, args, kv_at=None, shape=None, tile=None):
        """``mask`` for a row of shape ``shape``: ``kv`` a vector (see ``score_row``)."""
        env = {"b": b, "h": h, "q": q, "kv": kv, "shape": shape}
        element = _ElementEnv(b=b, h=h, q=q, kv=kv_at)
        return emit_row(self._mask.expr, env, element, args[self._n_score_args:] if args else (),
                        self.fast_math, self._known(None, 1, tile))

    # ---- backward: the score mod's symbolic derivative (mods.derivative) ---------------
    @property
    def derivative(self):
        """``differentiate(score.expr)``, computed once (its nodes must stay alive: the
        emitter memoizes by node identity)."""
        if self._score is None:
            return None
        if not self.derivative_box:
            from flexattn.mods.derivative import differentiate

            self.derivative_box.append(differentiate(self._score.expr))
        return self.derivative_box[0]

    @property
    def constant_score_grad(self) -> float | None:
        """ds'/ds when it is one finite constant (additive mods: ALiBi, biases, relative
        positions: 1.0), else None. The backward then needs no per-element derivative and no
        guard for masked elements (0 * a finite constant is 0)."""
        d = self.derivative
        if d is None or d.d_score.op != "const":
            return None
        value = float(d.d_score.attr)
        return value if math.isfinite(value) else None

    @property
    def grad_slots(self) -> tuple:
        """Score-capture slots (= positions in ``args``) of float buffers that get grads."""
        d = self.derivative
        if d is None:
            return ()
        slots = {load.attr.slot for load, _ in d.d_loads}
        if self.grad_filter is not None:
            slots &= set(self.grad_filter)
        return tuple(sorted(slots))

    def score_and_grad(self, s, b, h, q, kv, args):
        if self._score is None:
            return s, Float32(1.0)
        env = {"score": s, "b": b, "h": h, "q": q, "kv": kv}
        out, grad = emit_many([self._score.expr, self.derivative.d_score], env,
                              args[: self._n_score_args] if args else (), self.fast_math)
        return out, grad

    @property
    def grad_read_count(self) -> int:
        """Differentiated buffer reads in the mod (``buffer_grads`` returns one entry each)."""
        d = self.derivative
        wanted = set(self.grad_slots)
        return sum(1 for load, _ in d.d_loads if load.attr.slot in wanted) if d else 0

    @property
    def grad_reads_diagonal(self) -> bool:
        """Whether every differentiated buffer read's index depends on (q, kv) only through
        ``q - kv`` (and not on the score): then all elements of a tile on one diagonal add
        into the same element (relative-position tables), and a kernel may sum them before
        its atomic. A structural test on the IR (``q - kv`` subtrees)."""
        d = self.derivative
        wanted = set(self.grad_slots)
        loads = [load for load, _ in d.d_loads if load.attr.slot in wanted] if d else []
        if not loads:
            return False

        def diagonal(n) -> bool:
            if n.op == "sub" and all(a.op == "var" for a in n.args) and \
                    tuple(a.attr for a in n.args) == ("q", "kv"):
                return True
            if n.op == "var":
                return n.attr not in ("q", "kv", "score")
            return all(diagonal(a) for a in n.args)

        return all(diagonal(a) for load in loads for a in load.args)

    @property
    def grad_reads_uniform(self) -> bool:
        """Whether no differentiated buffer read's index depends on q, kv or the score
        (per-head slopes, scalars): every element of a tile adds into one element."""
        d = self.derivative
        wanted = set(self.grad_slots)
        loads = [load for load, _ in d.d_loads if load.attr.slot in wanted] if d else []
        return bool(loads) and all(n.op != "var" or n.attr not in ("q", "kv", "score")
                                   for load in loads for a in load.args for n in a.walk())

    def buffer_grads(self, s, b, h, q, kv, args):
        d = self.derivative
        wanted = set(self.grad_slots)
        d_loads = [(load, partial) for load, partial in d.d_loads if load.attr.slot in wanted] if d else []
        if not d_loads:
            return []
        env = {"score": s, "b": b, "h": h, "q": q, "kv": kv}
        roots = []
        for load, partial in d_loads:
            roots.extend(load.args)
            roots.append(partial)
        values = emit_many(roots, env, args[: self._n_score_args] if args else (), self.fast_math)
        out, i = [], 0
        for load, _ in d_loads:
            n = len(load.args)
            index = tuple(values[i:i + n]) or (Int32(0),)   # 0-d buffers travel as [1]
            out.append((load.attr.slot, index, values[i + n]))
            i += n + 1
        return out


def capture_kinds(hook: IRModHook) -> tuple:
    """Per runtime arg: ('scalar', 'int32'|'float32') or ('buffer', storage dtype, ndim).
    A planner may have stored them on the hook (``hook.capture_kinds``): walking the IR
    costs ~20 µs per call."""
    cached = getattr(hook, "capture_kinds", None)
    if cached is not None:
        return cached
    kinds = []
    for mod in (hook._score, hook._mask):
        if mod is None:
            continue
        found = {}
        for n in mod.expr.walk():
            if n.op == "scalar":
                found[n.attr] = ("scalar", n.dtype)
            elif n.op == "load":
                found[n.attr.slot] = ("buffer", n.attr.storage_dtype, max(1, n.attr.ndim))
        kinds.extend(found[i] for i in range(len(mod.captures)))
    return tuple(kinds)


def fake_args(hook: IRModHook) -> tuple:
    """Typed stand-ins for the runtime args, for compiling without values or a GPU.

    Layouts match ``buffer_arg`` exactly (dynamic shape and outer strides, innermost
    stride 1): a compiled kernel reads its arguments in the layout it was traced with.
    """
    from cutlass.cute.runtime import make_fake_tensor

    out = []
    for kind in capture_kinds(hook):
        if kind[0] == "scalar":
            out.append(Int32(0) if kind[1] == ir.INT else Float32(0.0))
            continue
        _, storage, ndim = kind
        shape = tuple(cute.sym_int() for _ in range(ndim))
        stride = tuple(cute.sym_int64() for _ in range(ndim - 1)) + (1,)
        out.append(make_fake_tensor(STORAGE_TYPES[storage], shape, stride))
    return tuple(out)


def buffer_arg(array):
    """A captured buffer (any DLPack array, innermost dim contiguous) as a kernel arg with
    dynamic shape and outer strides: one compiled kernel serves every size."""
    from cutlass.cute.runtime import from_dlpack

    t = from_dlpack(array)
    if len(t.shape) > 1 and t.stride[-1] != 1:
        raise ValueError(f"captured buffer of shape {tuple(t.shape)}: its last dimension must be contiguous")
    return t.mark_layout_dynamic(leading_dim=len(t.shape) - 1)


def runtime_args(hook: IRModHook, to_device) -> tuple:
    """Kernel args from the captured values, in ``args`` order. ``to_device(value)`` returns
    a contiguous DLPack array on the kernel's device (the adapter's job); 0-d buffers are
    passed as [1]."""
    out = []
    for kind, value in zip(capture_kinds(hook), hook.captures()):
        if kind[0] == "scalar":
            out.append(Int32(int(value)) if kind[1] == ir.INT else Float32(float(value)))
            continue
        arr = to_device(value)
        if len(arr.shape) == 0:
            arr = arr.reshape(1)
        out.append(buffer_arg(arr))
    return tuple(out)
