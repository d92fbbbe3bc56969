"""Array-library modules as a traced mod sees them: ``jnp.where``, ``jax.nn.gelu``, ``cupy.tanh``.

torch and numpy functions reach the tracer by protocol (``__torch_function__``,
``__array_ufunc__`` / ``__array_function__``). ``jax.numpy``, ``jax.nn``, ``jax.lax``,
``jax.scipy.special`` and ``cupy`` have no hook for foreign objects: their functions reject a proxy. So while a function is traced,
the globals and closure cells holding one of these modules (or one of their functions,
``from jax.numpy import where``) are swapped, as captured arrays are, for a namespace that
answers with the tracer's implementations under JAX's names and semantics:

- ``jax.numpy`` and ``cupy`` follow numpy's names (``where``, ``exp``, ``arctan2``, ``clip``,
  ...), so they resolve through the tracer's own table; ``select`` chains ``where``s.
- ``jax.nn`` keeps JAX's defaults where they differ from torch's: ``gelu`` is the tanh
  form unless ``approximate=False``; ``softplus`` is ``logaddexp(x, 0)``.
- ``jax.lax`` keeps lax's: ``div`` / ``rem`` truncate (C-style), ``round`` rounds half away
  from zero unless ``rounding_method`` says to even, ``clamp(min, x, max)``.

Anything else a traced value reaches is a ``TraceError`` naming the function, never JAX's
own error about abstract arrays. Constants (``jnp.pi``, ``jnp.inf``, dtypes) pass through.

``torch`` is swapped too, though its functions dispatch by protocol: a ``dtype=`` naming a
traced value's dtype (``torch.tensor(c, dtype=score.dtype)``) becomes torch's, and a 0-d
tensor its constructors make from constants is a literal of the expression.
"""

from __future__ import annotations

import sys
import types

from . import torch_functions as tf
from . import trace as _t


def _traced(x) -> bool:
    if isinstance(x, (tuple, list)):
        return any(_traced(i) for i in x)
    return isinstance(x, _t.Sym) or _t.is_vector(x) or isinstance(x, _t.CapturedArray)


def _refusing(label: str, fn):
    """A library function: called on traced values, a clear error; on constants, itself."""

    def call(*args, **kwargs):
        if _traced(args) or _traced(tuple(kwargs.values())):
            raise _t.TraceError(f"{label} is not supported in a mod")
        return fn(*args, **kwargs)

    return call


def _op(name):
    # (looked up per call: tables are built while trace.py is still importing; numpy-named
    # libraries keep numpy's defaults, trace.NUMPY_NAMES)
    return lambda *args, **kwargs: _t._call(_t.OPERATIONS[_t.NUMPY_NAMES.get(name, name)], name, args, kwargs)


class TracedNamespace:
    """A module seen through ``table`` (name -> implementation on proxies)."""

    def __init__(self, module: types.ModuleType, label: str, table: dict, numpy_names: bool, refuse: bool = True):
        self._module, self._label, self._table, self._numpy_names = module, label, table, numpy_names
        self._refuse = refuse   # torch's functions dispatch by protocol: they pass through (_torch_function)

    def __getattr__(self, name):
        if name in self._table:
            return self._table[name]
        if self._numpy_names and name in _t.OPERATIONS:
            return _op(name)
        value = getattr(self._module, name)
        if isinstance(value, types.ModuleType):
            return substitute(value)
        if self._numpy_names and _is_scalar_type(value):   # jnp.float32(x): a cast
            return _ScalarType(value)
        if self._refuse and callable(value) and not isinstance(value, type):
            return _refusing(f"{self._label}.{name}", value)
        if not self._refuse and callable(value) and not isinstance(value, type):
            return _torch_function(name, value)
        return value

    def __repr__(self):
        return f"<{self._label} as traced mods see it>"


# torch's constructors of a value: a 0-d result made inside a mod is a literal
_CONSTRUCTORS = ("tensor", "as_tensor", "asarray", "scalar_tensor", "full", "zeros", "ones")


