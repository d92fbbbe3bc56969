"""torch.compile: mods and block masks made *inside* the compiled code, through torch's HOP.

A ``score_mod`` or ``mask=`` function defined in the compiled code and closing over
tensors (in a model's ``forward``: ``def score_mod(s, b, h, q, kv): return s + bias[h]``)
is not a Python object while dynamo traces, so it cannot reach the compile-time
preparation that traces other functions into our IR (``flexattn.torch.compiled._prepare_for_compile``;
``captures_graph_values`` tells these apart). Nor can the lists of a torch ``BlockMask``
built there (``made_in_traced_code``): they are values of the graph. torch's own
``flex_attention`` higher-order op takes both: dynamo *speculates* its score and mask
functions into FX subgraphs, lifting the tensors they read into graph inputs, and its
block-mask tuple carries the lists. So this route

1. calls that HOP (``flex_attention_route``) with markers in ``kernel_options``: the
   registry id of the rest of the call (block mask, mods made outside, scale, GQA) and
   which of the HOP's functions / lists are the call's (else a one-block torch mask);
2. before AOT autograd, Inductor's pre-grad pass ``rewrite_marked_calls`` (installed on the
   first such call) traces each marked node's subgraphs into a ``ScoreMod`` / ``MaskMod``
   (running the subgraph's code on our tracer's proxies, as it traces a user's function;
   the lifted tensors become the mods' captures) and puts ``flexattn::attention_fwd`` in
   the node's place (``attention_fwd_inference`` where autograd does not record the call),
   with the lifted tensors as its buffers and the torch lists, if any, as its ``lists``.

AOT autograd then differentiates our op as any other (its registered backward): the
gradients reach the closed-over tensors, new tensor values never recompile. Our op needs
Inductor (torch.compile's default backend; ``compiling_for_inductor``): other backends
would leave torch's HOP to torch's own implementation, without the parts we registered —
so there the whole call is torch's HOP, unmarked (``torch_flex_call``: functions, a torch
block mask), and parts it cannot take (mod values, flexattn block masks) are a clear
error instead of silently left out. ``object_token`` / ``stashed`` carry a torch block mask
made *outside* to the compile-time preparation instead (torch 2.11's dynamo hands
constant functions no user objects).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import operator
import threading
import types

import torch

from .dynamo_marks import assume_constant_result, comptime

MARKER = "FLEXATTN_SPEC"   # kernel_options key: the registry id of the call's other parts
SCORE_KEY = "FLEXATTN_SCORE"   # kernel_options key: the HOP's score function is the call's
MASK_KEY = "FLEXATTN_MASK"     # kernel_options key: the HOP's mask function is the call's mask=
LISTS_KEY = "FLEXATTN_LISTS"   # kernel_options key: the HOP's block mask is the call's (graph lists)
MAX_KEY = "FLEXATTN_MAX"       # kernel_options key: the call wants the row maxima (attention_fwd_max)


_PROBE = threading.local()   # a comptime hook's answer, read back by _probed


@assume_constant_result
def _probed():
    return _PROBE.value


def _variable(ctx, name: str):
    """Dynamo's variable of the traced local ``name`` of the function that called
    ``comptime`` (its internal API: one place)."""
    return ctx.get_local(name, stacklevel=1)._i_will_not_complain_if_bc_breaks_VariableTracker()


def captures_graph_values(fn) -> bool:
    """Called in code dynamo traces: whether ``fn`` is a plain function that dynamo cannot
    make a Python constant — one defined in the traced code whose closure holds tensors
    (graph values). Those cannot reach the compile-time trace of ``flexattn.torch``;
    everything else can (functions made outside, closures over numbers), as before. A
    ``comptime`` hook reads dynamo's own verdict while tracing; the constant-result
    function hands it to the traced code."""
    if not inspect.isfunction(fn):
        return False
    comptime(lambda ctx: setattr(_PROBE, "value", _takes_the_hop(_variable(ctx, "fn"))))
    return _probed()


def _reachable_values(fn, path=(), depth=0) -> list:
    """[(path, value)] of what ``fn`` can read: its closure cells, named globals and
    defaults, and (recursively, a few levels) those of the functions found there."""
    items = []
    for i, cell in enumerate(fn.__closure__ or ()):
        try:
            items.append((("cell", i), cell.cell_contents))
        except ValueError:   # an empty cell
            pass
    items += [(("global", n), fn.__globals__[n]) for n in fn.__code__.co_names if n in fn.__globals__]
    items += [(("default", i), d) for i, d in enumerate(fn.__defaults__ or ())]
    out = []
    for step, value in items:
        out.append((path + (step,), value))
        if depth < 3 and inspect.isfunction(value) and value is not fn:
            out += _reachable_values(value, path + (step,), depth + 1)
    return out


def _takes_the_hop(var) -> bool:
    """dynamo's verdict on a mod function it traces: not a Python constant (a closure over
    graph values), or defined in the traced code and reading tensors through its globals
    (directly or through helper functions): dynamo cannot follow such a function's
    ``__globals__`` to those tensors (``_follow`` would stop with an "Observed exception"),
    while torch's HOP lifts them as inputs like closed-over ones."""
    if not var.is_python_constant():
        return True
    code, f_globals = getattr(var, "code", None), getattr(var, "f_globals", None)
    if code is None or not isinstance(f_globals, dict):
        return False     # a function made outside the traced code: dynamo reads its globals
    from .launches import _is_tensor

    code = code.as_python_constant()
    fn = types.FunctionType(code, f_globals, code.co_name, None,
                            tuple(types.CellType() for _ in code.co_freevars) or None)
    return any(path[0][0] == "global" and _is_tensor(value) for path, value in _reachable_values(fn))


