"""torch.compile: score functions made *inside* the compiled function, through torch's HOP.

A ``score_mod`` defined in the compiled code (in a model's ``forward``, closing over its
tensors: ``def score_mod(s, b, h, q, kv): return s + self.bias[h]``) is not a Python object
while dynamo traces: it cannot hand it to the compile-time preparation that traces other
functions into our IR (``flexattn.torch._prepare_for_compile``). torch's own
``flex_attention`` higher-order op can: dynamo *speculates* its score function into an FX
subgraph and lifts the tensors it closes over into graph inputs. So this route

1. calls that HOP (``flex_attention_route``), with a marker in ``kernel_options``: the
   registry id of the rest of the call (block mask, mask, scale, GQA), and an empty block
   mask of torch's;
2. before AOT autograd, a pre-grad pass of Inductor (``rewrite_marked_calls``, installed
   on the first such call) traces each marked node's score subgraph into a ``ScoreMod``
   (running the subgraph's code on our tracer's proxies, as it traces a user's function;
   its inputs, the lifted tensors, become the mod's captures) and puts the
   ``flexattn::attention_fwd`` op in the node's place, with the lifted tensors as its
   buffers.

AOT autograd then differentiates our op as any other (its registered backward): the
gradients reach the closed-over tensors, new tensor values never recompile. The
route needs Inductor (torch.compile's default backend): other backends leave torch's
HOP, which runs torch's own kernels.
"""

from __future__ import annotations

import dataclasses
import gc
import operator
import types

import torch

MARKER = "FLEXATTN_SPEC"   # kernel_options key: the registry id of the call's other parts


@torch._dynamo.assume_constant_result
def made_while_compiling(code) -> bool:
    """Whether the function with this code object exists only in the code dynamo traces
    (defined there: no live function object has it). A function made outside, or
    earlier, is a real object whose captures the compile-time trace reads itself."""
    return not any(type(r) is types.FunctionType and r.__code__ is code for r in gc.get_referrers(code))


def flex_attention_route(query, key, value, score_fn, base_id: int, scale: float):
    """(out, lse) of a compiled call whose score function was made inside the compiled
    code: torch's HOP, marked for ``rewrite_marked_calls``."""
    from torch._higher_order_ops.flex_attention import flex_attention as flex_hop
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask

    _install_pass()
    # One block covering everything (torch's default), without the q-side lists (their
    # transposition is vmapped code, which must not stay half in the graph once the pass
    # removes the HOP: dead code is all these nodes become).
    block = 1 << 30

    def one_block():
        return (torch.ones([1, 1, 1], dtype=torch.int32, device=query.device),
                torch.zeros([1, 1, 1, 1], dtype=torch.int32, device=query.device))

    empty = TorchBlockMask.from_kv_blocks(*one_block(), BLOCK_SIZE=block, seq_lengths=(1, 1),
                                          compute_q_blocks=False)
    empty.q_num_blocks, empty.q_indices = one_block()   # its own transpose
    options = {MARKER: base_id, "OUTPUT_LOGSUMEXP": True, "OUTPUT_MAX": False}
    result = flex_hop(query, key, value, score_fn, empty.as_tuple(), scale, options)
    return result[0], result[1]      # (some torch versions add the max scores)


def _pre_grad_pass(then):
    """``rewrite_marked_calls``, then the pre-grad pass that was set before (if any).

    A plain function, on purpose: Inductor runs a pass without a ``uuid()`` before its
    cache lookup ("early" pre-grad timing), so the cache key sees the rewritten graph.
    With a uuid it would run after the lookup, and a graph cached by another process
    would skip the pass — and the registration of the spec ids the graph names."""

    def flexattn_rewrite_marked_calls(graph):
        rewrite_marked_calls(graph)
        if then is not None:
            then(graph)

    flexattn_rewrite_marked_calls.flexattn_then = then
    return flexattn_rewrite_marked_calls