def _torch_function(name: str, fn):
    """A torch function as a traced mod sees it. ``dtype=`` may name a traced value's dtype
    ("float32": ``torch.tensor(-1e4, dtype=score.dtype)``): torch's dtype is passed on. A
    0-d tensor built from constants (``torch.tensor(2.0)``, ``torch.full((), 0.5)``) is a
    literal of the expression, not a captured tensor: no kernel argument, and nothing for
    torch.compile to trace to a source. ``torch.tensor(x)`` of a traced value is that value
    (cast to ``dtype``). Everything else reaches torch as written (traced operands dispatch
    by protocol)."""

    def call(*args, **kwargs):
        if isinstance(kwargs.get("dtype"), str):
            kwargs["dtype"] = tf._torch_dtype(kwargs["dtype"])
        if name not in _CONSTRUCTORS:
            return fn(*args, **kwargs)
        if name in ("tensor", "as_tensor", "asarray", "scalar_tensor") and args and _traced(args[0]):
            dtype = kwargs.get("dtype")
            value = args[0]
            return _t._cast_to(dtype)(value) if dtype is not None else value
        result = fn(*args, **kwargs)
        if getattr(result, "ndim", None) == 0 and not getattr(result, "requires_grad", False):
            return _t.Sym(_t.ir.const(result.item(), _literal_dtype(result)))
        return result

    return call


def _literal_dtype(tensor) -> str:
    """The IR dtype of a 0-d torch tensor's literal: bool, an integer or a float."""
    if tensor.dtype.is_floating_point:
        return _t.ir.FLOAT
    return _t.ir.BOOL if str(tensor.dtype) == "torch.bool" else _t.ir.INT


def _is_scalar_type(value) -> bool:
    """numpy's scalar types (cupy's are numpy's) and jax.numpy's."""
    import numpy as np
    return isinstance(value, type) and (issubclass(value, np.generic) or type(value).__name__ == "_ScalarMeta")


class _ScalarType:
    """A library's scalar type (``jnp.float32``): called on a traced value, a cast; otherwise
    the type itself (its string names the dtype, so ``x.astype(jnp.float32)`` reads it)."""

    def __init__(self, scalar_type):
        self._type = scalar_type

    def __call__(self, x, *args, **kwargs):
        return _t._cast_to(self._type)(x) if _traced(x) else self._type(x, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._type, name)

    def __str__(self):
        return str(self._type)


# --- jax.numpy ------------------------------------------------------------------------------

def _clip(x, min=None, max=None, *, a_min=None, a_max=None):
    return _t._clamp(x, min=a_min if min is None else min, max=a_max if max is None else max)


def _select(condlist, choicelist, default=0):
    result = default
    for cond, choice in reversed(list(zip(condlist, choicelist))):
        result = _t._where(cond, choice, result)
    return result


def _as_array(x, dtype=None, **_):
    return x if dtype is None else _t._cast_to(dtype)(x)


_JNP = {"clip": _clip, "select": _select, "asarray": _as_array, "array": _as_array}

# --- jax.nn -----------------------------------------------------------------------------------

_JAX_NN = {
    "relu": tf.relu, "relu6": tf.relu6, "sigmoid": _t._unary("sigmoid"), "log_sigmoid": tf.logsigmoid,
    "silu": tf.silu, "swish": tf.silu, "soft_sign": tf.softsign, "selu": tf.selu, "mish": tf.mish,
    "gelu": lambda x, approximate=True: tf.gelu(x, "tanh" if approximate else "none"),
    "softplus": lambda x: tf.logaddexp(x, 0.0),
    "elu": lambda x, alpha=1.0: tf.elu(x, alpha), "celu": lambda x, alpha=1.0: tf.celu(x, alpha),
    "leaky_relu": lambda x, negative_slope=0.01: tf.leaky_relu(x, negative_slope),
    "hard_tanh": tf.hardtanh, "hard_sigmoid": tf.hardsigmoid,
    "hard_silu": tf.hardswish, "hard_swish": tf.hardswish, "tanh": _t._unary("tanh"),
}

# --- jax.lax ------------------------------------------------------------------------------------


def _lax_div(a, b):
    """lax.div: integers toward zero (C's division), floats the true quotient."""
    if tf._is_float(a) or tf._is_float(b):
        return _t._binary("truediv")(a, b)
    return tf.trunc_divide(a, b)


def _lax_round(x, rounding_method=0):
    """lax.round: half away from zero (rounding_method 0, the default) or to even (1)."""
    if int(rounding_method) == 1:
        return tf.round_half_even(x)
    x = tf._v(x)
    a = tf._abs(x)
    f = _t._floor(a)
    return tf._odd(x, _t._where(a - f >= 0.5, f + 1.0, f))