@assume_constant_result
def compiling_for_inductor() -> bool:
    """Called in code dynamo traces: whether the graph goes to Inductor, whose pre-grad
    pass (``rewrite_marked_calls``) puts our op in the HOP's place. Other backends
    (``aot_eager``, ``eager``, a user's own) run torch's implementation of the HOP, so
    the call's parts must all be in it; False where the backend cannot be told (the
    route that is right under every backend)."""
    try:
        from torch._dynamo.backends.registry import lookup_backend
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._inductor.compile_fx import compile_fx

        backend = InstructionTranslator.current_tx().output.compiler_fn
        inductors = (compile_fx, lookup_backend("inductor"))
        for _ in range(8):   # down the wrappers (dynamo's debug and config ones, a counter) to the backend
            if isinstance(backend, str):     # a wrapper naming a registered backend
                backend = lookup_backend(backend)
            if isinstance(backend, torch._TorchCompileInductorWrapper) or any(backend is f for f in inductors):
                return True
            backend = (getattr(backend, "_torchdynamo_orig_backend", None) or getattr(backend, "__wrapped__", None)
                       or getattr(backend, "compiler_fn", None) or getattr(backend, "backend", None))
            if backend is None:
                break
    except Exception:    # dynamo's internals moved: take the route right under every backend
        pass
    return False


def made_in_traced_code(x) -> bool:
    """Called in code dynamo traces: whether ``x`` was created there (dynamo tracks it
    without a source: a torch ``BlockMask`` built inside the compiled code, whose lists are
    values of the graph)."""
    comptime(lambda ctx: setattr(_PROBE, "value", _variable(ctx, "x").source is None))
    return _probed()


_OBJECTS: dict = {}   # id -> object, stashed while tracing (object_token)


def _stash(ctx) -> None:
    value = _variable(ctx, "x").value
    _OBJECTS[id(value)] = value


def object_token(x):
    """Called in code dynamo traces, for an object made outside it (an argument, a global):
    ``("id", id(x))``, with the object itself stashed for ``stashed`` (a ``comptime``
    hook reads it from dynamo's variable). Evaluating ``id(x)`` makes dynamo guard on the
    object's identity: another object recompiles."""
    comptime(_stash)
    return ("id", id(x))


def stashed(token):
    """The object of an ``object_token`` (others pass through); the stash lets it go."""
    if isinstance(token, tuple) and len(token) == 2 and token[0] == "id" and token[1] in _OBJECTS:
        return _OBJECTS.pop(token[1])
    return token


def _keep_score(score, b, h, q_idx, kv_idx):
    """The HOP's score function where the call's score is not on this route."""
    return score


def flex_attention_route(query, key, value, score_fn, mask_fn, base_id: int, scale: float, block_mask=None,
                         want_max: bool = False):
    """(out, lse) of a compiled call whose score function or ``mask=`` function (or both;
    None: the registered call's own) was made inside the compiled code, or whose torch
    ``block_mask`` was (its lists and ``mask_mod`` go to the HOP as they are): torch's HOP,
    marked for ``rewrite_marked_calls``. ``scale``: the call's, resolved (our op reads the
    registered spec's; torch's own implementation, under another backend, this one).
    ``want_max``: (out, lse, max_scores)."""
    _install_pass()
    lists = block_mask is not None
    if block_mask is None:
        block_mask = _one_block_mask(query, key, mask_fn)
    options = {MARKER: base_id, SCORE_KEY: score_fn is not None, MASK_KEY: lists or mask_fn is not None,
               LISTS_KEY: lists, MAX_KEY: want_max}
    return _hop(query, key, value, score_fn, block_mask, scale, options, want_max)


