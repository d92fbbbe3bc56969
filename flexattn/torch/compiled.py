"""torch.compile's route into the custom ops: what dynamo traces of a ``flex_attention``
call (``_compiled_call``: one constant-folded preparation, then the op), the preparation
itself (``_prepare_for_compile``: the call's spec registered once per compilation, the
tensors its functions close over found and passed as op inputs, numbers they read
guarded), and which calls go whole to torch's flex HOP instead (``_compiled_route``:
functions defined inside the compiled code, block masks that are graph values).
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask as _TorchBlockMask

from ..blockmask import BlockMask as _CoreBlockMask
from ..blockmask.layout import as_block_mask
from ..core.registry import by_id, compiled_spec, from_id
from ..mods import Mod
from .dynamo_marks import assume_constant_result
from .launches import _is_tensor
from .nested import (_reachable_values, captures_graph_values, compiling_for_inductor, flex_attention_route,
                     made_in_traced_code, object_token, stashed, torch_flex_call)
from .ops import _REGISTRY, _records_grad, _score_tensors

def _compiled_call(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, mask, score):
    """What dynamo traces: one constant-folded preparation call, then the custom op.

    ``_prepare_for_compile`` runs once per compilation, in plain Python (dynamo calls it on
    the real argument objects and bakes its int result into the graph, guarding on the
    identity of the mod / block-mask objects); the score mod's captured tensors are read
    here, where dynamo sees them (parameters become graph inputs and receive gradients).
    """
    routed = _compiled_route(query, key, value, (score_mod, block_mask, scale, enable_gqa, mask, score), False)
    if routed is not None:
        out, lse = routed
        return (out, lse) if return_lse else out
    buffers, spec_id = _compiled_op_inputs((score_mod, block_mask, scale, enable_gqa, mask, score))
    op = torch.ops.flexattn.attention_fwd if _records_grad(query, key, value, *buffers) else \
        torch.ops.flexattn.attention_fwd_inference
    out, lse = op(query, key, value, buffers, spec_id, [], None)
    return (out, lse) if return_lse else out


def _compiled_route(query, key, value, call, want_max: bool):
    """(out, lse[, max_scores]) through torch's HOP (flexattn/torch/nested.py) where a score
    or mask= function was defined in the compiled code over tensors, or a torch block mask
    was built there; None otherwise (the compile-time preparation takes the call). The
    rest of the call is registered here."""
    score_mod, block_mask, scale, enable_gqa, mask, score = call
    the_score = score if score is not None else score_mod
    nested_score, nested_mask = captures_graph_values(the_score), captures_graph_values(mask)
    graph_lists = isinstance(block_mask, _TorchBlockMask) and made_in_traced_code(block_mask)
    if nested_score or nested_mask or graph_lists:
        if graph_lists and mask is not None:
            raise ValueError("pass either mask= or block_mask= (a block mask carries its own mask_mod)")
        if not compiling_for_inductor():
            return _route_whole_call(query, key, value, call, want_max)
        score_rest, mask_rest = (None if nested_score else the_score), (None if nested_mask else mask)
        _guard_numbers(score_rest, mask_rest)
        block_token = None if graph_lists else _block_mask_token(block_mask)
        base_id, sources, mask_sources = _prepare_for_compile(by_id(score_rest), block_token, scale, enable_gqa,
                                                              by_id(mask_rest), None)
        if sources or mask_sources or _score_tensors(score_rest):
            rest = [f for f in (score_rest, mask_rest) if f is not None]
            if not all(inspect.isfunction(f) for f in rest):
                raise TypeError("under torch.compile, a score or mask= function defined inside the compiled code"
                                " over tensors (or a torch block mask built there) cannot be combined with a mod"
                                " value that reads tensors (such as alibi(slopes)): write that one as a function")
            # Plain functions reading tensors (globals, closures made outside) go through torch's
            # HOP beside the nested ones: dynamo traces them there, their tensors lifted as graph inputs.
            nested_score, nested_mask = nested_score or score_rest is not None, nested_mask or mask_rest is not None
            base_id, _, _ = _prepare_for_compile(by_id(None), block_token, scale, enable_gqa, by_id(None), None)
        return flex_attention_route(query, key, value, the_score if nested_score else None,
                                    mask if nested_mask else None, base_id,
                                    query.shape[-1] ** -0.5 if scale is None else scale,
                                    block_mask if graph_lists else None, want_max)
    return None


def _route_whole_call(query, key, value, call, want_max: bool):
    """``_compiled_route`` where the graph may not reach Inductor, whose pass alone puts our
    op (and the parts registered for it) in place of torch's HOP: the whole call is torch's
    own ``flex_attention`` — functions, a torch block mask. A part it cannot take is a
    clear error, never silently left out."""
    score_mod, block_mask, scale, enable_gqa, mask, score = call
    the_score = score if score is not None else score_mod
    for role, fn in (("score", the_score), ("mask=", mask)):
        if fn is not None and not inspect.isfunction(fn):
            raise TypeError(f"under torch.compile with a backend other than Inductor, a {role} function defined"
                            " inside the compiled code (over tensors) runs through torch's flex_attention, which"
                            f" cannot take a flexattn mod value as the call's {role}: write that one as a"
                            " function too, or compile with Inductor (torch.compile's default backend), where"
                            " flexattn's kernels run")
    if block_mask is not None and not isinstance(block_mask, _TorchBlockMask):
        raise TypeError("under torch.compile with a backend other than Inductor, a score or mask= function defined"
                        " inside the compiled code (over tensors) runs through torch's flex_attention, which"
                        " cannot take a flexattn BlockMask: pass a torch BlockMask (torch's create_block_mask) or"
                        " a mask= function, or compile with Inductor (torch.compile's default backend)")
    if block_mask is not None and mask is not None:
        raise ValueError("pass either mask= or block_mask= (a block mask carries its own mask_mod)")
    return torch_flex_call(query, key, value, the_score, mask, block_mask, scale, enable_gqa, want_max)


def _compiled_op_inputs(call) -> tuple:
    """``(buffers, spec id)`` of a call being compiled (traced by dynamo): its mod functions'
    numbers guarded, the spec registered at compile time, the score's tensors read where
    dynamo sees them."""
    score_mod, block_mask, scale, enable_gqa, mask, score = call
    _guard_numbers(score_mod, mask, score)
    spec_id, sources, mask_sources = _prepare_for_compile(by_id(score_mod), _block_mask_token(block_mask), scale,
                                                          enable_gqa,
                                                          by_id(mask), by_id(score))
    mask_tensors = [_follow(mask, path) for path in mask_sources]
    return _compiled_score_tensors(score if score is not None else score_mod, sources) + mask_tensors, spec_id


def _compiled_score_tensors(the_score, sources) -> list:
    """The op's buffers under compile: a mod value's tensors, or those a plain score
    function reads from its closure cells, globals or defaults — or a helper function's
    (``sources``: paths found while compiling). Dynamo traces these reads, so the tensors
    are graph inputs (new values never recompile; gradients reach them)."""
    if isinstance(the_score, Mod) or not sources:
        return _score_tensors(the_score)
    return [_follow(the_score, path) for path in sources]


def _follow(fn, path):
    """The object at ``path`` ((kind, key) steps, see ``_tensor_sources``) from ``fn``."""
    obj = fn
    for kind, key in path:
        if kind == "cell":
            obj = obj.__closure__[key].cell_contents
        elif kind == "global":
            obj = obj.__globals__[key]
        else:
            obj = obj.__defaults__[key]
    return obj


def _tensor_sources(fn, mod, role: str = "score_mod") -> tuple:
    """Where a plain mod function keeps each tensor its trace captured (capture order):
    a path of ("cell", i) / ("global", name) / ("default", i) steps from the function,
    through helper functions it calls (as tracing follows them); a TypeError for tensors it
    reaches otherwise (through an object's attribute)."""
    reachable = {}
    for path, value in _reachable_values(fn):
        if _is_tensor(value):
            reachable.setdefault(id(value), path)
    sources = []
    for c in mod.captures:
        if not _is_tensor(c):
            continue
        path = reachable.get(id(c))
        if path is None:
            maker = "score_mod" if role == "score_mod" else "mask_mod"
            raise TypeError(f"under torch.compile, a {role}= function reads a tensor that is not one of its"
                            " (or its helpers') closure variables, globals or defaults (e.g. self.bias): make it a"
                            f" mod value outside the compiled function (flexattn.{maker}(fn), e.g. in __init__)")
        sources.append(path)
    return tuple(sources)


@assume_constant_result
def _numbers_seen(fn) -> tuple:
    """(path, value) of the global numbers a plain mod function can read (``_follow``
    paths), as they are while compiling."""
    if not inspect.isfunction(fn):
        return ()
    # Globals only (also of helper functions reached through globals): a closure made
    # inside the compiled code is traced by dynamo itself (its cells cannot be read there).
    return tuple((path, float(value)) for path, value in _reachable_values(fn)
                 if all(kind == "global" for kind, _ in path)
                 and isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool))