_JAX_LAX = {
    "select": lambda pred, on_true, on_false: _t._where(pred, on_true, on_false),
    "max": _op("maximum"), "min": _op("minimum"), "add": _op("add"), "sub": _op("sub"), "mul": _op("mul"),
    "neg": _op("neg"), "abs": _op("abs"), "sign": _op("sign"), "floor": _op("floor"), "ceil": _op("ceil"),
    "exp": _op("exp"), "exp2": _op("exp2"), "log": _op("log"), "log1p": tf.log1p, "expm1": tf.expm1,
    "tanh": _op("tanh"), "logistic": _t._unary("sigmoid"), "sqrt": _op("sqrt"), "rsqrt": _op("rsqrt"),
    "erf": tf.erf, "erfc": tf.erfc, "sin": _op("sin"), "cos": _op("cos"), "tan": tf.tan, "atan": tf.atan,
    "asin": tf.asin, "acos": tf.acos, "atan2": tf.atan2, "sinh": tf.sinh, "cosh": tf.cosh,
    "asinh": tf.asinh, "acosh": tf.acosh, "atanh": tf.atanh, "pow": tf.power,
    "integer_pow": tf.power, "div": _lax_div, "rem": tf.fmod, "round": _lax_round,
    "clamp": lambda lo, x, hi: _t._clamp(x, min=lo, max=hi),
    "convert_element_type": lambda x, new_dtype: _t._cast_to(new_dtype)(x),
    "lt": _op("lt"), "le": _op("le"), "gt": _op("gt"), "ge": _op("ge"), "eq": _op("eq"), "ne": _op("ne"),
    "bitwise_and": _op("bitwise_and"), "bitwise_or": _op("bitwise_or"), "bitwise_xor": _op("bitwise_xor"),
    "bitwise_not": _op("bitwise_not"), "shift_left": _op("left_shift"),
    "shift_right_arithmetic": _op("right_shift"),
}

_JAX_SPECIAL = {
    "erf": tf.erf, "erfc": tf.erfc, "expit": _t._unary("sigmoid"), "logit": tf.logit, "ndtr": tf.ndtr,
    "xlogy": tf.xlogy, "xlog1py": tf.xlog1py, "entr": tf.entr,
}

# module name -> (label, table, numpy-named)
_MODULES = {
    "jax.numpy": ("jax.numpy", _JNP, True),
    "jax.nn": ("jax.nn", _JAX_NN, False),
    "jax.lax": ("jax.lax", _JAX_LAX, False),
    "jax.scipy.special": ("jax.scipy.special", _JAX_SPECIAL, False),
    "cupy": ("cupy", _JNP, True),
    # torch dispatches by protocol; only its dtype queries and dtype= arguments need a
    # traced value's dtype name converted, and its constructors make literals (_torch_function)
    "torch": ("torch", {"finfo": tf.finfo, "iinfo": tf.iinfo}, False),
}
_LIBRARIES = ("jax", "cupy")   # packages whose functions are looked up by identity
_NAMESPACES: dict = {}   # id(module) -> (module, its namespace)
_FUNCTIONS: dict = {}   # id(a library function) -> (it, its traced implementation)
_SCANNED: set = set()   # the modules whose functions _FUNCTIONS holds


# packages above those modules (jax.scipy.special through `jax`): namespaces that only pass
# their submodules on
_PARENTS = {".".join(m.split(".")[:i]) for m in _MODULES for i in range(1, m.count(".") + 1)}


def _namespace(module: types.ModuleType):
    name = getattr(module, "__name__", "")
    if name not in _PARENTS and name not in _MODULES:
        return None
    kept = _NAMESPACES.get(id(module))
    if kept is None or kept[0] is not module:
        label, table, numpy_names = _MODULES.get(name, (name, {}, False))
        kept = _NAMESPACES[id(module)] = (module, TracedNamespace(module, label, table, numpy_names,
                                                                  refuse=name != "torch"))
    return kept[1]


def _function_table() -> dict:
    """Each loaded module's functions by identity (``from jax.numpy import where``)."""
    for name in _MODULES:
        if name.split(".")[0] not in _LIBRARIES:
            continue
        module = sys.modules.get(name)
        if module is None or name in _SCANNED:
            continue
        _SCANNED.add(name)
        namespace = _namespace(module)
        for attr in dir(module):
            value = getattr(module, attr, None)
            if callable(value) and not isinstance(value, (type, types.ModuleType)):
                _FUNCTIONS.setdefault(id(value), (value, getattr(namespace, attr)))
    return _FUNCTIONS


def substitute(value):
    """What a traced mod sees in place of ``value`` (a module or a library function); the
    value itself when it is neither."""
    if isinstance(value, types.ModuleType):
        return _namespace(value) or value
    if callable(value) and (getattr(value, "__module__", "") or "").split(".")[0] in _LIBRARIES:
        entry = _function_table().get(id(value))
        if entry is not None and entry[0] is value:
            return entry[1]
    return value
