"""Symbolic derivative of a score mod, by reverse accumulation over the IR DAG.

For ``s' = score_mod(s, b, h, q, kv)`` it gives, as IR expressions:
- ``d_score``: ∂s'/∂s (the backward multiplies dS' by it);
- ``d_loads``: for every read ``buf[idx]`` of a captured *float* buffer, ∂s'/∂buf[idx] —
  the buffer's gradient is the scatter-add of dS' · ∂s'/∂buf[idx] at ``idx``, so
  trainable biases need no materialized score matrix, and a buffer read several times
  simply contributes several terms.
Ties of min/max split the gradient in half, as torch's ``minimum``/``maximum`` do.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from . import ir

_LN2 = math.log(2.0)
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


class ScoreDerivative(NamedTuple):
    d_score: ir.Node
    d_loads: tuple  # ((load node, ∂s'/∂load node), ...), float buffers only


def differentiate(expr: ir.Node) -> ScoreDerivative:
    order = expr.walk()
    adjoint: dict[int, ir.Node] = {id(expr): ir.const(1.0)}

    def acc(node, g):
        if node.dtype != ir.FLOAT:
            return  # ints and bools carry no gradient
        adjoint[id(node)] = ir.binary("add", adjoint[id(node)], g) if id(node) in adjoint else g

    for n in reversed(order):
        g = adjoint.get(id(n))
        if g is None or not n.args or n.op == "load":
            continue
        for child, local in _local_grads(n, g):
            acc(child, local)

    d_score = ir.const(0.0)
    d_loads: dict = {}
    for n in order:
        g = adjoint.get(id(n))
        if g is None:
            continue
        if n.op == "var" and n.attr == ir.SCORE_VAR:
            d_score = ir.binary("add", d_score, g)
        elif n.op == "load" and n.dtype == ir.FLOAT:
            d_loads[n] = ir.binary("add", d_loads[n], g) if n in d_loads else g  # same read twice
    return ScoreDerivative(d_score, tuple(d_loads.items()))


def _mul(a, b):
    return ir.binary("mul", a, b)


def _where(c, a, b):
    return ir.where(c, a, b)


def _local_grads(n: ir.Node, g: ir.Node):
    """(child, adjoint contribution) pairs for node ``n`` given its adjoint ``g``."""
    op, args = n.op, n.args
    zero = ir.const(0.0)
    if op == "add":
        return [(args[0], g), (args[1], g)]
    if op == "sub":
        return [(args[0], g), (args[1], ir.unary("neg", g))]
    if op == "mul":
        return [(args[0], _mul(g, args[1])), (args[1], _mul(g, args[0]))]
    if op == "truediv":
        a, b = args
        return [(a, ir.binary("truediv", g, b)),
                (b, ir.unary("neg", ir.binary("truediv", _mul(g, n), b)))]
    if op == "neg":
        return [(args[0], ir.unary("neg", g))]
    if op == "abs":
        a = args[0]
        return [(a, _where(ir.binary("gt", a, 0.0), g, _where(ir.binary("lt", a, 0.0), ir.unary("neg", g), zero)))]
    if op == "exp":
        return [(args[0], _mul(g, n))]
    if op == "exp2":
        return [(args[0], _mul(g, _mul(n, _LN2)))]
    if op == "log":
        return [(args[0], ir.binary("truediv", g, args[0]))]
    if op == "log2":
        return [(args[0], ir.binary("truediv", g, _mul(args[0], _LN2)))]
    if op == "sin":
        return [(args[0], _mul(g, ir.unary("cos", args[0])))]
    if op == "cos":
        return [(args[0], ir.unary("neg", _mul(g, ir.unary("sin", args[0]))))]
    if op == "tanh":
        return [(args[0], _mul(g, ir.binary("sub", 1.0, _mul(n, n))))]
    if op == "erf":   # 2 / sqrt(pi) exp(-x^2)
        x = args[0]
        return [(x, _mul(g, _mul(ir.unary("exp", ir.unary("neg", _mul(x, x))), _TWO_OVER_SQRT_PI)))]
    if op == "atan":  # 1 / (1 + x^2)
        x = args[0]
        return [(x, ir.binary("truediv", g, ir.binary("add", 1.0, _mul(x, x))))]
    if op == "sigmoid":
        return [(args[0], _mul(g, _mul(n, ir.binary("sub", 1.0, n))))]
    if op == "sqrt":
        return [(args[0], ir.binary("truediv", _mul(g, 0.5), n))]
    if op == "rsqrt":
        return [(args[0], _mul(g, ir.binary("truediv", _mul(n, -0.5), args[0])))]
    if op in ("minimum", "maximum"):
        a, b = args
        a_wins = ir.binary("lt" if op == "minimum" else "gt", a, b)
        tie = ir.binary("eq", a, b)
        half = _mul(g, 0.5)
        ga = _where(a_wins, g, _where(tie, half, zero))
        gb = _where(a_wins, zero, _where(tie, half, g))
        return [(a, ga), (b, gb)]
    if op == "where":
        c, a, b = args
        return [(a, _where(c, g, zero)), (b, _where(c, zero, g))]
    if op == "cast":
        return [(args[0], g)] if args[0].dtype == ir.FLOAT else []
    if op == "mod":  # a - b*floor(a/b): ∂a = 1, ∂b = -floor(a/b)
        a, b = args
        return [(a, g), (b, _mul(ir.unary("neg", g), ir.binary("floordiv", a, b)))]
    # floordiv, comparisons, logic: piecewise constant, no gradient
    return []
