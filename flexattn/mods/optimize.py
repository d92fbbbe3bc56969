"""The optimizing pass over mod IR, run once per mod before any kernel emits it.

Every kernel (forward, backward, decode, the GPU block-mask builder) emits mods through
``kernels/emit/mod_emit.IRModHook``, which runs ``optimize`` on its expressions; the
emitters then lower integer ``//`` and ``%`` using ``divisor_shift`` and ``nonnegative``.

What it does, and why:

- **Constant folding and common subexpressions** come with the IR itself: constructors
  fold constant operations, and nodes compare by structure, so rebuilding through a memo
  keyed by structure maps every repeated subexpression to one object, which the emitters
  emit once.
- **Division by a constant** ``x / c`` becomes ``x * (1/c)`` with ``1/c`` rounded to float32
  once: a per-element IEEE division costs ~10 instructions and cost the causal + softcap
  kernel 1.7x on the H100 (issue 24). Rounding: exact when ``c`` is a power of two; else
  the product is within 1 ulp of the correctly rounded quotient (two roundings of at most
  half an ulp each), tested on random inputs. Skipped where ``1/c`` would not be a normal
  float32 (huge or tiny ``c``), so the rewrite never overflows or flushes.
- **Division by a runtime number** ``x / $s`` (a captured float, e.g. a softcap's cap)
  becomes ``x * (1 / $s)``: the reciprocal depends on no index, so it is computed once, not
  per element. Same 1-ulp bound for ``|s|`` in float32's normal range; a subnormal ``s``
  (below 1.2e-38), whose reciprocal overflows, gives inf where the quotient of a tiny ``x``
  would be finite.
- **Integer ``//`` and ``%`` by a positive constant** are lowered by the emitters, not here
  (they are already single IR ops): by a power of two ``2**k`` to an arithmetic shift
  ``x >> k`` and a mask ``x & (2**k - 1)``, which are Python's floor semantics for every
  sign in two's complement; by other constants to the hardware's truncating division
  (which the compiler turns into a multiply-high by a magic number) without the sign
  correction when ``nonnegative`` proves the dividend is not negative (indices are not).
- **Integer ``//`` and ``%`` of multiples** by a positive constant ``c``: ``(x*c + y) // c``
  is ``x + y // c`` and ``(x*c + y) % c`` is ``y % c``; ``(y % c) // c`` is 0 and ``(y % c)
  % c`` is ``y % c`` (floor semantics: ``y % c`` lies in [0, c)). Page arithmetic is
  written this way: a key's page read back from its physical position ``page * 128 +
  kv % 128`` (torch's ``PagedAttention`` masks over a walk's table) becomes ``page``, one
  table read per key tile instead of per key once a kernel sees that it depends on the key
  only through ``kv // 128`` (``kernels/emit/mod_emit.tile_invariant_roots``). Exact
  wherever ``x*c`` does not overflow int32 (the form it replaces would wrap there).
"""

from __future__ import annotations

import numpy as np

from ..bounded import keep_bounded
from . import ir

_OPTIMIZED: dict = {}   # expr -> optimized expr (structural keys)
_CAPACITY = 1024
_F32 = np.finfo(np.float32)


def optimize(expr: ir.Node) -> ir.Node:
    """``expr`` rewritten for emission (see the module doc); the same object when nothing
    changes, and the same object for every call with an equal expression."""
    hit = _OPTIMIZED.get(expr)
    if hit is not None:
        return hit
    memo: dict = {}   # structure -> rewritten node: equal subtrees become one object
    done: dict[int, ir.Node] = {}
    for n in expr.walk():
        args = tuple(done[id(a)] for a in n.args)
        new = n if all(x is y for x, y in zip(args, n.args)) else ir.rebuild(n, args)
        new = _rewrite(new)
        done[id(n)] = memo.setdefault(new, new)
    out = done[id(expr)]
    return keep_bounded(_OPTIMIZED, expr, out, _CAPACITY)


