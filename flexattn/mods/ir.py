"""The mod expression IR: a tiny typed expression language.

Every node is immutable and compares by structure. A node has an ``op`` (what it is),
a compute ``dtype`` (``int32``, ``float32`` or ``bool`` — what a kernel computes in),
``args`` (child nodes) and an ``attr`` payload for leaves:

=========  =====================================================================
op         meaning
=========  =====================================================================
var        an index variable ``b h q kv`` or the score ``score`` (attr: the name)
const      a literal (attr: the Python value)
scalar     a runtime scalar input (attr: its capture slot)
load       read of a captured buffer (attr: ``BufferRef``; args: one index per dim)
cast       conversion to ``dtype``
where      ``where(cond, a, b)``
others     see ``UNARY_FLOAT``, ``UNARY_SAME``, ``BINARY_ARITH``, ``COMPARE``, ``LOGIC``,
           ``SHIFT``
=========  =====================================================================

Captured values (buffers and scalars) appear only by *slot*: the IR of a mod is its
structure (what decides compilation); the values live beside it in the mod.
Node constructors type-check, promote and fold constants, so every interpreter can
trust the types it sees.
"""

from __future__ import annotations

import math
from typing import NamedTuple

INT, FLOAT, BOOL = "int32", "float32", "bool"
INDEX_VARS = ("b", "h", "q", "kv")
SCORE_VAR = "score"

UNARY_FLOAT = ("exp", "exp2", "log", "log2", "tanh", "sigmoid", "sqrt", "rsqrt", "sin", "cos", "erf", "atan")
UNARY_SAME = ("neg", "abs")
BINARY_ARITH = ("add", "sub", "mul", "truediv", "floordiv", "mod", "minimum", "maximum")
COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")
LOGIC = ("and", "or", "xor")  # on bools: logic; on ints: bitwise
# Bit shifts of integers: shr is arithmetic (sign-filling, as torch's >> on signed ints);
# kernels compute in 32 bits, so shift counts must lie in [0, 31].
SHIFT = ("shl", "shr")
ALL_OPS = (
    ("var", "const", "scalar", "load", "cast", "where", "not")
    + UNARY_FLOAT + UNARY_SAME + BINARY_ARITH + COMPARE + LOGIC + SHIFT
)

_SYMBOL = {
    "add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%",
    "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=",
    "and": "&", "or": "|", "xor": "^", "shl": "<<", "shr": ">>",
}


class IRTypeError(TypeError):
    """An operation got operands of types it does not accept."""


class BufferRef(NamedTuple):
    """What the structure of a mod knows about a captured buffer: slot, storage, rank."""

    slot: int
    storage_dtype: str  # e.g. "int64", "bfloat16" — the kernel must load this type
    ndim: int


def compute_dtype(storage_dtype: str) -> str:
    """The IR type that values of a storage dtype are computed in."""
    if storage_dtype == "bool":
        return BOOL
    if "float" in storage_dtype:  # float16/32/64, bfloat16, float8...
        return FLOAT
    if "int" in storage_dtype:  # int8..int64, uint8..
        return INT
    raise IRTypeError(f"unsupported buffer dtype {storage_dtype!r} (use an integer, float or bool array)")


class Node:
    """One IR node. Structural equality and hashing through ``key``."""

    __slots__ = ("op", "dtype", "args", "attr", "key", "_hash", "site")

    def __init__(self, op: str, dtype: str, args: tuple = (), attr=None):
        self.op, self.dtype, self.args, self.attr = op, dtype, tuple(args), attr
        self.key = (op, dtype, _attr_key(attr), tuple(a.key for a in self.args))
        self._hash = None
        # Where the user's code made this node, (file, line, function), for error messages
        # (loads of captured buffers: problem/bounds.py); not part of the structure.
        self.site = None

    def __eq__(self, other):
        return isinstance(other, Node) and self.key == other.key

    def __hash__(self):
        if self._hash is None:
            self._hash = hash(self.key)
        return self._hash

    def __repr__(self):
        return format_node(self)

    # -- structure queries used by the interpreters -------------------------------------
    def walk(self):
        """Every distinct node of the DAG, children before parents."""
        seen, order = set(), []

        def visit(n):
            if id(n) in seen:
                return
            seen.add(id(n))
            for a in n.args:
                visit(a)
            order.append(n)

        visit(self)
        return order

    def free_vars(self) -> frozenset:
        return frozenset(n.attr for n in self.walk() if n.op == "var")

    def slots(self) -> frozenset:
        out = set()
        for n in self.walk():
            if n.op == "scalar":
                out.add(n.attr)
            elif n.op == "load":
                out.add(n.attr.slot)
        return frozenset(out)


def _attr_key(attr):
    if isinstance(attr, float) and math.isnan(attr):
        return ("nan",)
    if isinstance(attr, float):
        return ("float", attr, math.copysign(1.0, attr))  # keep 0.0 and -0.0 apart
    if isinstance(attr, (bool, int)):
        return (type(attr).__name__, attr)  # keep 1, 1.0 and True apart
    return attr


