"""Tracing: turn a plain Python function into IR by calling it on proxy values.

The function sees ``Sym`` proxies for ``b, h, q_idx, kv_idx`` (and ``score``). Proxies
implement Python operators, ``__torch_function__`` (so ``torch.where``, ``x.abs()``,
``t[q_idx]`` on a captured tensor trace unchanged), and numpy's ``__array_ufunc__`` /
``__array_function__``. Arrays and numbers the function captures — closure cells,
globals, default arguments — are swapped for proxies before the call, so they become
*runtime inputs* (slots) instead of constants baked into a kernel.

A captured number that the function uses in Python control flow (``if window > 0:``,
``range(n)``) cannot stay symbolic; it is *concretized* — baked in as a constant and thus
part of the structure — much like JAX's static arguments. So is an integer captured number
used as the divisor of ``//`` or ``%`` (``q_idx // width``): a constant divisor becomes a
shift, a mask or a multiply-high in the kernels (``mods/optimize.py``) instead of an
integer division per element (~4x the instructions); a new width compiles a new kernel,
as torch.compile's guards on a closure's int would. A traced index or score in
control flow is an error that names the user's line.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import traceback
import types
from typing import Callable

import numpy as np

from . import ir
from .evaluate import evaluate


class TraceError(TypeError):
    """A mod function used something that cannot be traced; the message names the line."""

    def __init__(self, message: str):
        where = _user_location()
        super().__init__(f"{message}{f' (at {where})' if where else ''}")


# Frames inside the package are ours wherever the error is raised (the block-mask builder,
# the adapters), so the location named is the user's line: the mod's, or the call's.
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARY_MARKERS = (os.sep + "torch" + os.sep, os.sep + "numpy" + os.sep, "<frozen")


def _user_location() -> str | None:
    """file:line: source of the innermost frame that is the user's, not ours or a library's."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = os.path.abspath(frame.filename)
        if path.startswith(_HERE) or any(m in path for m in _LIBRARY_MARKERS):
            continue
        return f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return None


# --- the tracing context ------------------------------------------------------------------

class TraceContext:
    """Captured runtime inputs of one trace: values by slot, and slots baked to constants."""

    def __init__(self):
        self.values: list = []
        self._slot_of: dict[int, int] = {}
        self.baked: set[int] = set()

    def capture(self, value) -> int:
        """Slot of ``value`` (one slot per array object, so the same tensor is read from one
        input). Numbers always get a fresh slot: CPython shares small ints and other equal
        constants between objects, so deduplicating them by identity would make the
        structure depend on the captured *values* (``sliding_window(3, 3)`` vs ``(3, 4)``)."""
        if _is_number(value):
            self.values.append(value)
            return len(self.values) - 1
        key = id(value)
        if key not in self._slot_of:
            self._slot_of[key] = len(self.values)
            self.values.append(value)
        return self._slot_of[key]

    def scalar(self, value) -> "Sym":
        value = value.item() if isinstance(value, np.generic) else value
        dtype = ir.FLOAT if isinstance(value, float) else ir.INT
        return Sym(ir.scalar(self.capture(value), dtype))

    def buffer_ref(self, array) -> ir.BufferRef:
        storage = _dtype_name(array)
        ir.compute_dtype(storage)  # raises on unsupported dtypes
        return ir.BufferRef(self.capture(array), storage, len(array.shape))

    def concretize(self, node: ir.Node):
        """Python value of an expression over captured scalars only; bakes those scalars."""
        leaves = [n for n in node.walk() if not n.args and n.op != "const"]
        if any(n.op != "scalar" for n in leaves):
            return None
        self.baked.update(n.attr for n in leaves)
        return np.asarray(evaluate(node, {}, self.values)).item()


_local = threading.local()


