"""numpy interpreter of the IR: evaluates an expression on whole index grids at once.

Integers are computed in int64 (no wrap-around surprises in the reference), floats in
the caller's ``float_dtype`` (float64 for the oracle), bools as numpy bools. Division
semantics are Python's (floor division and modulo round towards -inf), as in torch.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import math

import numpy as np

from . import ir

_erf = np.frompyfunc(math.erf, 1, 1)   # numpy has no erf; math's is exact to float64


def erf(x):
    return np.asarray(_erf(np.asarray(x, dtype=np.float64)), dtype=np.float64)

_BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "truediv": np.true_divide,
    "minimum": np.minimum, "maximum": np.maximum,
    "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
    "eq": np.equal, "ne": np.not_equal,
}
_LOGIC_BOOL = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}
_LOGIC_INT = {"and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}
_SHIFT = {"shl": np.left_shift, "shr": np.right_shift}   # right_shift: arithmetic on signed ints
_UNARY = {
    "exp": np.exp, "exp2": np.exp2, "log": np.log, "log2": np.log2, "tanh": np.tanh,
    "sqrt": np.sqrt, "neg": np.negative, "abs": np.abs,
    "sigmoid": lambda x: 0.5 * (1.0 + np.tanh(0.5 * x)),  # overflow-free form
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "sin": np.sin, "cos": np.cos, "erf": erf, "atan": np.arctan,
}


def numpy_dtype(ir_dtype: str, float_dtype=np.float64):
    return {ir.INT: np.int64, ir.FLOAT: float_dtype, ir.BOOL: np.bool_}[ir_dtype]


def evaluate(
    node: ir.Node,
    env: Mapping[str, np.ndarray],
    values: Sequence = (),
    float_dtype=np.float64,
) -> np.ndarray:
    """Value of ``node`` with variables from ``env`` and captured inputs ``values`` (by slot).

    ``env`` arrays broadcast against each other (e.g. q as [Q, 1] and kv as [1, KV]).
    The result has the broadcast shape of the variables it uses.
    """
    out: dict[int, np.ndarray] = {}
    with np.errstate(all="ignore"):
        for n in node.walk():
            out[id(n)] = _eval_node(n, [out[id(a)] for a in n.args], env, values, float_dtype)
    return out[id(node)]


def _eval_node(n, args, env, values, float_dtype):
    dt = numpy_dtype(n.dtype, float_dtype)
    op = n.op
    if op == "var":
        if n.attr not in env:
            raise KeyError(f"variable {n.attr!r} has no value here")
        return np.asarray(env[n.attr]).astype(dt, copy=False)
    if op == "const":
        return dt(n.attr)
    if op == "scalar":
        return dt(values[n.attr])
    if op == "load":
        buf = np.asarray(values[n.attr.slot])
        index = tuple(np.asarray(a, dtype=np.int64) for a in args)
        return np.asarray(buf[index]).astype(dt, copy=False)
    if op == "cast":
        x = args[0]
        if n.dtype == ir.INT and np.asarray(x).dtype.kind == "f":
            x = np.trunc(x)  # C/torch semantics: float → int truncates towards zero
        return np.asarray(x).astype(dt)
    if op == "where":
        return np.where(*args).astype(dt, copy=False)
    if op == "not":
        return np.logical_not(args[0]) if n.dtype == ir.BOOL else np.invert(args[0])
    if op == "floordiv":
        a, b = args
        if n.dtype == ir.INT:
            return np.floor_divide(a, b).astype(dt, copy=False)
        return np.floor(a / b).astype(dt, copy=False)
    if op == "mod":
        return np.mod(*args).astype(dt, copy=False)
    if op in _LOGIC_BOOL:
        table = _LOGIC_BOOL if n.dtype == ir.BOOL else _LOGIC_INT
        return table[op](*args)
    if op in _SHIFT:
        return np.asarray(_SHIFT[op](*args)).astype(dt, copy=False)
    if op in _BINARY:
        return np.asarray(_BINARY[op](*args)).astype(dt, copy=False)
    if op in _UNARY:
        return np.asarray(_UNARY[op](args[0])).astype(dt, copy=False)
    raise NotImplementedError(f"numpy evaluation of op {op!r}")


def eval_constant(node: ir.Node):
    """Fold a node whose arguments are all constants into a Python value."""
    value = evaluate(node, {}, (), float_dtype=np.float64)  # kernels round once, at emission
    return np.asarray(value).item()
