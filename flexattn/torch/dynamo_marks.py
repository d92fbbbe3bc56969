"""What the adapter tells torch.compile's tracer (dynamo), without importing it.

Importing ``torch._dynamo`` takes about a second (its variables, symbolic shapes, sympy,
torch.distributed); ``import flexattn.torch`` paid it for its module-level decorators and
``comptime`` hooks although only code dynamo traces needs them. An eager user never
traces, and under torch.compile dynamo is imported already.
"""

from __future__ import annotations


def assume_constant_result(fn):
    """``torch._dynamo.assume_constant_result`` without the import: dynamo calls a function
    so marked while tracing and puts its result in the graph as a constant. The mark is
    the attribute dynamo's own decorator sets (``tests/test_torch_compile.py`` checks that
    the two agree)."""
    fn._dynamo_marked_constant = True
    return fn


def comptime(hook) -> None:
    """``torch._dynamo.comptime.comptime(hook)`` from code dynamo traces: ``hook(ctx)`` runs
    at trace time, outside tracing it is a no-op. The hook sees this function's frame:
    its caller's locals are ``ctx.get_local(name, stacklevel=1)`` (``nested._variable``)."""
    from torch._dynamo.comptime import comptime as dynamo_comptime

    dynamo_comptime(hook)