def active_context() -> TraceContext | None:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def trace(fn: Callable, var_names: tuple[str, ...]) -> tuple[ir.Node, tuple]:
    """Call ``fn`` on proxies for ``var_names``; return (expression, captured values).

    Slots are numbered in order of first use; unused captures are dropped and baked
    scalars replaced by their constants.
    """
    ctx = TraceContext()
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(ctx)
    try:
        result = _substitute_captures(fn, ctx)(*(Sym(ir.var(v)) for v in var_names))
        expr = _to_node(result, "the function's return value")
    finally:
        stack.pop()
    if ctx.baked:
        values = ctx.values
        expr = ir.substitute(
            expr,
            lambda n: ir.const(values[n.attr], n.dtype) if n.op == "scalar" and n.attr in ctx.baked else None,
        )
    return canonicalize(expr, ctx.values)


def canonicalize(expr: ir.Node, values) -> tuple[ir.Node, tuple]:
    """Renumber slots by first use in ``expr`` and keep only the values it reads."""
    order: dict[int, int] = {}
    for n in expr.walk():
        slot = n.attr if n.op == "scalar" else n.attr.slot if n.op == "load" else None
        if slot is not None and slot not in order:
            order[slot] = len(order)
    if list(order) == list(range(len(values))):
        return expr, tuple(values)

    def renumber(n):
        if n.op == "scalar":
            return ir.scalar(order[n.attr], n.dtype)
        if n.op == "load":
            return ir.Node("load", n.dtype, n.args, ir.BufferRef(order[n.attr.slot], *n.attr[1:]))
        return None

    new_values = [None] * len(order)
    for old, new in order.items():
        new_values[new] = values[old]
    return ir.substitute(expr, renumber), tuple(new_values)


# --- captured values -------------------------------------------------------------------------

def _dtype_name(array) -> str:
    """'float32', 'int64', 'bfloat16'... for numpy, torch, jax and cupy arrays alike."""
    return str(array.dtype).replace("torch.", "")


def is_array(x) -> bool:
    """Array-like (numpy, torch, jax, cupy...): a tuple shape and a dtype. Modules such as
    ``numpy`` itself have ``shape``/``dtype`` *functions*, hence the tuple check."""
    return (
        isinstance(getattr(x, "shape", None), tuple)
        and hasattr(x, "dtype")
        and not isinstance(x, (Sym, CapturedArray, np.generic))
    )


def _is_number(x) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) or (
        isinstance(x, np.generic) and np.issubdtype(type(x), np.number)
    )


class CapturedArray:
    """Stand-in for an array a mod function captured; indexing it with proxies reads a buffer."""

    __slots__ = ("array", "ctx", "_prefix")

    def __init__(self, array, ctx: TraceContext, prefix: tuple = ()):
        self.array, self.ctx, self._prefix = array, ctx, prefix

    shape = property(lambda self: tuple(self.array.shape)[len(self._prefix):])
    ndim = property(lambda self: len(self.shape))
    dtype = property(lambda self: self.array.dtype)

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, index):
        index = self._prefix + (index if isinstance(index, tuple) else (index,))
        nodes = tuple(_index_node(i, d, self.array.shape) for d, i in enumerate(index))
        if len(nodes) < len(self.array.shape):
            return CapturedArray(self.array, self.ctx, nodes)
        if len(nodes) > len(self.array.shape):
            raise TraceError(f"too many indices ({len(nodes)}) for a captured array of rank {len(self.array.shape)}")
        try:
            node = ir.load(self.ctx.buffer_ref(self.array), nodes)
        except ir.IRTypeError as e:  # float index, unsupported dtype: name the user's line
            raise TraceError(str(e)) from None
        node.site = _user_site()
        return Sym(node)

    def _as_sym(self) -> "Sym":
        if self.shape != ():
            raise TraceError(
                f"a captured array of shape {tuple(self.array.shape)} was used in arithmetic;"
                " index it with the mod's variables first, e.g. bias[h, q_idx]"
            )
        return self[()] if not self._prefix else Sym(ir.load(self.ctx.buffer_ref(self.array), self._prefix))

    def __repr__(self):
        return f"CapturedArray(shape={tuple(self.array.shape)}, dtype={self.dtype})"