def _rewrite(n: ir.Node) -> ir.Node:
    if n.op in ("floordiv", "mod") and n.dtype == ir.INT and positive_constant(n.args[1]):
        return _divide_multiples(n.op, n.args[0], n.args[1].attr) or n
    if n.op == "truediv" and n.args[1].op == "const":
        c = n.args[1].attr
        reciprocal = 1.0 / c if c != 0 and np.isfinite(c) else 0.0
        if _F32.tiny <= abs(reciprocal) <= _F32.max:
            return ir.binary("mul", n.args[0], ir.const(reciprocal))
    if n.op == "truediv" and n.args[1].op == "scalar" and n.args[0].op != "const":
        # A runtime number: its reciprocal is loop-invariant (one division per kernel,
        # hoisted by the compiler), the per-element work a multiply.
        return ir.binary("mul", n.args[0], ir.binary("truediv", 1.0, n.args[1]))
    return n


def _divide_multiples(op: str, x: ir.Node, c: int) -> ir.Node | None:
    """``x // c`` or ``x % c`` (``c`` > 0) with the multiples of ``c`` in ``x`` taken out
    (see the module doc); None where ``x`` has none."""
    quotient = _quotient(x, c)
    if quotient is not None:                     # x = quotient * c
        return quotient if op == "floordiv" else ir.const(0)
    if x.op == "mod" and x.args[1].op == "const" and x.args[1].attr == c:
        return ir.const(0) if op == "floordiv" else x
    if x.op == "add":
        for multiple, rest in ((x.args[0], x.args[1]), (x.args[1], x.args[0])):
            quotient = _quotient(multiple, c)
            if quotient is not None:
                inner = _divide_multiples(op, rest, c) or ir.binary(op, rest, c)
                return ir.binary("add", quotient, inner) if op == "floordiv" else inner
    return None


def _quotient(x: ir.Node, c: int) -> ir.Node | None:
    """``x / c`` as a node where ``x`` is an integer multiple of ``c`` by its form (a
    constant, or a product with a constant factor), else None."""
    if x.dtype != ir.INT:
        return None
    if x.op == "const":
        return ir.const(x.attr // c) if x.attr % c == 0 else None
    if x.op == "mul":
        for factor, other in ((x.args[0], x.args[1]), (x.args[1], x.args[0])):
            if factor.op == "const" and factor.attr % c == 0:
                return ir.binary("mul", other, factor.attr // c)
    return None


def divisor_shift(divisor: ir.Node) -> int | None:
    """``k`` when ``divisor`` is the integer constant ``2**k`` (k >= 1), else None."""
    if divisor.op != "const" or divisor.dtype != ir.INT:
        return None
    c = divisor.attr
    if c >= 2 and c & (c - 1) == 0:
        return c.bit_length() - 1
    return None


def positive_constant(node: ir.Node) -> bool:
    return node.op == "const" and node.dtype == ir.INT and node.attr > 0


def nonnegative(node: ir.Node) -> bool:
    """Whether an integer expression is surely >= 0 (indices are; differences are not)."""
    op = node.op
    if op == "var":
        return node.attr in ir.INDEX_VARS
    if op == "const":
        return node.attr >= 0
    if op == "load":
        return node.attr.storage_dtype in ("uint8", "bool")
    if op == "cast":
        return node.args[0].dtype == ir.BOOL or (node.args[0].dtype == ir.INT and nonnegative(node.args[0]))
    if op in ("add", "mul", "minimum"):
        return nonnegative(node.args[0]) and nonnegative(node.args[1])
    if op == "maximum":
        return nonnegative(node.args[0]) or nonnegative(node.args[1])
    if op == "floordiv":
        return nonnegative(node.args[0]) and positive_constant(node.args[1])
    if op == "mod":
        return positive_constant(node.args[1])   # Python's % takes the divisor's sign
    if op == "abs":
        return True
    if op == "shr":
        return nonnegative(node.args[0])
    if op == "where":
        return nonnegative(node.args[1]) and nonnegative(node.args[2])
    return False