def _hop(query, key, value, score_fn, block_mask, scale: float, options: dict, want_max: bool) -> tuple:
    """torch's flex HOP over a torch ``block_mask`` (``score_fn`` None: the identity), its
    LSE (and with ``want_max`` its row maxima) asked for: (out, lse[, max_scores]), as the
    HOP returns them (torch's kernels: statistics in base 2)."""
    from torch._higher_order_ops.flex_attention import flex_attention as flex_hop

    result = flex_hop(query, key, value, _keep_score if score_fn is None else score_fn, block_mask.as_tuple(), scale,
                      {**options, "OUTPUT_LOGSUMEXP": True, "OUTPUT_MAX": want_max})
    if want_max:
        if len(result) < 3:
            raise ValueError("under torch.compile, return_aux=AuxRequest(max_scores=True) with a mod defined inside"
                             " the compiled code needs a torch whose flex_attention returns max scores")
        return result[0], result[1], result[2]
    return result[0], result[1]      # (some torch versions add the max scores)


def _one_block_mask(query, key, mask_fn):
    """A torch ``BlockMask`` of one partial block covering everything, ``mask_fn`` (if any)
    applied to every element, its own transpose: no q-side lists computed (vmapped code)."""
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask

    def one_block():
        return (torch.ones([1, 1, 1], dtype=torch.int32, device=query.device),
                torch.zeros([1, 1, 1, 1], dtype=torch.int32, device=query.device))

    block_mask = TorchBlockMask.from_kv_blocks(*one_block(), BLOCK_SIZE=1 << 30, mask_mod=mask_fn,
                                               seq_lengths=(query.shape[-2], key.shape[-2]), compute_q_blocks=False)
    block_mask.q_num_blocks, block_mask.q_indices = one_block()
    return block_mask


def torch_flex_call(query, key, value, score_fn, mask_fn, block_mask, scale, enable_gqa: bool, want_max: bool):
    """(out, lse[, max_scores]) of torch's own flex attention for a compiled call whose
    graph may not reach Inductor (``compiling_for_inductor``): torch's HOP, unmarked, so no
    pass rewrites it, whichever backend compiles it — right everywhere, at torch's speed.
    (The HOP itself, not torch's ``flex_attention``, which refuses gradients on the CPU
    where the HOP under ``aot_eager`` gives them.) ``mask_fn``: the call's ``mask=``
    function (a one-block torch mask carries it); ``scale``: None for 1/sqrt(D)."""
    if query.shape[-3] != key.shape[-3] and not enable_gqa:
        raise ValueError(f"query has {query.shape[-3]} heads, key and value {key.shape[-3]}: pass enable_gqa=True"
                         " for grouped-query attention")
    if block_mask is None:
        block_mask = _one_block_mask(query, key, mask_fn)
    out, *stats = _hop(query, key, value, score_fn, block_mask, query.shape[-1] ** -0.5 if scale is None else scale,
                       {}, want_max)
    # torch's kernels (but its FLASH backend, not chosen here) keep the statistics in base 2
    return (out, *(x * math.log(2.0) for x in stats))


class _RewriteMarkedCalls:
    """Inductor's pre-grad custom pass: ``rewrite_marked_calls``, then the pass that was
    set before (``flexattn_then``, if any).

    Without a ``uuid()``, on purpose: Inductor runs such a pass before its cache lookup
    ("early" pre-grad timing), so the cache key sees the rewritten graph. With a uuid it
    would run after the lookup, and a graph cached by another process would skip the pass
    — and the registration of the spec ids the graph names. A module-level class, so the
    pass pickles (by reference) where Inductor pickles its config into a cache key (torch
    2.11 does; a local function there failed to pickle: a logged traceback per compile,
    and no cache)."""

    def __init__(self, then):
        self.flexattn_then = then

    def __call__(self, graph):
        rewrite_marked_calls(graph)
        if self.flexattn_then is not None:
            self.flexattn_then(graph)