# The tracing machinery's files: a node's site is the first frame outside them.
_MACHINERY = None


def _user_site():
    """(file, line, function) of the code that indexed a captured array: the innermost
    frame outside the tracing modules (the mod function, a helper of it, a built-in)."""
    global _MACHINERY
    if _MACHINERY is None:
        here = os.path.dirname(os.path.abspath(__file__))
        _MACHINERY = {os.path.join(here, f) for f in ("trace.py", "vectors.py", "ops.py")}
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in _MACHINERY:
        frame = frame.f_back
    if frame is None:
        return None
    return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name


def _index_node(i, dim: int, shape) -> ir.Node:
    if isinstance(i, ir.Node):
        return i
    if isinstance(i, Sym):
        return i.node
    if isinstance(i, CapturedArray):
        return i._as_sym().node
    if isinstance(i, (int, np.integer)) and not isinstance(i, bool):
        i = int(i)
        return ir.const(i + int(shape[dim]) if i < 0 else i)  # negative: from the end
    if is_array(i) and len(i.shape) == 0:
        return ir.load(active_context().buffer_ref(i), ())
    raise TraceError(f"unsupported index {i!r} into a captured array: only integers and traced indices")


def _substitute_captures(fn: Callable, ctx: TraceContext) -> Callable:
    """Copy of ``fn`` whose captured arrays and numbers are proxies (see module doc)."""
    if not inspect.isfunction(fn):
        return fn

    def wrap(v):
        if is_array(v):
            return CapturedArray(v, ctx)
        if _is_number(v):
            return ctx.scalar(v)
        return namespaces.substitute(v)   # jax.numpy, jax.nn, jax.lax and their functions

    closure = None
    if fn.__closure__:
        cells = []
        for cell in fn.__closure__:
            try:
                cells.append(types.CellType(wrap(cell.cell_contents)))
            except ValueError:  # empty cell (variable not bound yet)
                cells.append(cell)
        closure = tuple(cells)
    glb = fn.__globals__
    wrapped = {n: wrap(glb[n]) for n in fn.__code__.co_names if n in glb}
    replaced = {n: w for n, w in wrapped.items() if w is not glb[n]}
    if replaced:
        glb = dict(glb)
        glb.update(replaced)
    defaults = tuple(wrap(d) for d in fn.__defaults__) if fn.__defaults__ else None
    new = types.FunctionType(fn.__code__, glb, fn.__name__, defaults, closure)
    if fn.__kwdefaults__:
        new.__kwdefaults__ = {k: wrap(v) for k, v in fn.__kwdefaults__.items()}
    return new


# --- the proxy ----------------------------------------------------------------------------------

def _to_node(x, what: str = "an operand") -> ir.Node:
    if isinstance(x, Sym):
        return x.node
    if isinstance(x, CapturedArray):
        return x._as_sym().node
    if isinstance(x, (bool, int, float, np.bool_, np.number)):
        return ir.const(x.item() if isinstance(x, np.generic) else x)
    if is_array(x):
        if len(x.shape) == 0:  # e.g. torch.tensor(2.0) made inside the function
            ctx = active_context()
            return ir.load(ctx.buffer_ref(x), ())
        raise TraceError(
            f"an array of shape {tuple(x.shape)} appeared as {what}; mods compute one element"
            " at a time — index captured arrays with the mod's variables"
        )
    if isinstance(x, SymArray):     # a captured array indexed in fewer dims than it has
        raise TraceError(
            f"a vector of shape {x.shape} appeared as {what}; mods compute one element at a time — a"
            " captured array: index it in every dim with the mod's variables (e.g. bias[h, q_idx]), or"
            " reduce the vector (sum, dot, @)")
    raise TraceError(f"cannot use {type(x).__name__} {x!r} as {what} in a mod")