def _guard_numbers(*fns) -> None:
    """Make dynamo guard on the numbers plain mod functions read: each is read again in
    traced code and compared with the value the compile-time trace (or block mask) saw,
    so a changed number recompiles instead of going unseen."""
    for fn in fns:
        if fn is None or isinstance(fn, (Mod, _CoreBlockMask)):
            continue
        for path, value in _numbers_seen(fn):
            if _follow(fn, path) != value:   # never true: dynamo's guard recompiles first
                raise RuntimeError("flexattn: a mod's number changed during a compiled call")


@assume_constant_result
def _prepare_for_compile(score_mod, block_mask, scale, enable_gqa, mask, score) -> tuple:
    """Trace/normalize the non-tensor arguments into a pinned registry entry (plain Python:
    dynamo calls this on the real objects at compile time and bakes in the result):
    ``(spec id, score tensor sources, mask tensor sources)``, the sources
    (``_tensor_sources``) where the score mod / the mask is a plain function capturing
    tensors, else (): the mask's then travel as op inputs after the score's (the registry
    entry's ``masks``). Mods and block masks arrive as
    ``core.registry.by_id`` made them: some torch versions (2.11) hand an
    ``assume_constant_result`` function only constants, never user objects; dynamo
    evaluates id() of an object at compile time and guards on its identity (ID_MATCH)."""
    block_mask = stashed(block_mask)
    _check_compiled_block_mask(from_id(block_mask))
    spec = compiled_spec(score_mod, block_mask, scale, enable_gqa, mask, score, _is_tensor, "torch.compile",
                         function_operands=("score_mod", "score", "mask"))
    fn = from_id(score if score is not None else score_mod)
    sources = () if fn is None or isinstance(fn, Mod) else _tensor_sources(fn, spec.score)
    mask_fn = from_id(mask)
    mask_sources = () if mask_fn is None or isinstance(mask_fn, Mod) else _tensor_sources(mask_fn, spec.mask, "mask")
    return _REGISTRY.register(spec, pin=True, masks=bool(mask_sources)), sources, mask_sources


def _block_mask_token(block_mask):
    """What the compile-time preparation receives for a block mask: ``by_id``'s handle; for
    a torch ``BlockMask`` made outside the compiled code, its ``nested.object_token`` (torch
    2.11's dynamo hands constant functions no user objects, and torch's class is not ours
    to register)."""
    if isinstance(block_mask, _TorchBlockMask):
        return object_token(block_mask)
    return by_id(block_mask)


def _check_compiled_block_mask(block_mask) -> None:
    """A torch ``BlockMask`` made inside the compiled function reaches the compile-time
    preparation without its lists (they are values of the graph, which the kernels cannot
    take as constants): say what works instead of failing on a missing attribute."""
    if block_mask is None or isinstance(block_mask, _CoreBlockMask):
        return
    try:
        as_block_mask(block_mask)
    except Exception as e:
        raise TypeError(
            "under torch.compile, flex_attention got a torch BlockMask built inside the compiled function"
            " (torch's create_block_mask or BlockMask.from_kv_blocks there): its lists are values of the graph."
            " Build it with flexattn.torch.create_block_mask (inside the compiled function too: it becomes a"
            " constant of the graph), or outside the compiled function") from e