# --- leaves ----------------------------------------------------------------------------

def var(name: str) -> Node:
    if name in INDEX_VARS:
        return Node("var", INT, attr=name)
    if name == SCORE_VAR:
        return Node("var", FLOAT, attr=name)
    raise ValueError(f"unknown variable {name!r}; expected one of {INDEX_VARS + (SCORE_VAR,)}")


def const(value, dtype: str | None = None) -> Node:
    """A literal. Python bool → bool, int → int32, float → float32 unless ``dtype`` says."""
    if isinstance(value, Node):
        return value
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # numpy scalar
        value = value.item()
    if dtype is None:
        if isinstance(value, bool):
            dtype = BOOL
        elif isinstance(value, int):
            dtype = INT
        elif isinstance(value, float):
            dtype = FLOAT
        else:
            raise IRTypeError(f"cannot use {type(value).__name__} {value!r} as a constant")
    return Node("const", dtype, attr=_convert_value(value, dtype))


def scalar(slot: int, dtype: str) -> Node:
    if dtype not in (INT, FLOAT):
        raise IRTypeError(f"runtime scalars are int32 or float32, not {dtype}")
    return Node("scalar", dtype, attr=slot)


def load(buffer: BufferRef, index) -> Node:
    index = tuple(as_node(i) for i in index)
    if len(index) != buffer.ndim:
        raise IRTypeError(
            f"a captured buffer of rank {buffer.ndim} was indexed with {len(index)} indices;"
            " index every dimension"
        )
    for i in index:
        if i.dtype == FLOAT:
            raise IRTypeError("buffer indices must be integers, got a float expression")
    index = tuple(cast(i, INT) for i in index)
    return Node("load", compute_dtype(buffer.storage_dtype), index, attr=buffer)


def as_node(x) -> Node:
    return x if isinstance(x, Node) else const(x)


# --- typing helpers ----------------------------------------------------------------------

def _convert_value(value, dtype):
    if dtype == BOOL:
        return bool(value)
    if dtype == INT:
        return int(value)
    return float(value)


def promote(*dtypes: str) -> str:
    """Result type of arithmetic: any float → float32, else int32 (bools count as ints)."""
    return FLOAT if FLOAT in dtypes else INT


def cast(x, dtype: str) -> Node:
    x = as_node(x)
    if dtype not in (INT, FLOAT, BOOL):
        raise IRTypeError(f"cannot cast to {dtype!r}")
    if x.dtype == dtype:
        return x
    if x.op == "const":
        return const(_cast_python(x.attr, dtype), dtype)
    return Node("cast", dtype, (x,))


def _cast_python(value, dtype):
    if dtype == INT:
        return int(math.trunc(value)) if math.isfinite(value) else 0
    return _convert_value(value, dtype)


# --- operations ----------------------------------------------------------------------------

def unary(op: str, x) -> Node:
    x = as_node(x)
    if op in UNARY_FLOAT:
        if x.dtype == BOOL:
            raise IRTypeError(f"{op} of a boolean")
        x = cast(x, FLOAT)
        dtype = FLOAT
    elif op in UNARY_SAME:
        if x.dtype == BOOL:
            raise IRTypeError(f"{op} of a boolean; use ~ for negation")
        dtype = x.dtype
        if op == "neg" and x.op == "neg":
            return x.args[0]
    elif op == "not":
        dtype = x.dtype
        if dtype == FLOAT:
            raise IRTypeError("~ (not) of a float")
        if x.op == "not":
            return x.args[0]
    else:
        raise ValueError(f"unknown unary op {op!r}")
    node = Node(op, dtype, (x,))
    return _fold(node)


def binary(op: str, a, b) -> Node:
    a, b = as_node(a), as_node(b)
    if op in BINARY_ARITH:
        if BOOL in (a.dtype, b.dtype) and op in ("truediv", "floordiv", "mod"):
            a, b = cast(a, promote(a.dtype)), cast(b, promote(b.dtype))
        dtype = FLOAT if op == "truediv" else promote(a.dtype, b.dtype)
        a, b = cast(a, dtype), cast(b, dtype)
        simple = _simplify_arith(op, a, b)
        if simple is not None:
            return simple
    elif op in COMPARE:
        t = BOOL if a.dtype == b.dtype == BOOL else promote(a.dtype, b.dtype)
        a, b = cast(a, t), cast(b, t)
        dtype = BOOL
    elif op in LOGIC:
        if FLOAT in (a.dtype, b.dtype):
            raise IRTypeError(f"{_SYMBOL[op]} needs booleans or integers, got a float")
        dtype = BOOL if a.dtype == b.dtype == BOOL else INT
        a, b = cast(a, dtype), cast(b, dtype)
        simple = _simplify_logic(op, a, b)
        if simple is not None:
            return simple
    elif op in SHIFT:
        if FLOAT in (a.dtype, b.dtype):
            raise IRTypeError(f"{_SYMBOL[op]} needs integers, got a float")
        dtype = INT
        a, b = cast(a, INT), cast(b, INT)
        if _is_const(b, 0):
            return a
    else:
        raise ValueError(f"unknown binary op {op!r}")
    return _fold(Node(op, dtype, (a, b)))