def _sym(node: ir.Node) -> "Sym":
    return Sym(node)


def _wrap_ir(fn):
    """Adapt an ir constructor to proxies: operands in, Sym out, IR errors as TraceErrors."""

    def apply(*args):
        if any(is_vector(a) for a in args):   # a vector read: element by element (mods/vectors.py)
            return elementwise(apply, args)
        try:
            return Sym(fn(*(_to_node(a) for a in args)))
        except ir.IRTypeError as e:
            raise TraceError(str(e)) from None

    return apply


def _binary(op):
    if op in ("floordiv", "mod"):
        return _wrap_ir(lambda a, b: ir.binary(op, a, _static_divisor(b)))
    return _wrap_ir(lambda a, b: ir.binary(op, a, b))


def _static_divisor(b: ir.Node) -> ir.Node:
    """An integer divisor made of captured numbers only is baked (see the module doc): the
    kernels then divide by a constant (shifts, masks, multiply-high) instead of running an
    integer division per element."""
    if b.dtype != ir.INT or b.op == "const":
        return b
    ctx = active_context()
    value = ctx.concretize(b) if ctx is not None else None
    return b if value is None else ir.const(int(value))


def _rbinary(op):
    f = _binary(op)
    return lambda a, b: f(b, a)


def _unary(op):
    return _wrap_ir(lambda x: ir.unary(op, x))


def _cast_to(dtype_like):
    name = str(dtype_like).replace("torch.", "")
    if "bool" in name:  # torch.bool, bool, np.bool_
        target = ir.BOOL
    elif "float" in name or name in ("half", "double"):
        target = ir.FLOAT
    elif "int" in name or name == "long":
        target = ir.INT
    else:
        raise TraceError(f"cannot cast a traced value to {dtype_like!r}")
    return lambda x: _wrap_ir(lambda n: ir.cast(n, target))(x)


def _clamp(x, min=None, max=None):
    lo = None if min is None else _to_node(min)
    hi = None if max is None else _to_node(max)
    return _wrap_ir(lambda n: ir.clamp(n, lo, hi))(x)


def _floor(x):
    return _wrap_ir(lambda n: ir.binary("floordiv", ir.cast(n, ir.FLOAT), 1.0))(x)


def _sign(x):
    return _wrap_ir(lambda n: ir.where(ir.binary("gt", n, 0), 1, ir.where(ir.binary("lt", n, 0), -1, 0)))(x)


def _where(cond, a, b):
    return _wrap_ir(ir.where)(cond, a, b)


def _logical(op):
    """logical_and/or/xor: truth values of the operands, not their bits (1 and 2 is True)."""
    return _wrap_ir(lambda a, b: ir.binary(op, ir.cast(a, ir.BOOL), ir.cast(b, ir.BOOL)))


def _logical_not(x):
    return _wrap_ir(lambda n: ir.unary("not", ir.cast(n, ir.BOOL)))(x)


def _min_max(op):
    """torch.max / min: of two operands the elementwise one; of a vector read (a captured
    tensor indexed along its leading dims) its largest / smallest element."""
    def f(a, b=None, *rest, **kw):
        if "axis" in kw or "keepdims" in kw:     # numpy's max(x, axis=...): values only
            return _numpy_min_max(op)(a, b, *rest, **kw)
        if (isinstance(b, int) and not isinstance(b, bool)) or "dim" in kw:
            raise TraceError(f"torch.{op}(x, dim) in a mod also returns argmax indices, which are not traced;"
                             f" use torch.a{op}(x, dim)")
        kw.pop("keepdim", None)
        if b is None and not rest and not kw:
            if is_vector(a):
                return (vector_amax if op == "max" else vector_amin)(a)
            return a     # the max of one value (torch.max of a 0-d tensor) is itself
        if b is None or rest or kw:
            raise TraceError(f"{op}(...) of a traced value with these arguments is not supported in a mod;"
                             f" {op}imum(a, b) is the elementwise one")
        return _binary(op + "imum")(a, b)

    return f