@assume_constant_result
def _install_pass() -> bool:
    """Put ``rewrite_marked_calls`` first in Inductor's pre-grad custom pass (chained with
    one already set). Runs at trace time, before Inductor compiles the graph."""
    import torch._inductor.codecache as codecache
    import torch._inductor.config as inductor_config

    current = inductor_config.pre_grad_custom_pass
    if not hasattr(current, "flexattn_then"):
        chained = _RewriteMarkedCalls(current)
        inductor_config.pre_grad_custom_pass = chained
        # Inductor logs a warning for a pass without a uuid: here that is the point.
        warned = getattr(codecache, "_warned_pre_grad_pass_missing_uuid", None)
        if warned is not None and current is None:
            warned.add(type(chained).__qualname__)
    return True


def rewrite_marked_calls(graph: torch.fx.Graph) -> None:
    """Each marked ``flex_attention`` HOP node of ``graph`` -> ``flexattn::attention_fwd``
    (``attention_fwd_inference`` where autograd does not record the call)."""
    from .ops import _REGISTRY

    hop = torch.ops.higher_order.flex_attention
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not hop:
            continue
        # (query, key, value, score_mod, block_mask, scale, kernel_options,
        #  score_mod_other_buffers, mask_mod_other_buffers)
        options = node.args[6] if len(node.args) > 6 else node.kwargs.get("kernel_options")
        if not isinstance(options, dict) or MARKER not in options:
            continue
        query, key, value, score_graph, block_mask = node.args[:5]
        score_buffers = tuple(node.args[7] if len(node.args) > 7 else node.kwargs.get("score_mod_other_buffers", ()))
        mask_buffers = tuple(node.args[8] if len(node.args) > 8 else node.kwargs.get("mask_mod_other_buffers", ()))
        module = graph.owning_module
        spec = _REGISTRY.get(options[MARKER])
        if options.get(SCORE_KEY, True):
            score, score_buffers = _mod_from_graph(getattr(module, score_graph.target), score_buffers, "score")
            spec = dataclasses.replace(spec, score=score)
        else:
            score_buffers = ()
        if options.get(MASK_KEY, False):
            # the block mask's mask_mod
            mask, mask_buffers = _mod_from_graph(getattr(module, block_mask[-1].target), mask_buffers, "mask")
            spec = dataclasses.replace(spec, mask=mask)
        else:
            mask_buffers = ()
        spec_id = _REGISTRY.register(spec, pin=True, masks=bool(mask_buffers))
        lists, layout = [], None
        if options.get(LISTS_KEY, False):
            # torch's tuple: (Q_LEN, KV_LEN, kv_num_blocks, kv_indices, full_kv_num_blocks,
            # full_kv_indices, the q-side four, [later torch: more], Q_BLOCK, KV_BLOCK, mask_mod)
            lists = list(block_mask[2:6])
            layout = [block_mask[-3], block_mask[-2], block_mask[0], block_mask[1]]
        buffers = list(score_buffers + mask_buffers)
        want_max = options.get(MAX_KEY, False)
        outputs = 3 if want_max else 2
        example = node.meta.get("example_value")
        # a call autograd does not record (traced under no_grad, or nothing requires grad:
        # its outputs' example values say so) takes the op without an autograd layer
        records = example is None or any(getattr(x, "requires_grad", True) for x in tuple(example)[:outputs])
        with graph.inserting_before(node):
            if layout is not None and not records and not want_max:
                # an inference short query over one row of q blocks: the graph walks its lists
                from .graph_walk import walk_nodes

                walk = walk_nodes(graph, query, lists, layout)
                if walk:   # in place of the lists: Inductor fuses the slice into the walk (4 kernels a step, not 6)
                    lists = [None] * 4 + walk
            target = (torch.ops.flexattn.attention_fwd_max if want_max else
                      torch.ops.flexattn.attention_fwd if records else torch.ops.flexattn.attention_fwd_inference)
            op = graph.call_function(target.default, (query, key, value, buffers, spec_id, lists, layout))
        if example is not None:
            op.meta["example_value"] = tuple(example[:outputs])
        for user in list(node.users):
            index = user.args[1] if user.target is operator.getitem else None
            if index not in range(outputs):
                raise RuntimeError("flexattn: a compiled call read the HOP's max scores")
            user.args = (op, index)
        graph.erase_node(node)
    # No dead-code elimination here: FX's would drop vmap's level bookkeeping (torch's
    # create_block_mask traces vmapped code); AOT autograd retraces the graph anyway.


