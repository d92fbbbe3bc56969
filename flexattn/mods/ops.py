"""Our own op namespace for framework-free mods: ``from flexattn.mods import ops``.

Each function traces when given proxies and computes with numpy otherwise, so a mod
written with ``ops`` can also be called eagerly on index arrays.
"""

from __future__ import annotations

import numpy as np

from .evaluate import erf as _evaluate_erf
from .trace import OPERATIONS, CapturedArray, Sym, active_context

__all__ = [
    "where", "abs", "minimum", "maximum", "clamp", "exp", "exp2", "log", "log2", "tanh",
    "sigmoid", "sqrt", "rsqrt", "sin", "cos", "erf", "atan", "floor", "sign", "cast", "load",
]


def _traced(*args) -> bool:
    return any(isinstance(a, (Sym, CapturedArray)) for a in args)


def _op(name, numpy_fn):
    def f(*args):
        if _traced(*args):
            return OPERATIONS[name](*args)
        with np.errstate(all="ignore"):
            return numpy_fn(*args)

    f.__name__ = name
    f.__doc__ = f"Elementwise {name}; traces on proxies, numpy otherwise."
    return f


where = _op("where", np.where)
abs = _op("abs", np.abs)  # noqa: A001 - mirrors numpy/torch naming on purpose
minimum = _op("minimum", np.minimum)
maximum = _op("maximum", np.maximum)
exp = _op("exp", np.exp)
exp2 = _op("exp2", np.exp2)
log = _op("log", np.log)
log2 = _op("log2", np.log2)
tanh = _op("tanh", np.tanh)
sigmoid = _op("sigmoid", lambda x: 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, dtype=np.float64))))
sqrt = _op("sqrt", np.sqrt)
rsqrt = _op("rsqrt", lambda x: 1.0 / np.sqrt(x))
sin = _op("sin", np.sin)
cos = _op("cos", np.cos)
erf = _op("erf", _evaluate_erf)
atan = _op("atan", np.arctan)
floor = _op("floor", np.floor)
sign = _op("sign", np.sign)


def clamp(x, min=None, max=None):  # noqa: A002
    if _traced(x, min, max):
        return OPERATIONS["clamp"](x, min=min, max=max)
    return np.clip(x, min, max)


def cast(x, dtype: str):
    """Convert to 'int32', 'float32' or 'bool' (ints truncate towards zero)."""
    if _traced(x):
        return OPERATIONS["to"](x, dtype=dtype)
    x = np.asarray(x)
    if dtype == "int32" and x.dtype.kind == "f":
        x = np.trunc(x)
    return x.astype({"int32": np.int32, "float32": np.float32, "bool": np.bool_}[dtype])


def load(array, *index):
    """``array[index...]``: explicit buffer read, for arrays the tracer cannot see
    (e.g. held in an object attribute)."""
    ctx = active_context()
    if ctx is not None and not isinstance(array, CapturedArray):
        array = CapturedArray(array, ctx)
    return array[index if len(index) != 1 else index[0]]