def _numpy_min_max(op):
    """numpy's / jax.numpy's max and min: the reduction, ``axis`` positional or keyword."""
    def f(a, axis=None, *rest, **kw):
        return (vector_amax if op == "max" else vector_amin)(a, axis, *rest, **kw) if is_vector(a) else a
    return f


def _new_tensor(x, data, dtype=None, **_):
    """``x.new_tensor(value)``: a constant (a scalar: mods compute one element)."""
    if isinstance(data, (list, tuple)) or (is_array(data) and len(np.shape(data)) > 0):
        raise TraceError("new_tensor of a sequence in a mod: a mod computes one element; use a scalar")
    return _new_full(x, (), np.asarray(data).item() if is_array(data) else data, dtype=dtype)


def _full_like(x, fill_value, **_):
    return Sym(ir.cast(ir.const(fill_value), _to_node(x).dtype))


def _like(value):
    return lambda x, **_: _full_like(x, value)


def _new_full(x, size, fill_value, dtype=None, **_):
    """``x.new_full(size, value)``, ``new_ones``/``new_zeros``: a constant of ``dtype`` (x's
    type by default). Mods compute one element at a time, so only a scalar size: torch's
    ``and_masks``/``or_masks``/``noop_mask`` start from ``b.new_ones((), dtype=torch.bool)``."""
    shape = tuple(size) if isinstance(size, (tuple, list)) else (size,)
    if any(int(n) != 1 for n in shape):
        raise TraceError(f"new_full/new_ones/new_zeros of size {tuple(shape)} in a mod: a mod computes one"
                         " element; use a scalar size ()")
    if dtype is not None:
        return _cast_to(dtype)(Sym(ir.const(fill_value)))
    return _full_like(x, fill_value)


def _new_constant(value):
    def new(x, *size, dtype=None, **kwargs):
        if "size" in kwargs:
            size = (kwargs.pop("size"),)
        shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
        return _new_full(x, tuple(shape), value, dtype=dtype)
    return new


def _is_dtype_like(a) -> bool:
    """torch/numpy dtypes, Python types and dtype names — not devices (``x.to("cuda")``)."""
    if isinstance(a, str):
        return any(k in a for k in ("float", "int", "bool", "half", "double", "long", "complex"))
    return isinstance(a, (type, np.dtype)) or type(a).__name__ == "dtype"


def _to(x, *args, **kwargs):
    dtype = kwargs.get("dtype")
    for a in args:
        if _is_dtype_like(a):
            dtype = a
    return x if dtype is None else _cast_to(dtype)(x)


