"""Our mods evaluated with torch's ops: a ``MaskMod`` / ``ScoreMod`` called on torch tensors.

torch code calls mods as functions — gpt-fast's decoding step moves a block mask's
``mask_mod`` to the current position with ``lambda b, h, q, kv: mask_mod(b, h, q + offset,
kv)`` — and under ``torch.compile`` torch's flex HOP traces that function with its own
tensors (FakeTensors, proxies). The core evaluates a mod with numpy, which such tensors
cannot enter; this module evaluates the IR with torch operations instead (registered in
``mods.mod.ARRAY_EVALUATORS``), so whatever traces the call records plain torch ops: the
ones a torch-style function would have used (Python's operators where torch has them),
which every route that reads torch functions (the HOP's graph, our own tracer) takes.

Semantics are the IR's, as the numpy oracle's (``mods.evaluate``): floor ``//`` and ``%``,
float-to-int casts truncating, integers in int64, floats in float32 (torch flex's
score dtype)."""

from __future__ import annotations

import torch

from ..mods import ir

_DTYPES = {ir.INT: torch.int64, ir.FLOAT: torch.float32, ir.BOOL: torch.bool}

_BINARY = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "truediv": lambda a, b: a / b,
    "lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b,
    "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
    "minimum": torch.minimum, "maximum": torch.maximum,
    "and": lambda a, b: a & b, "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b,
    "shl": lambda a, b: a << b, "shr": lambda a, b: a >> b,
    "floordiv": lambda a, b: a // b, "mod": lambda a, b: a % b,
}
_UNARY = {
    "exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "log2": torch.log2, "tanh": torch.tanh,
    "sqrt": torch.sqrt, "neg": torch.neg, "abs": torch.abs, "sigmoid": torch.sigmoid,
    "rsqrt": torch.rsqrt, "sin": torch.sin, "cos": torch.cos, "erf": torch.erf, "atan": torch.atan,
}


def is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


def evaluate(expr: ir.Node, env: dict, captures) -> torch.Tensor:
    """``expr``'s value with the variables in ``env`` (tensors or numbers, broadcasting) and
    the mod's ``captures`` (arrays become tensors on the variables' device)."""
    device = next(v.device for v in env.values() if isinstance(v, torch.Tensor))
    values: dict[int, object] = {}
    for n in expr.walk():
        values[id(n)] = _node(n, [values[id(a)] for a in n.args], env, captures, device)
    out = values[id(expr)]
    return out if isinstance(out, torch.Tensor) else torch.tensor(out, dtype=_DTYPES[expr.dtype], device=device)


def _tensor(x, dtype, device) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=dtype, device=device)


def _node(n: ir.Node, a: list, env: dict, captures, device):
    op, dtype = n.op, _DTYPES[n.dtype]
    if op == "var":
        return env[n.attr]
    if op == "const":
        return n.attr
    if op == "scalar":
        return captures[n.attr]
    if op == "load":
        buffer = captures[n.attr.slot]
        # (a read-only numpy capture: copied, as torch does not view read-only arrays)
        buffer = buffer.to(device) if isinstance(buffer, torch.Tensor) else torch.tensor(buffer, device=device)
        index = tuple(_tensor(i, torch.int64, device) for i in a)
        value = buffer[index]
        same_kind = (value.dtype == torch.bool) == (dtype == torch.bool) and \
            value.is_floating_point() == dtype.is_floating_point
        return value if same_kind else value.to(dtype)
    if op == "cast":
        x = _tensor(a[0], _DTYPES[n.args[0].dtype], device)
        if n.dtype == ir.INT and x.is_floating_point():
            x = torch.trunc(x)
        return x.to(dtype)
    if op == "where":
        cond, x, y = a
        return torch.where(_tensor(cond, torch.bool, device), _tensor(x, dtype, device), _tensor(y, dtype, device))
    if op == "not":
        return ~_tensor(a[0], dtype, device)
    if op in ("minimum", "maximum"):
        return _BINARY[op](_tensor(a[0], dtype, device), _tensor(a[1], dtype, device))
    if op == "floordiv" and n.dtype == ir.FLOAT:
        return torch.floor(_tensor(a[0], dtype, device) / a[1])
    if op in _BINARY:
        x, y = a
        if not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor):
            x = _tensor(x, _DTYPES[n.args[0].dtype], device)
        return _BINARY[op](x, y)
    if op in _UNARY:
        return _UNARY[op](_tensor(a[0], dtype, device))
    raise NotImplementedError(f"torch evaluation of op {op!r}")