def _example(node):
    value = node.meta.get("example_value", node.meta.get("val"))
    if value is None:
        raise RuntimeError(f"flexattn: no example value for the mod function's input {node.name}")
    return value


def _size(n) -> int:
    """A concrete size for a stand-in (a symbolic one's hint)."""
    return int(n.node.hint) if isinstance(n, torch.SymInt) else int(n)


def _mod_from_graph(subgraph, buffers, kind: str):
    """``(mod, op buffers)`` of a speculated subgraph (inputs: [score,] b, h, q, kv, then
    what dynamo lifted): the ``ScoreMod`` / ``MaskMod`` of its code run on our tracer's
    proxies, with zero stand-ins of the lifted tensors captured (the op binds the real
    ones per call), and the lifted tensors in capture order. Under dynamic shapes dynamo
    also lifts symbolic sizes: unused ones are dropped; a function that computes with
    one is refused (its value would be baked into the kernel)."""
    from .. import mods

    placeholders = [n for n in subgraph.graph.nodes if n.op == "placeholder"]
    lifted = placeholders[len(placeholders) - len(buffers):]
    stand_ins, buffer_of = [], {}     # buffer_of: id(a tensor's stand-in) -> its op buffer
    for buffer, placeholder in zip(buffers, lifted):
        value = _example(buffer)
        if isinstance(value, torch.Tensor):
            stand_ins.append(torch.zeros(tuple(_size(n) for n in value.shape), dtype=value.dtype))
            buffer_of[id(stand_ins[-1])] = buffer
        elif not placeholder.users:
            stand_ins.append(0)          # an unused symbolic size: no capture
        else:
            raise TypeError(f"under torch.compile with dynamic shapes, a {kind} function defined inside the compiled"
                            f" code computes with a symbolic size ({buffer.name}): mark that dimension static"
                            " (torch._dynamo.mark_static) or compile with dynamic=False")
    fn = _closure_over(subgraph, stand_ins, kind)
    mod = mods.score_mod(fn) if kind == "score" else mods.mask_mod(fn)
    # The mod captures the stand-ins in the order its trace first reads them, which need
    # not be dynamo's order of lifting (an argument read before the call that reads
    # another tensor: ``user(s, b, h, q + lengths[b], kv)``); the op binds its buffers to
    # the captures in the mod's order, so they follow it (unread ones dropped).
    ordered = tuple(buffer_of[id(c)] for c in mod.captures if id(c) in buffer_of)
    return mod, ordered


def _closure_over(subgraph, tensors, kind: str):
    """``fn(score, b, h, q_idx, kv_idx)`` (a mask: without ``score``) calling ``subgraph``
    with ``tensors`` (stand-ins) after its index arguments: each in a closure cell of its
    own, where the tracer finds captures. The subgraph's code runs with ``torch`` as traced
    mods see it (``mods.namespaces``): a constant it makes (``torch.tensor(2.5, dtype=...)``,
    ``torch.full((), c)``, which dynamo records as calls, not lifted inputs) is a literal of
    the expression, not a tensor capture that no op input would bind."""
    subgraph = _with_traced_torch(subgraph)
    names = [f"t{i}" for i in range(len(tensors))]
    packed = "".join(f"{n}, " for n in names)
    args = ("score, " if kind == "score" else "") + "b, h, q_idx, kv_idx"
    source = (f"def make(subgraph, {packed}):\n"
              f"    def {kind}_fn({args}):\n"
              f"        return subgraph({args}, {packed})\n"
              f"    return {kind}_fn\n")
    scope: dict = {}
    exec(source, scope)
    return scope["make"](subgraph, *tensors)


def _with_traced_torch(subgraph):
    """``subgraph``'s generated ``forward``, bound to it, with its global ``torch`` swapped
    for the namespace traced mods see (``mods.namespaces.substitute``)."""
    from ..mods import namespaces

    forward = type(subgraph).forward
    if not inspect.isfunction(forward) or "torch" not in forward.__globals__:
        return subgraph
    scope = dict(forward.__globals__)
    scope["torch"] = namespaces.substitute(scope["torch"])
    code = types.FunctionType(forward.__code__, scope, forward.__name__, forward.__defaults__, forward.__closure__)
    return functools.partial(code, subgraph)


__all__ = ["MARKER", "captures_graph_values", "flex_attention_route", "made_in_traced_code", "object_token",
           "rewrite_marked_calls", "stashed"]