# Name → implementation, shared by torch functions, Tensor methods and numpy ufuncs.
OPERATIONS: dict[str, Callable] = {
    **{n: _binary("add") for n in ("add", "__add__")},
    "__radd__": _rbinary("add"),
    **{n: _binary("sub") for n in ("sub", "subtract", "__sub__")},
    **{n: _rbinary("sub") for n in ("__rsub__", "rsub")},
    **{n: _binary("mul") for n in ("mul", "multiply", "__mul__")},
    "__rmul__": _rbinary("mul"),
    **{n: _binary("truediv") for n in ("true_divide", "__truediv__")},
    "__rtruediv__": _rbinary("truediv"),
    **{n: _binary("floordiv") for n in ("floor_divide", "__floordiv__")},
    "__rfloordiv__": _rbinary("floordiv"),
    **{n: _binary("mod") for n in ("remainder", "mod", "__mod__")},
    "__rmod__": _rbinary("mod"),
    **{n: _binary("minimum") for n in ("minimum", "fmin")},
    **{n: _binary("maximum") for n in ("maximum", "fmax")},
    "min": _min_max("min"), "max": _min_max("max"),
    **{n: _binary(op) for op in ir.COMPARE for n in (op, f"__{op}__")},
    "less": _binary("lt"), "less_equal": _binary("le"), "greater": _binary("gt"),
    "greater_equal": _binary("ge"), "equal": _binary("eq"), "not_equal": _binary("ne"),
    **{n: _binary(op) for op in ir.LOGIC for n in (f"__{op}__", f"bitwise_{op}")},
    **{f"logical_{op}": _logical(op) for op in ir.LOGIC},
    **{f"__r{op}__": _rbinary(op) for op in ir.LOGIC},
    **{n: _unary("not") for n in ("__invert__", "bitwise_not", "invert")},
    # Bit shifts (Morton orders, packed ids): torch's and numpy's names and operators.
    **{n: _binary("shl") for n in ("__lshift__", "bitwise_left_shift", "left_shift")},
    **{n: _binary("shr") for n in ("__rshift__", "bitwise_right_shift", "right_shift")},
    "__rlshift__": _rbinary("shl"), "__rrshift__": _rbinary("shr"),
    "logical_not": _logical_not,
    **{n: _unary("neg") for n in ("neg", "negative", "__neg__")},
    "__pos__": lambda x: x, "positive": lambda x: x,
    **{n: _unary("abs") for n in ("abs", "absolute", "__abs__")},
    **{op: _unary(op) for op in ir.UNARY_FLOAT},
    "expit": _unary("sigmoid"),
    "floor": _floor, "ceil": lambda x: -_floor(-x), "sign": _sign,
    "where": _where,
    "clamp": _clamp, "clip": _clamp,
    "float": _cast_to("float32"), "double": _cast_to("float32"), "half": _cast_to("float32"),
    "bfloat16": _cast_to("float32"), "int": _cast_to("int32"), "long": _cast_to("int32"),
    "bool": _cast_to("bool"), "to": _to, "type": lambda x, dtype: _cast_to(dtype)(x),
    "astype": lambda x, dtype, **_: _cast_to(dtype)(x),
    "full_like": _full_like, "zeros_like": _like(0), "ones_like": _like(1),
    "new_full": _new_full, "new_ones": _new_constant(1), "new_zeros": _new_constant(0),
    "new_tensor": _new_tensor,
    # (added at the end: functions written with these ops, mods/torch_functions.py;
    # reductions of vector reads, mods/vectors.py)
}


# torch functions whose __name__ is not the name users call them by
_TORCH_NAMES = {"_threshold": "threshold"}


def _is_tensor_method(func) -> bool:
    owner = getattr(func, "__objclass__", None)
    return owner is not None and "Tensor" in owner.__name__


def _to_proxy(x):
    """Captured torch tensors seen in an operation are wrapped so they read as buffers."""
    if is_array(x) and active_context() is not None:
        return CapturedArray(x, active_context())
    if isinstance(x, (list, tuple)):
        return type(x)(_to_proxy(i) for i in x)
    return x