def where(cond, a, b) -> Node:
    cond, a, b = as_node(cond), as_node(a), as_node(b)
    if cond.dtype == FLOAT:
        raise IRTypeError("where() condition must be boolean (or integer), got a float")
    cond = cast(cond, BOOL)
    dtype = BOOL if a.dtype == b.dtype == BOOL else promote(a.dtype, b.dtype)
    a, b = cast(a, dtype), cast(b, dtype)
    if cond.op == "const":
        return a if cond.attr else b
    if a == b:
        return a
    return Node("where", dtype, (cond, a, b))


def minimum(a, b) -> Node:
    return binary("minimum", a, b)


def maximum(a, b) -> Node:
    return binary("maximum", a, b)


def clamp(x, lo=None, hi=None) -> Node:
    x = as_node(x)
    if lo is not None:
        x = maximum(x, lo)
    if hi is not None:
        x = minimum(x, hi)
    return x


def _is_const(n: Node, value) -> bool:
    return n.op == "const" and n.attr == value and not isinstance(n.attr, bool)


def _simplify_arith(op, a, b):
    if op == "add":
        if _is_const(b, 0):
            return a
        if _is_const(a, 0):
            return b
    elif op == "sub" and _is_const(b, 0):
        return a
    elif op == "mul":
        if _is_const(b, 1):
            return a
        if _is_const(a, 1):
            return b
        if a.dtype == INT and (_is_const(a, 0) or _is_const(b, 0)):  # not for floats: 0*inf
            return const(0)
    elif (op == "truediv" or (op == "floordiv" and a.dtype == INT)) and _is_const(b, 1):
        return a  # not float // 1: that is floor(a)
    return None


def _simplify_logic(op, a, b):
    if a.dtype != BOOL:
        return None
    for x, y in ((a, b), (b, a)):
        if x.op == "const":
            if op == "and":
                return y if x.attr else x
            if op == "or":
                return x if x.attr else y
            if op == "xor":
                return unary("not", y) if x.attr else y
    return None


def _fold(node: Node) -> Node:
    """Constant folding: an op whose args are all constants becomes a constant."""
    if node.args and all(a.op == "const" for a in node.args):
        from .evaluate import eval_constant  # evaluation lives in one place

        return const(eval_constant(node), node.dtype)
    return node


# --- substitution & printing -------------------------------------------------------------

def substitute(node: Node, mapping) -> Node:
    """Rebuild ``node`` replacing leaves: ``mapping(leaf) -> Node | None`` (None keeps it).

    Used to inline mods into each other (vars → expressions) and to renumber slots.
    Rebuilding goes through the constructors, so types and folding stay right.
    """
    memo: dict[int, Node] = {}
    for n in node.walk():
        if not n.args and n.op != "load":
            new = mapping(n)
            memo[id(n)] = n if new is None else new
            continue
        args = tuple(memo[id(a)] for a in n.args)
        if n.op == "load":
            new = mapping(n)  # mapping may rename the buffer slot
            buf = new.attr if new is not None else n.attr
            memo[id(n)] = load(buf, args)
        else:
            memo[id(n)] = rebuild(n, args)
    return memo[id(node)]


def rebuild(n: Node, args: tuple) -> Node:
    """Apply ``n``'s operation to new arguments."""
    if n.op == "cast":
        return cast(args[0], n.dtype)
    if n.op == "where":
        return where(*args)
    if n.op in UNARY_FLOAT or n.op in UNARY_SAME or n.op == "not":
        return unary(n.op, args[0])
    if n.op == "load":
        return load(n.attr, args)
    return binary(n.op, *args)


def format_node(n: Node) -> str:
    """A readable one-line rendering (Python-like)."""
    if n.op == "var":
        return n.attr
    if n.op == "const":
        return repr(n.attr)
    if n.op == "scalar":
        return f"${n.attr}"
    if n.op == "load":
        return f"buf{n.attr.slot}[{', '.join(format_node(a) for a in n.args)}]"
    if n.op == "cast":
        return f"{n.dtype}({format_node(n.args[0])})"
    if n.op in _SYMBOL:
        return f"({format_node(n.args[0])} {_SYMBOL[n.op]} {format_node(n.args[1])})"
    if n.op == "neg":
        return f"-{format_node(n.args[0])}"
    if n.op == "not":
        return f"~{format_node(n.args[0])}"
    return f"{n.op}({', '.join(format_node(a) for a in n.args)})"