@torch._dynamo.assume_constant_result
def _install_pass() -> bool:
    """Put ``rewrite_marked_calls`` first in Inductor's pre-grad custom pass (chained with
    one already set). Runs at trace time, before Inductor compiles the graph."""
    import torch._inductor.codecache as codecache
    import torch._inductor.config as inductor_config

    current = inductor_config.pre_grad_custom_pass
    if not hasattr(current, "flexattn_then"):
        chained = _pre_grad_pass(current)
        inductor_config.pre_grad_custom_pass = chained
        # Inductor logs a warning for a pass without a uuid: here that is the point.
        warned = getattr(codecache, "_warned_pre_grad_pass_missing_uuid", None)
        if warned is not None and current is None:
            warned.add(chained.__qualname__)
    return True


def rewrite_marked_calls(graph: torch.fx.Graph) -> None:
    """Each marked ``flex_attention`` HOP node of ``graph`` -> ``flexattn::attention_fwd``."""
    from . import _REGISTRY

    hop = torch.ops.higher_order.flex_attention
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not hop:
            continue
        # (query, key, value, score_mod, block_mask, scale, kernel_options,
        #  score_mod_other_buffers, mask_mod_other_buffers)
        options = node.args[6] if len(node.args) > 6 else node.kwargs.get("kernel_options")
        if not isinstance(options, dict) or MARKER not in options:
            continue
        query, key, value, score_graph = node.args[:4]
        score_buffers = node.args[7] if len(node.args) > 7 else node.kwargs.get("score_mod_other_buffers", ())
        module = graph.owning_module
        subgraph = getattr(module, score_graph.target)
        stand_ins = [_stand_in(b) for b in score_buffers]
        score = _score_from_graph(subgraph, stand_ins)
        base = _REGISTRY.get(options[MARKER])
        spec = dataclasses.replace(base, score=score)
        spec_id = _REGISTRY.register(spec, pin=True, masks=_base_has_mask_operands(base))
        with graph.inserting_before(node):
            op = graph.call_function(torch.ops.flexattn.attention_fwd.default,
                                     (query, key, value, list(score_buffers), spec_id))
        example = node.meta.get("example_value")
        if example is not None:
            op.meta["example_value"] = (example[0], example[1])
        for user in list(node.users):
            index = user.args[1] if user.target is operator.getitem else None
            if index not in (0, 1):
                raise RuntimeError("flexattn: a compiled call read the HOP's max scores")
            user.args = (op, index)
        graph.erase_node(node)
    graph.eliminate_dead_code()


def _base_has_mask_operands(base) -> bool:
    return False   # the route takes calls without tensor-capturing mask functions (flexattn.torch)


def _stand_in(node):
    """A zero tensor shaped like the graph input ``node`` (its example value): what the
    trace captures in the input's place; the op reads the real tensors at run time."""
    value = node.meta.get("example_value", node.meta.get("val"))
    if value is None:
        raise RuntimeError(f"flexattn: no example value for the score function's input {node.name}")
    return torch.zeros(tuple(int(n) for n in value.shape), dtype=value.dtype)


def _score_from_graph(subgraph, stand_ins):
    """The ``ScoreMod`` of a speculated score subgraph (inputs: score, b, h, q, kv, then the
    lifted tensors): its code run on our tracer's proxies, the stand-ins captured."""
    from .. import mods

    return mods.score_mod(_closure_over(subgraph, stand_ins))


def _closure_over(subgraph, tensors):
    """``fn(score, b, h, q_idx, kv_idx)`` calling ``subgraph`` with ``tensors`` after the
    five: each tensor in a closure cell of its own, where the tracer finds captures."""
    names = [f"t{i}" for i in range(len(tensors))]
    packed = "".join(f"{n}, " for n in names)
    source = (f"def make(subgraph, {packed}):\n"
              f"    def score_fn(score, b, h, q_idx, kv_idx):\n"
              f"        return subgraph(score, b, h, q_idx, kv_idx, {packed})\n"
              f"    return score_fn\n")
    scope: dict = {}
    exec(source, scope)
    return scope["make"](subgraph, *tensors)


__all__ = ["MARKER", "flex_attention_route", "made_while_compiling", "rewrite_marked_calls"]