class Sym:
    """A traced value: wraps an IR node and records every operation applied to it."""

    __slots__ = ("node",)
    __array_priority__ = 1000  # numpy defers binary operators to us
    __hash__ = object.__hash__

    def __init__(self, node: ir.Node):
        self.node = node

    dtype = property(lambda self: self.node.dtype)
    shape = ()
    ndim = 0

    def __repr__(self):
        return f"Sym({ir.format_node(self.node)}: {self.node.dtype})"

    # control flow on traced values --------------------------------------------------------
    def _concrete(self, what: str):
        ctx = active_context()
        value = ctx.concretize(self.node) if ctx is not None else None
        if value is None:
            raise TraceError(
                f"{what} of a traced value ({ir.format_node(self.node)}) — Python control flow"
                " cannot depend on indices or scores; use where(cond, a, b) / torch.where"
            )
        return value

    def __bool__(self):
        return bool(self._concrete("bool()"))

    def __index__(self):
        value = self._concrete("int()")
        if not float(value).is_integer():
            raise TraceError(f"used the float {value} as an index")
        return int(value)

    __int__ = __index__

    def __float__(self):
        return float(self._concrete("float()"))

    def __getitem__(self, _):
        raise TraceError("indexing a traced scalar; only captured arrays can be indexed")

    def __iter__(self):
        raise TraceError("iterating over a traced scalar")

    # framework protocols -----------------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", str(func))
        if name == "__getitem__" and not isinstance(args[0], Sym):
            return _to_proxy(args[0])[args[1]]
        if name == "where" and _is_tensor_method(func):  # x.where(cond, y)
            args = (args[1], args[0], *args[2:])
        if name == "__get__" or name == "dtype":  # attribute access such as x.dtype
            return func(*args, **kwargs)
        op = OPERATIONS.get(_TORCH_NAMES.get(name, name))
        if op is None and name.startswith("special_"):   # torch.special.expit is special_expit
            op = OPERATIONS.get(name[len("special_"):])
        if op is None and name.endswith("_") and not name.startswith("_") and name[:-1] in OPERATIONS and args:
            return _in_place(args[0], name, args[1:], kwargs)   # torch.relu_(x), F.relu_(x)
        if op is None:
            raise TraceError(f"torch.{name} is not supported in a mod")
        kwargs.pop("out", None)
        if name == "where" and "condition" in kwargs:  # torch.where(condition, input, other)
            args = (kwargs.pop("condition"), *args)
        if name == "where" and "input" in kwargs:
            args = (args[0], kwargs.pop("input"), *args[1:])
        if "input" in kwargs:
            args = (kwargs.pop("input"), *args)
        if "other" in kwargs:
            args = (*args, kwargs.pop("other"))
        return _call(op, name, _to_proxy(tuple(args)), kwargs)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method != "__call__" or kwargs.get("out") is not None:
            raise TraceError(f"numpy.{ufunc.__name__}.{method} is not supported in a mod")
        op = OPERATIONS.get(ufunc.__name__)
        if op is None:
            raise TraceError(f"numpy.{ufunc.__name__} is not supported in a mod")
        return _call(op, ufunc.__name__, inputs, {})

    def __array_function__(self, func, types_, args, kwargs):
        op = OPERATIONS.get(NUMPY_NAMES.get(func.__name__, func.__name__))
        if op is None:
            raise TraceError(f"numpy.{func.__name__} is not supported in a mod")
        if func.__name__ == "clip":  # np.clip(x, a_min, a_max)
            args = (args[0], *args[1:])
            kwargs = {"min": kwargs.pop("a_min", kwargs.pop("min", args[1] if len(args) > 1 else None)),
                      "max": kwargs.pop("a_max", kwargs.pop("max", args[2] if len(args) > 2 else None))}
            args = args[:1]
        return _call(op, func.__name__, args, kwargs)


def _call(op, name, args, kwargs):
    try:
        return op(*args, **kwargs)
    except TypeError as e:
        if isinstance(e, TraceError):
            raise
        raise TraceError(f"{name}() got arguments it does not support in a mod: {e}") from None


# Python operators and tensor-style methods on the proxies (looked up in OPERATIONS when
# called; torch_functions' method names are added at the end).
_PROXY_METHODS = (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__",
    "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__", "__and__", "__rand__",
    "__or__", "__ror__", "__xor__", "__rxor__", "__invert__", "__neg__", "__pos__", "__abs__",
    "__lshift__", "__rlshift__", "__rshift__", "__rrshift__", "bitwise_left_shift", "bitwise_right_shift",
    "abs", "exp", "exp2", "log", "log2", "tanh", "sigmoid", "sqrt", "rsqrt", "sin", "cos", "neg",
    "clamp", "clip", "float", "double", "half", "bfloat16", "int", "long", "bool", "to",
    "type", "astype", "floor", "ceil", "sign", "square", "minimum", "maximum", "pow",
    "logical_not", "logical_and", "logical_or", "logical_xor", "remainder", "div",
    "new_full", "new_ones", "new_zeros", "new_tensor",
    "sum", "mean", "dot", "inner", "matmul", "__matmul__", "__rmatmul__",
    "max", "min", "amax", "amin", "prod", "logsumexp", "norm", "var", "std",
)


def _proxy_method(name):
    return lambda self, *a, **k: OPERATIONS[name](self, *a, **k)


def _in_place(self, name, args, kwargs):
    """``x.add_(y)`` and friends: the traced value is rebound to the result (in x's dtype,
    as the in-place op keeps it), which is what the rest of the function sees."""
    if not isinstance(self, Sym):
        raise TraceError(f"{name}() on a captured array in a mod: in-place changes to captured data are not traced")
    if name == "fill_":
        result = _full_like(self, *args, **kwargs)
    else:
        result = _call(OPERATIONS[name[:-1]], name, (self, *_to_proxy(tuple(args))), kwargs)
    self.node = ir.cast(_to_node(result), self.node.dtype)
    return self


def _in_place_method(name):
    return lambda self, *a, **k: _in_place(self, name, a, k)


Sym.where = lambda self, cond, other: _where(cond, self, other)  # torch: x.where(cond, y)
Sym.device = None   # ``device=b.device`` in torch's mask helpers: constants have no device

# Functions written with the IR's ops (mods/torch_functions.py: erf, atan, gelu, pow, ...)
# and vector reads (a captured tensor indexed along its leading dims only), unrolled element
# by element and reduced by sum / dot / @ (mods/vectors.py). Both read this module's names.
from .vectors import (SymArray, dot as _dot, elementwise, is_vector, numpy_std, numpy_var, vector_amax,  # noqa: E402
                      vector_amin, vector_linalg_norm, vector_logsumexp, vector_mean, vector_norm, vector_prod,
                      vector_std, vector_sum, vector_var)
from .torch_functions import FUNCTIONS, INPLACE_METHODS, TENSOR_METHODS  # noqa: E402
from . import namespaces  # noqa: E402

OPERATIONS.update(FUNCTIONS)
OPERATIONS.update({"sum": vector_sum, "mean": vector_mean, "dot": _dot, "inner": _dot, "vdot": _dot,
                   "matmul": _dot, "__matmul__": _dot, "__rmatmul__": lambda a, b: _dot(b, a),
                   "amax": vector_amax, "amin": vector_amin, "prod": vector_prod, "logsumexp": vector_logsumexp,
                   "norm": vector_norm, "linalg_vector_norm": vector_linalg_norm, "var": vector_var,
                   "std": vector_std, "numpy_var": numpy_var, "numpy_std": numpy_std,
                   "numpy_max": _numpy_min_max("max"), "numpy_min": _numpy_min_max("min")})
# numpy functions whose meaning differs from torch's of the same name: var / std with ddof 0
# (torch's correction is 1), max / min with a positional axis (torch's dim also returns indices)
NUMPY_NAMES = {"var": "numpy_var", "std": "numpy_std", "max": "numpy_max", "min": "numpy_min"}
_PROXY_METHODS += TENSOR_METHODS + ("__rpow__", "__round__")
for _name in _PROXY_METHODS:
    setattr(Sym, _name, _proxy_method(_name))
    if not _name.startswith("new_"):   # a vector read takes the same operators and methods
        setattr(CapturedArray, _name, _proxy_method(_name))
    if _name.startswith("__"):   # SymArray's operators (its other methods: SymArray.__getattr__)
        setattr(SymArray, _name, _proxy_method(_name))
for _name in INPLACE_METHODS:
    setattr(Sym, _name, _in_place_method(_name))
    setattr(CapturedArray, _name, _in_place_method(_name))
CapturedArray.__torch_function__ = SymArray.__torch_function__
CapturedArray.__array_function__ = SymArray.__array_function__
