"""PyTorch adapter: ``flexattn.torch.flex_attention`` with torch's signature and autograd.

Tensors in, tensors out, on the caller's device and dtype. CUDA tensors (bf16/fp16; head
dims: see ``core.kernel_path``) run the CuTeDSL Hopper kernels on the current stream,
forward and backward;
CPU tensors run the exact numpy reference. Gradients flow to query, key, value and to
captured float tensors of score mods (trainable biases, slopes, tables).

The computation is a ``torch.library`` custom op pair, ``flexattn::attention_fwd`` and
``flexattn::attention_bwd`` (fake implementations + ``register_autograd``), so
``torch.compile(fullgraph=True)`` sees one opaque node (graphs that record no backward:
``flexattn::attention_fwd_inference``, the forward without an autograd layer). Mods are not tensors: everything
that is not a tensor (mods' IR, non-tensor captures, block mask, scale, GQA) lives in a
spec registry (``core.registry.SpecRegistry``) under an int the op receives; the score mod's captured
tensors travel as a ``Tensor[]`` input, so autograd reaches them and their current
values are read at run time. See docs/ARCHITECTURE.md, "torch.compile".

Modules: this one holds the public API, the eager autograd layer and decoding;
``compiled.py`` torch.compile's route into the custom ops; ``ops.py`` the custom ops;
``launches.py`` the kernels on torch tensors;
``devices.py`` the CUDA device facts every route shares; ``nested.py`` / ``graph_walk.py``
/ ``tensor_eval.py`` torch.compile's traced code; ``context_parallel.py`` several GPUs.
"""

from __future__ import annotations

import contextvars
import inspect
import types

import numpy as np
import torch

from . import tensor_eval
from ..blockmask import BlockMask as _CoreBlockMask, create_block_mask as _create_block_mask
from ..blockmask.layout import _LIST_NAMES, as_block_mask, as_class
from ..bounded import keep_bounded
from ..problem import bounds
from ..problem.decode import decode_problem, decode_spec
from ..core.decode_device import cache_arrays, check_cache_layout, decode_key, kernel_step, tma_ready
from ..core.kernel_path import Device, PreparedForward, backward_unsupported, kernel_unsupported, prepare_forward
from ..core.prepared import PreparedCalls, PreparedEntry, call_key
from ..core.registry import by_id, from_id
from ..problem.kvcache import KVCache, PagedKVCache
from ..problem.spec import AttentionSpec, lse_dtype
from ..problem.validate import check_inputs
from .. import mods as _mods
from ..blockmask.build import dense_mask
from ..mods import MaskMod, Mod, ScoreMod, mask_mod
from .devices import (_DeviceCopies, _backward_alloc, _current_raw_stream, _decode_workspace, _forward_device,
                      _sm_count, _written_empty)
from .launches import (_PreparedBackward, _backward_arrays, _buffer_grads, _grad_mask, _is_tensor, _kernel_backward,
                       _kernel_forward)
from .ops import _INFERENCE_OPS, _REGISTRY, _float_grads, _records_grad, _row_walk_call, _score_tensors
from .compiled import _compiled_call, _compiled_op_inputs, _compiled_route, _guard_numbers
from .nested import captures_graph_values

__all__ = ["flex_attention", "decode", "create_block_mask", "create_mask", "BlockMask", "KVCache", "PagedKVCache",
           "MaskMod", "ScoreMod", "mask_mod", "and_masks", "or_masks", "noop_mask", "FlexKernelOptions",
           "AuxRequest", "AuxOutput"]

# torch's helpers, framework-free (mods/builtins.py): mask values that trace, compose with
# ``& |`` and are callable like torch's functions.
and_masks, or_masks, noop_mask = _mods.and_masks, _mods.or_masks, _mods.noop_mask
from torch.nn.attention.flex_attention import BlockMask as _TorchBlockMask   # (converted; built in compiled code: nested.py)
from torch.nn.attention.flex_attention import create_block_mask as _torch_create_block_mask   # (masks over tensors, compiled)
try:   # the type of kernel_options= (a TypedDict in torch): accepted, its keys are advisory
    from torch.nn.attention.flex_attention import FlexKernelOptions
except ImportError:
    FlexKernelOptions = dict
try:   # return_aux=: torch's own types where it has them
    from torch.nn.attention.flex_attention import AuxOutput, AuxRequest
except ImportError:
    from typing import NamedTuple

    class AuxRequest(NamedTuple):
        """Which auxiliary outputs ``flex_attention(..., return_aux=)`` computes."""
        lse: bool = False
        max_scores: bool = False

    class AuxOutput(NamedTuple):
        """The auxiliary outputs asked for (None where not)."""
        lse: torch.Tensor | None = None
        max_scores: torch.Tensor | None = None


class BlockMask(_CoreBlockMask):
    """flexattn's ``BlockMask`` whose index lists are torch tensors, as torch's are (int32;
    a host-built mask's on the CPU, a GPU-built mask's on its device): what
    ``create_block_mask``, ``BlockMask.from_kv_blocks``, slicing, ``to`` and ``update`` of
    this module return. The kernels read the lists as kept (``list_array``)."""

    def _present(self, name: str):
        array = self._lists[name]
        if not isinstance(array, np.ndarray):
            return array
        if torch.compiler.is_dynamo_compiling():
            # (in traced code: a copy in the graph, none kept — keeping it would be a side
            # effect that dynamo replays after every call of the compiled function)
            t = self.__dict__.get("_tensors", {}).get(name)
            return torch.from_numpy(np.array(array)) if t is None else t
        tensors = self.__dict__.setdefault("_tensors", {})
        t = tensors.get(name)
        if t is None:   # a copy: the host lists are read-only, and stay the kernels'
            t = tensors[name] = torch.from_numpy(np.array(array))
        return t

    def __getitem__(self, index):
        """torch's slicing. Inside code dynamo traces (gpt-fast's decoding step slices its
        block mask by ``input_pos // BLOCK_SIZE``, a tensor of the graph) the lists are
        sliced as torch's ``BlockMask`` slices them, in the graph: the result is a torch
        ``BlockMask`` with this one's lists and ``mask_mod`` (our mods evaluate on tensors:
        ``tensor_eval``), which ``flex_attention`` takes as it takes torch's."""
        if torch.compiler.is_dynamo_compiling():
            where = next((i.device for i in (index if isinstance(index, tuple) else (index,))
                          if isinstance(i, torch.Tensor)), None)
            return self._as_torch(where)[index]
        return super().__getitem__(index)

    @property
    def mask_mod(self):
        """The mask (a ``MaskMod``). Inside code dynamo traces, a plain function of torch
        tensors evaluating it (``tensor_eval``): what torch code does with a block mask's
        mask_mod there — wrap it in a closure, hand it to torch's flex HOP — then meets
        only a function, as with torch's own block masks."""
        mod = self._mask_mod
        if mod is None:
            return super().mask_mod     # (a slice's: unset, its getter says so)
        return _mask_function(mod.expr, mod.captures) if torch.compiler.is_dynamo_compiling() else mod

    @mask_mod.setter
    def mask_mod(self, value):
        _CoreBlockMask.mask_mod.__set__(self, value)

    def _as_torch(self, device=None) -> _TorchBlockMask:
        """This block mask as torch's ``BlockMask``: the same list tensors and mask; with
        ``device`` (a slice's index tensor's, in traced code), lists elsewhere (a host-built
        mask's, sliced by a CUDA index) copied there in the graph, as torch's slicing needs."""
        lists = [self._present(name) for name in _LIST_NAMES]
        if device is not None and any(t.device != device for t in lists):
            _warn_lists_copied(str(device))
            lists = [t.to(device) for t in lists]
        return _TorchBlockMask(self.seq_lengths, *lists, BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=self.mask_mod)


@torch._dynamo.assume_constant_result
def _warn_lists_copied(device: str) -> bool:
    """(at compile time) A host-built block mask sliced by an index on ``device`` in compiled
    code: its lists go there in every call."""
    import warnings

    warnings.warn(f"flexattn: a block mask built on the host is sliced by a {device} index inside compiled code: its"
                  f" lists are copied to {device} in every call; build it there (create_block_mask(...,"
                  f" device={device!r}), torch's default) to slice it in place", stacklevel=2)
    return True


def _mask_function(expr, captures):
    """A mask's IR as a plain function of torch tensors (``BlockMask.mask_mod`` in traced code)."""
    def mask_mod(b, h, q_idx, kv_idx):
        return tensor_eval.evaluate(expr, {"b": b, "h": h, "q": q_idx, "kv": kv_idx}, captures)
    return mask_mod


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, _compile=False,
                      separate_full_blocks: bool = True, compute_dq_write_order: bool = False,
                      dq_kv_order: bool = True) -> BlockMask:
    """torch's ``create_block_mask`` (``flexattn.blockmask.create_block_mask``: host or GPU
    lists, torch's argument order and keywords; the lists come back as torch tensors).

    Inside a function ``torch.compile`` traces, the block mask is built once, while
    compiling, and is a constant of the graph (its handle goes to ``flex_attention`` of the
    same graph; sizes are the traced ones, so new sizes recompile, as torch guards them).
    A mask function that reads tensors (they could change between calls) is built by
    torch's ``create_block_mask`` there instead, its lists values of the graph computed
    each call (``flex_attention`` takes such a block mask through torch's HOP, nested.py);
    a mod value reading tensors is refused: build it outside the compiled function.

    ``device=None`` is torch's default: the current accelerator (CUDA: the lists are built
    and kept there, as torch's are), the host where there is none."""
    device = _default_device(device)
    if torch.compiler.is_compiling():
        if inspect.isfunction(mask_mod) and (captures_graph_values(mask_mod) or _reads_tensors(by_id(mask_mod))):
            return _torch_create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu" if device is None else device,
                                            BLOCK_SIZE=BLOCK_SIZE)
        _guard_numbers(mask_mod)
        return _block_mask_while_compiling(by_id(mask_mod), B, H, Q_LEN, KV_LEN,
                                           None if device is None else str(device), BLOCK_SIZE, separate_full_blocks)
    return as_class(_create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, _compile,
                                       separate_full_blocks, compute_dq_write_order, dq_kv_order), BlockMask)


_COMPILED_BLOCK_MASKS: list = []   # built while compiling: graphs hold their handles


# Mods made in code dynamo traces (``mods.causal()`` in a compiled ``forward``): dynamo
# cannot trace our tracer, so such a mod is made in plain Python at compile time — from its
# recipe: the built-in's name or the operator, and its arguments as constants (mods by
# identity) — and kept as an attribute of this namespace; the traced code reads it back
# from there, so dynamo sees an object with a source, as for a mod made outside, guarded
# by identity (each recipe has an attribute of its own: no guard sees the others).
_MADE_WHILE_TRACED = types.ModuleType("flexattn.torch.mods_made_while_traced")
_RECIPES: dict = {}   # recipe -> attribute name


def _made_while_traced(kind, name, args, kwargs):
    """``mods.mod.MADE_ELSEWHERE``: in code dynamo traces, the mod of a built-in's call or
    an operator, made at compile time; None elsewhere (made as usual)."""
    if not torch.compiler.is_dynamo_compiling():
        return None
    if kind == "call" and name in ("mask_mod", "score_mod"):
        _refuse_mods_made_in_traced_code("a plain function's mod (score_mod(fn), mask_mod(fn))")
    parts = [*args, *kwargs.values()]
    if any(_is_tensor(a) or isinstance(a, np.ndarray) for a in _flat(parts)):
        _refuse_mods_made_in_traced_code(f"{name} of tensors")
    encoded = tuple(("mod", id(a)) if isinstance(a, _mods.Mod) else a for a in args)
    return getattr(_MADE_WHILE_TRACED, _mod_from_recipe(kind, name, encoded, tuple(kwargs.items())))


def _flat(values):
    for v in values:
        if isinstance(v, (tuple, list)):
            yield from _flat(v)
        else:
            yield v


@torch._dynamo.assume_constant_result
def _mod_from_recipe(kind, name, args, kwargs) -> str:
    """The attribute of ``_MADE_WHILE_TRACED`` holding the mod of this recipe, made now (plain
    Python, at compile time) if it is new."""
    recipe = _hashable((kind, name, args, kwargs))
    attribute = _RECIPES.get(recipe)
    if attribute is None:
        decoded = [_mods.mod.LIVE_OBJECTS[a[1]] if isinstance(a, tuple) and len(a) == 2 and a[0] == "mod" else a
                   for a in args]
        if kind == "call":
            mod = _mods.mod.BUILT_INS[name](*decoded, **dict(kwargs))
        else:
            mod = getattr(decoded[0], name)(*decoded[1:])
        attribute = f"mod{len(_RECIPES)}"
        setattr(_MADE_WHILE_TRACED, attribute, mod)
        _RECIPES[recipe] = attribute
    return attribute


def _hashable(value):
    """A recipe as a dict key: lists (document lengths) as tagged tuples."""
    if isinstance(value, (list, tuple)):
        items = tuple(_hashable(v) for v in value)
        return ("list", items) if isinstance(value, list) else items
    return value


@torch._dynamo.assume_constant_result
def _refuse_mods_made_in_traced_code(what: str):
    raise TypeError(f"flexattn: {what} made inside a torch.compile'd function is not supported: make the mod"
                    " outside it (at module level or in __init__: mods are immutable values, their tensors read"
                    " at each call), or pass the plain function (score_mod=fn, mask=fn, create_block_mask(fn, ...)),"
                    " which works inside. Built-in mods of numbers (mods.causal(), mods.softcap(30.0), a & b) work"
                    " inside too")


_mods.mod.MADE_ELSEWHERE = _made_while_traced
_mods.mod.ARRAY_EVALUATORS.append((tensor_eval.is_tensor, tensor_eval.evaluate))   # mods called on tensors


@torch._dynamo.assume_constant_result
def _reads_tensors(mask_mod) -> bool:
    """Whether a mask function (``by_id`` handle) reads tensors, found by tracing it at
    compile time (plain Python)."""
    mask = _mods.as_mask(from_id(mask_mod), "mask_mod")
    return any(_is_tensor(c) for c in mask.captures)


@torch._dynamo.assume_constant_result
def _block_mask_while_compiling(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, separate_full_blocks):
    """``create_block_mask`` at compile time (plain Python: dynamo runs it on the real
    arguments and bakes in its result): the mask's handle, ``("id", id(block_mask))`` as
    ``core.registry.by_id`` makes it, the block mask kept alive for the graphs."""
    mask = _mods.as_mask(from_id(mask_mod), "mask_mod") if mask_mod is not None else None
    if mask is not None and any(_is_tensor(c) for c in mask.captures):
        raise ValueError("create_block_mask inside a torch.compile'd function: this mask reads tensors, which"
                         " may change between calls while the graph keeps its block mask; build it with torch's"
                         " create_block_mask there (its lists stay values of the graph), or outside the compiled"
                         " function (or pass mask= to flex_attention)")
    block_mask = _create_block_mask(mask, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE,
                                    separate_full_blocks=separate_full_blocks)
    _COMPILED_BLOCK_MASKS.append(block_mask)
    return ("id", id(block_mask))


def create_mask(mod_fn, B, H, Q_LEN, KV_LEN, device=None) -> torch.Tensor:
    """torch's ``create_mask``: the dense bool mask [B, H, Q_LEN, KV_LEN] of a mask mod, or
    where a score mod (given a zero score) is not -inf; computed on the host, put on
    ``device`` (default, as torch's: the current accelerator, else the CPU)."""
    return torch.from_numpy(dense_mask(mod_fn, B, H, Q_LEN, KV_LEN)).to(_default_device(device) or "cpu")


def _default_device(device):
    """torch's default for a mask's ``device=None``: the current accelerator
    (``torch.accelerator``), None (the host) on a machine without one."""
    if device is not None:
        return device
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return None if accelerator is None else str(accelerator)


def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod=None,
    block_mask=None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict | None = None,
    *,
    return_aux: AuxRequest | None = None,
    mask=None,
    score=None,
):
    """Drop-in for ``torch.nn.attention.flex_attention.flex_attention`` ([B, H, S, D] tensors).

    ``score_mod``: a ``ScoreMod`` or a function ``(score, b, h, q_idx, kv_idx) -> score``.
    ``block_mask``: a ``flexattn.BlockMask`` or torch's ``BlockMask`` (converted).
    ``mask=`` / ``score=``: our mod values; a ``mask`` without ``block_mask`` applies
    element-wise. Returns ``out`` or ``(out, lse)`` (lse in natural log; float32, float64 for float64 inputs);
    with ``return_aux=AuxRequest(lse=, max_scores=)``, ``(out, AuxOutput(lse, max_scores))``:
    ``max_scores`` [B, Hq, Q] is each row's max of the scaled, modded, masked scores (-inf
    where a row sees nothing), from the forward kernel itself on the GPU; not differentiable.

    Under ``torch.compile`` (``fullgraph=True`` works) a plain ``score_mod`` or ``mask=``
    function may read tensors from its globals, closure cells (closures made outside the
    compiled function) or defaults, and those of its helper functions: they become graph
    inputs (the score's get gradients; no recompiles). A ``score_mod`` defined inside the
    compiled code (closing over ``self.bias``, arguments, locals) goes through torch's
    flex HOP and an Inductor pass (``flexattn.torch.nested``; Inductor, the default
    backend, is needed). Other mods that capture tensors
    must be values built outside the compiled function (``ScoreMod``/``MaskMod``, e.g. in
    a module's ``__init__``); their captured tensors (parameters) still get gradients.
    Block masks may be built outside, or inside with ``create_block_mask`` (see there).
    """
    key, value = _broadcast_kv_batch(query, key, value)
    # (eager only: dynamo cannot trace a ContextVar, and context parallelism runs eagerly)
    parallel = None if torch.compiler.is_compiling() else CONTEXT_PARALLEL.get()
    if parallel is not None:   # inside a module parallelized with context_parallel.ContextParallelStyle
        from .context_parallel import flex_attention as parallel_attention

        if return_aux is not None:
            raise ValueError("return_aux is not supported under context parallelism: use return_lse=True")
        return parallel_attention(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                                  parallel=parallel, mask=mask, score=score)
    if return_aux is not None:
        if return_lse:
            raise ValueError("Cannot specify both return_lse and return_aux: use return_aux=AuxRequest(lse=True)")
        if not return_aux.max_scores:
            out, lse = flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa, True, kernel_options,
                                      mask=mask, score=score)
            return out, AuxOutput(lse=lse if return_aux.lse else None, max_scores=None)
        out, lse, max_scores = _with_max_scores(query, key, value, (score_mod, block_mask, scale, enable_gqa, mask, score),
                                                kernel_options)
        return out, AuxOutput(lse=lse if return_aux.lse else None, max_scores=max_scores)
    if torch.compiler.is_compiling():
        return _compiled_call(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, mask, score)
    if getattr(query, "is_nested", False) or getattr(key, "is_nested", False) or getattr(value, "is_nested", False):
        raise ValueError(
            "flexattn.torch.flex_attention takes dense [B, H, S, D] tensors, not nested (jagged) ones: pack the"
            " sequences into one [1, H, total, D] tensor and mask across them with"
            " flexattn.mods.document_from_offsets(offsets) (or flexattn.blockmask.varlen_block_mask(offsets) for the block mask)")
    call = (score_mod, block_mask, scale, enable_gqa, mask, score)
    if (getattr(block_mask, "_row_source", None) is not None and isinstance(query, torch.Tensor) and query.is_cuda
            and (kernel_options is None or isinstance(kernel_options, dict))):
        walked = _row_walk_call(query, key, value, call)
        if walked is not None:
            return walked if return_lse else walked[0]
    prepared_key = _call_key(query, key, value, call)
    repeated = _PREPARED.run(prepared_key, query, key, value, return_lse, call)
    if repeated is not None:  # a call like an earlier one: checks and plan already done
        out, lse = repeated
        return (out, lse) if return_lse else out
    spec, shape, records = _checked_call(query, key, value, call, kernel_options)
    if query.is_cuda and not records:
        # Inference: straight to the kernel. The custom op's dispatch alone costs
        # ~50-130 µs of host time per call; it is only needed for autograd.
        out, lse = _kernel_forward(spec, shape, query, key, value)
        _remember(prepared_key, query, call, spec, shape)
        return (out, lse) if return_lse else out
    buffers = _score_tensors(spec.score)
    if query.is_cuda and _plain_eager(query, key, value, *buffers):
        out, lse = _EagerAttention.apply(query, key, value, _FullStep(spec, shape), *buffers)
        _remember(prepared_key, query, call, spec, shape)   # the next steps skip checks and planning
        return (out, lse) if return_lse else out
    spec_id = _REGISTRY.register(spec)
    out, lse = torch.ops.flexattn.attention_fwd(query, key, value, buffers, spec_id, [], None)
    return (out, lse) if return_lse else out


def _broadcast_kv_batch(query, key, value) -> tuple:
    """torch's flex_attention broadcasts a key / value batch of 1 over the query's batch
    (one physical cache that every sequence's block mask points into: torch's
    ``PagedAttention``). The same here, as stride-0 views of the batch: the kernels read
    them in place (no copy per sequence), autograd sums their gradients over the batch.
    (Every call passes here: the key's batch, usually not 1, is tested first — ~0.3 µs
    instead of ~1.1 for testing each tensor in turn, on a CPU box.)"""
    if (isinstance(key, torch.Tensor) and key.dim() == 4 and key.shape[0] == 1
            and isinstance(query, torch.Tensor) and query.dim() == 4 and query.shape[0] > 1
            and isinstance(value, torch.Tensor) and value.dim() == 4 and value.shape[0] == 1
            and not (query.is_nested or key.is_nested or value.is_nested)):
        batch = query.shape[0]
        return key.expand(batch, *key.shape[1:]), value.expand(batch, *value.shape[1:])
    return key, value


def _with_max_scores(query, key, value, call, kernel_options):
    """(out, lse, max_scores) of a call that wants the row maxima: the forward kernel with
    its max output (CUDA inference: directly; otherwise through the ``attention_fwd_max``
    custom op, whose autograd is the forward's), the float64 reference on the CPU."""
    if torch.compiler.is_compiling():
        routed = _compiled_route(query, key, value, call, True)
        if routed is not None:
            return routed
        buffers, spec_id = _compiled_op_inputs(call)
        return torch.ops.flexattn.attention_fwd_max(query, key, value, buffers, spec_id, [], None)
    spec, shape, records = _checked_call(query, key, value, call, kernel_options)
    if query.is_cuda and not records:
        return _kernel_forward(spec, shape, query, key, value, want_max=True)
    return torch.ops.flexattn.attention_fwd_max(query, key, value, _score_tensors(spec.score), _REGISTRY.register(spec),
                                                [], None)


def _checked_call(query, key, value, call, kernel_options):
    """``(spec, shape, records)`` of an eager call, with what it cannot do as a clear error
    before any launch: argument types, shapes and, on CUDA, the forward kernel's limits and
    the backward's where autograd will need it (``records``: autograd records this CUDA
    call)."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if kernel_options is not None and not isinstance(kernel_options, dict):
        raise TypeError(f"kernel_options must be a dict or None, got {type(kernel_options).__name__}")
    spec = _spec_of(call)
    shape = check_inputs(query, key, value, spec)
    records = False
    if query.is_cuda:
        records = _records_grad(query, key, value, *_score_tensors(spec.score))
        reason = kernel_unsupported(query, shape) or (backward_unsupported(shape, query) if records else None)
        if reason:
            raise ValueError(f"{reason} (CPU tensors run the exact reference for anything else)")
    return spec, shape, records


def _spec_of(call) -> AttentionSpec:
    """The spec of ``call = (score_mod, block_mask, scale, enable_gqa, mask, score)``."""
    score_mod, block_mask, scale, enable_gqa, mask, score = call
    return AttentionSpec.from_args(score_mod, as_block_mask(block_mask), scale, enable_gqa, mask, score)


def _plain_eager(*tensors) -> bool:
    """Plain tensors, no dispatch mode or functorch transform around the call: autograd may
    record the kernels through ``_EagerAttention`` instead of the custom ops (whose
    dispatch costs ~50-130 µs of host time per op). Anything else (fake / functional
    tensors, tracing modes, subclasses, ``torch.func``) takes the custom ops."""
    if torch._C._len_torch_dispatch_stack() != 0:
        return False
    is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return all(type(t) is torch.Tensor and not is_wrapped(t) for t in tensors)


class _EagerAttention(torch.autograd.Function):
    """The custom ops' autograd formula for eager CUDA calls, without their dispatch: the
    same kernels, saved tensors and gradients (``_attention_fwd`` / ``_attention_bwd``).
    Inputs: q, k, v, the ``step`` that launches the kernels (``_FullStep``: checked and
    planned this call; ``_PreparedStep``: a repeated call's prepared launches), then the
    score mod's tensors."""

    @staticmethod
    def forward(ctx, query, key, value, step, *buffers):
        out, lse = step.forward(query, key, value)
        ctx.save_for_backward(query, key, value, out, lse, *buffers)
        ctx.step = step
        ctx.grad_mask = _grad_mask(buffers)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        query, key, value, out, lse, *buffers = ctx.saved_tensors
        if d_out is None and d_lse is None:
            return (None,) * (4 + len(buffers))
        if d_out is None:
            d_out = torch.zeros_like(out)
        dq, dk, dv, d_buffers = ctx.step.backward(query, key, value, out, lse, d_out, d_lse, buffers, ctx.grad_mask)
        return (dq, dk, dv, None, *_float_grads(buffers, d_buffers))


class _FullStep:
    """A training call checked and planned now (``_checked_call``): the kernels through
    ``forward_into`` / ``backward_into``."""

    __slots__ = ("spec", "shape")

    def __init__(self, spec, shape):
        self.spec, self.shape = spec, shape

    def forward(self, query, key, value):
        return _kernel_forward(self.spec, self.shape, query, key, value)

    def backward(self, query, key, value, out, lse, d_out, d_lse, buffers, grad_mask):
        return _kernel_backward(self.spec, self.shape, query, key, value, out, lse, d_out, d_lse, buffers, grad_mask)


class _PreparedStep:
    """A repeated training call (``_PreparedCall``): the forward's prepared launch, and the
    backward's once one ran for the same deterministic setting and buffer gradients
    (``_PreparedBackward``, attached to the entry by the first backward of this kind,
    which runs the full path). Holds the call (its mods) for that full path; the entry
    holds no mod."""

    __slots__ = ("entry", "call")

    def __init__(self, entry, call):
        self.entry, self.call = entry, call

    def forward(self, query, key, value):
        entry = self.entry
        out = _written_empty(entry.out_shape, dtype=entry.dtype, device=entry.device)
        lse = _written_empty(entry.lse_shape, dtype=torch.float32, device=entry.device)
        entry.launch(query.detach(), key.detach(), value.detach(), out, lse, None)
        return out, lse

    def backward(self, query, key, value, out, lse, d_out, d_lse, buffers, grad_mask):
        prepared = self.entry.backward
        deterministic = torch.are_deterministic_algorithms_enabled()
        if (prepared is not None and prepared.kernels.deterministic == deterministic
                and prepared.grad_mask == grad_mask and query.device.index == torch.cuda.current_device()):
            # dq, dk, dv allocated once the preprocess is launched (`FfiBackwardRunner.run`):
            # where the host is the bound, their allocations overlap its GPU work (H200,
            # B8 S2048 fwd+bwd at the door, document4 / window1024: 0.5% faster, session 40).
            arrays = _backward_arrays(query, key, value, out, lse, d_out, d_lse, outputs_later=True)
            grads = []

            def outputs():
                grads.extend(_written_empty(x.shape, dtype=x.dtype, device=x.device) for x in (query, key, value))
                return grads

            capture_grads = prepared.kernels.launch(arrays, _backward_alloc(query.device), outputs=outputs)
            dq, dk, dv = grads
            return dq, dk, dv, _buffer_grads(prepared.tensor_slots, capture_grads, buffers)
        spec = _spec_of(self.call)
        shape = check_inputs(query, key, value, spec)
        grads = _kernel_backward(spec, shape, query, key, value, out, lse, d_out, d_lse, buffers, grad_mask)
        self.entry.backward = _PreparedBackward.make(spec, shape, query, deterministic, grad_mask)
        return grads


def decode(query: torch.Tensor, cache, score_mod=None, mask=None, scale=None, return_lse=False):
    """Decoding step on a ``KVCache``/``PagedKVCache`` of torch tensors.

    ``query`` [B, Hq, q_len, D] holds the last q_len tokens of each sequence (append their
    K/V to the cache first); mods see true positions; GQA is implicit. CUDA inputs with
    q_len <= 16 that the kernel takes (``decode_device.kernel_step``: bf16/fp16, head dims
    multiples of 16 from 32 to 256, pages it reads in place) run the split-KV decode kernel (GQA heads packed,
    blocks past each sequence's length or before its mask's first key skipped; inference
    only — with autograd recording, the step goes through ``flex_attention``); anything
    else is an ordinary attention problem (the forward kernel on CUDA tensors, the CPU
    reference on CPU ones; paged caches then gathered into logical order).

    A step like an earlier one — the same mod objects (``Mod`` values), scale, cache type,
    query / K / V / page-table / lengths metadata, device and current stream — skips the
    checks and the planning (``_PreparedDecode``): it reads the lengths, allocates the
    outputs and launches. Steps are queued without waiting for the GPU; steps on one
    stream from several threads are serialized around their upload and launch.
    """
    if torch.compiler.is_compiling():
        return _decode_in_graph(query, cache, score_mod, mask, scale, return_lse)
    call = (score_mod, None, scale, True, mask, None)
    key = None
    if bounds.enabled():   # the debug mode: the step's reads checked, as flex_attention's
        k, v, spec = decode_problem(query, cache, score_mod, mask, scale)
        check_inputs(query, k, v, spec)
    if type(query) is torch.Tensor and query.is_cuda:
        key = decode_key(call, query, cache, _step_facts)
        repeated = _DECODES.run(key, query, cache, return_lse)
        if repeated is not None:
            return repeated if return_lse else repeated[0]
    if (isinstance(query, torch.Tensor) and query.is_cuda and kernel_step(query, cache)
            and not (torch.is_grad_enabled() and _cache_requires_grad(query, cache))):
        out, lse, step = _kernel_decode(query, cache, score_mod, mask, scale, launch=None)
        if key is not None:
            _DECODES.add(key, call, lambda: _PreparedDecode(step.plan, query, cache))
        return (out, lse) if return_lse else out
    k, v, spec = decode_problem(query, cache, score_mod, mask, scale)
    return flex_attention(query, k, v, score=spec.score, mask=spec.mask, scale=spec.scale,
                          enable_gqa=True, return_lse=return_lse)


def _decode_in_graph(query, cache, score_mod, mask, scale, return_lse):
    """``decode`` under torch.compile: the step as ``flex_attention`` over the cache's
    tensors, whose short-query route (``core/short_query.py``) takes the decode kernel on
    CUDA. The eager step reads the lengths on the host (its checks and its mods' shifted
    positions); here they stay a tensor of the graph, read per batch in the mask and the
    score (``lengths[b]``), so a new step's lengths neither break the graph nor recompile.
    A contiguous ``KVCache`` with torch ``lengths`` only, made outside the compiled code
    (its constructor checks the lengths on the host); mods as torch-style functions, or as
    mod values (``_decode_mods_in_graph``), not one of each. The lengths are not checked
    here (the debug mode checks the mods' reads)."""
    if isinstance(cache, PagedKVCache):
        return _decode_paged_in_graph(query, cache, score_mod, mask, scale, return_lse)
    if not isinstance(cache, KVCache):
        raise TypeError(f"decode under torch.compile takes a KVCache or PagedKVCache, not {type(cache).__name__}")
    lengths = cache.lengths
    if not isinstance(lengths, torch.Tensor):
        raise TypeError("decode under torch.compile needs the cache's lengths as a torch tensor (the graph reads "
                        f"them per step), got {type(lengths).__name__}")
    if query.dim() != 4:
        raise ValueError(f"query must be 4-D [B, H, q_len, D], got shape {tuple(query.shape)}")
    given = [m for m in (score_mod, mask) if m is not None]
    if all(isinstance(m, Mod) for m in given):
        return _decode_mods_in_graph(query, cache, score_mod, mask, scale, return_lse)
    if any(isinstance(m, Mod) for m in given):
        raise TypeError("decode under torch.compile takes score_mod= and mask= both as mod values or both as"
                        " torch-style functions, not one of each: write the mod value as a function of"
                        " (b, h, q_idx, kv_idx), or make the function a mod value outside the compiled code")
    # Query row i is position lengths[b] - q_len + i: the shift as a tensor of the graph (under
    # dynamic shapes q_len is symbolic, which a function defined here must not compute with).
    shift = lengths - query.shape[2]

    def step_mask(b, h, q_idx, kv_idx):      # the valid keys; mods see true positions
        keep = kv_idx < lengths[b]
        return keep if mask is None else keep & mask(b, h, q_idx + shift[b], kv_idx)

    def step_score(score, b, h, q_idx, kv_idx):
        return score_mod(score, b, h, q_idx + shift[b], kv_idx)

    return flex_attention(query, cache.k, cache.v, score_mod=None if score_mod is None else step_score,
                          mask=step_mask, scale=scale, enable_gqa=True, return_lse=return_lse)


def _decode_paged_in_graph(query, cache, score_mod, mask, scale, return_lse):
    """``_decode_in_graph`` for a ``PagedKVCache``: one op (``flexattn::decode_paged``) whose
    call is the eager step over the graph's pages, page table and lengths (read on the
    host per step, as the eager step reads them; new values never recompile). Its mods are
    made outside the compiled code (mod values, or functions whose tensors become graph
    inputs, as ``flex_attention``'s); inference only."""
    for name, fn in (("score_mod", score_mod), ("mask", mask)):
        if captures_graph_values(fn):
            raise TypeError(f"decode under torch.compile with a PagedKVCache takes a {name}= made outside the"
                            " compiled code (a mod value, or a function over tensors made there): this one is"
                            " defined inside it over tensors")
    for name in ("page_table", "lengths"):
        if not isinstance(getattr(cache, name), torch.Tensor):
            raise TypeError(f"decode under torch.compile needs the PagedKVCache's {name} as a torch tensor (the graph"
                            f" reads it per step), got {type(getattr(cache, name)).__name__}")
    buffers, spec_id = _compiled_op_inputs((score_mod, None, scale, True, mask, None))
    if _records_grad(query, cache.k_pages, cache.v_pages, *buffers):
        raise TypeError("decode under torch.compile with a PagedKVCache is inference only: call it under"
                        " torch.no_grad() (or detach the query and cache)")
    out, lse = torch.ops.flexattn.decode_paged(query, cache.k_pages, cache.v_pages, cache.page_table, cache.lengths,
                                               buffers, spec_id)
    return (out, lse) if return_lse else out


def _decode_paged_impl(query, k_pages, v_pages, page_table, lengths, buffers, spec_id):
    """``flexattn::decode_paged``: the eager step (``decode``) over these pages with the
    registered mods bound to this call's buffers (kept per buffer objects, so that repeated
    steps find the same mod objects and the eager step's prepared plan)."""
    key = (spec_id, tuple(id(b) for b in buffers))
    hit = _PAGED_BINDINGS.get(key)
    if hit is None:
        hit = (_REGISTRY.bind_operands(spec_id, buffers), tuple(buffers))   # (the buffers kept: their ids stay)
        keep_bounded(_PAGED_BINDINGS, key, hit, 16)
    spec = hit[0]
    cache = PagedKVCache(k_pages, v_pages, page_table, lengths)
    return decode(query, cache, score_mod=spec.score, mask=spec.mask, scale=spec.scale, return_lse=True)


def _decode_paged_fake(query, k_pages, v_pages, page_table, lengths, buffers, spec_id):
    batch, heads, q_len, _ = query.shape
    out = query.new_empty(batch, heads, q_len, v_pages.shape[-1])
    return out, query.new_empty(batch, heads, q_len, dtype=getattr(torch, lse_dtype(query)))


_PAGED_BINDINGS: dict = {}   # (spec id, buffer ids) -> (bound spec, buffers): decode_paged's calls


def _decode_mods_in_graph(query, cache, score_mod, mask, scale, return_lse):
    """``_decode_in_graph`` for mod values (or none): the eager step's spec
    (``decode_spec``), registered at compile time with stand-ins for the per-step query
    offsets and lengths, which the graph computes from the cache's lengths tensor and
    hands our op as buffers beside the mods' own tensors (read from the mod values, which
    dynamo guards by identity). Our op on every backend, no HOP."""
    lengths = cache.lengths
    spec_id, origins = _prepare_decode_for_compile(by_id(score_mod), by_id(mask), scale,
                                                   str(lengths.dtype).removeprefix("torch."))
    per_step = {"offsets": lengths - query.shape[2], "lengths": lengths}
    mods_ = {"score": score_mod, "mask": mask}
    buffers = [per_step[o] if isinstance(o, str) else mods_[o[0]].captures[o[1]] for o in origins]
    op = torch.ops.flexattn.attention_fwd if _records_grad(query, cache.k, cache.v, *buffers) else \
        torch.ops.flexattn.attention_fwd_inference
    out, lse = op(query, cache.k, cache.v, buffers, spec_id, [], None)
    return (out, lse) if return_lse else out


@torch._dynamo.assume_constant_result
def _prepare_decode_for_compile(score_mod, mask, scale, lengths_dtype: str) -> tuple:
    """``(spec id, buffer origins)`` of a compiled decode step over mod values (plain Python
    at compile time, as ``_prepare_for_compile``): ``decode_spec`` with stand-in tensors for
    the offsets and lengths, registered with the mask's tensors as op buffers too. Each
    origin names where the graph finds that buffer: "offsets", "lengths", or (role,
    capture index) of the score / mask mod value."""
    score_mod, mask = from_id(score_mod), from_id(mask)
    dtype = getattr(torch, lengths_dtype)
    offsets, lengths = torch.zeros(1, dtype=dtype), torch.zeros(1, dtype=dtype)
    spec = decode_spec(score_mod, mask, offsets, lengths, scale)
    origins = {id(offsets): "offsets", id(lengths): "lengths"}
    for role, m in (("score", score_mod), ("mask", mask)):
        for i, c in enumerate(m.captures if m is not None else ()):
            origins.setdefault(id(c), (role, i))
    found = [origins[id(c)] for m in (spec.score, spec.element_mask) if m is not None
             for c in m.captures if _is_tensor(c)]
    return _REGISTRY.register(spec, pin=True, masks=True), tuple(found)


def _cache_requires_grad(query, cache) -> bool:
    return query.requires_grad or any(getattr(a, "requires_grad", False) for a in cache_arrays(cache)[:2])


def _kernel_decode(query, cache, score_mod, mask, scale, launch=True):
    """The split-KV decode kernel on the current stream -> (out, lse); with ``launch``
    False (out, lse, the planned ``DecodeLaunch``) without running it (benchmarks); with
    ``launch`` None, launched, (out, lse, the ``DecodeLaunch``)."""
    from ..core.decode_path import DecodeMods, DecodeSite, decode_into, prepare_decode

    dev = query.device
    check_cache_layout(cache, lambda x: x.stride() if isinstance(x, torch.Tensor) and x.device == dev else None,
                       f"a torch tensor on the query's device {dev}")
    q = query.detach()
    if not tma_ready(q.stride()):
        q = q.contiguous()
    B, Hq, q_len, D = q.shape
    out = torch.empty(B, Hq, q_len, D, dtype=q.dtype, device=dev)
    lse = torch.empty(B, Hq, q_len, dtype=torch.float32, device=dev)
    table = None
    if hasattr(cache, "page_table"):
        table = torch.as_tensor(cache.page_table).to(device=dev, dtype=torch.int32)
        if not table.is_contiguous():
            table = table.contiguous()
    num_sms = _sm_count(dev)

    with torch.cuda.device(dev):
        stream = torch.cuda.current_stream(dev)
        copies = _DeviceCopies(dev)
        site = DecodeSite(Device(stream.cuda_stream, copies, tvm_ffi_stream=True, same_memory=copies.same_memory),
                          num_sms, _decode_workspace(dev, stream))
        run = prepare_decode if launch is False else decode_into
        step = run(q, cache, out, lse, site, DecodeMods(score_mod, mask, scale), page_table=table)
    return (out, lse) if launch else (out, lse, step)


def _step_facts(q, k, v, table, lens):
    """The facts of a decode step's tensors a repeated step must share, and the current stream."""
    if type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None
    table_key = None
    if table is not None:
        if type(table) is not torch.Tensor:
            return None
        table_key = (table.shape, table.stride(), table.dtype, table.get_device())
    if type(lens) is torch.Tensor:
        lens_key = (lens.shape, lens.dtype, lens.get_device())
    elif type(lens) is np.ndarray:
        lens_key = (lens.shape, lens.dtype)
    else:
        return None
    index = q.get_device()
    return (q.shape, q.stride(), q.dtype, index, k.shape, k.stride(), k.dtype, k.get_device(),
            v.shape, v.stride(), v.dtype, v.get_device(), table_key, lens_key, _current_raw_stream(index))


class _PreparedDecode(PreparedEntry):
    """A repeated decode step (``decode``'s key matched): read the lengths, allocate the
    outputs, ``DecodePlan.run``. The LSE goes to a buffer of the entry's when the caller
    does not want it (never read; steps on the entry's stream write it in order)."""

    __slots__ = ("run", "paged", "q_ready", "table_ready", "num_sms", "lse_sink")

    def __init__(self, plan, q, cache):
        super().__init__(q.shape, q.dtype, q.device, q.get_device())
        self.run = plan.run
        self.paged = type(cache) is PagedKVCache
        self.q_ready = tma_ready(q.stride())
        table = cache.page_table if self.paged else None
        self.table_ready = table is None or (table.dtype == torch.int32 and table.device == q.device
                                             and table.is_contiguous())
        self.num_sms = _sm_count(q.device)
        self.lse_sink = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)

    def __call__(self, q, cache, return_lse):
        """``(out, lse)``, or None where the full path must run: another current device, or
        autograd recording (some input requires grad while grad mode is on)."""
        if torch.cuda.current_device() != self.device_index:
            return None
        if self.paged:
            k, v, table = cache.k_pages, cache.v_pages, cache.page_table
            if not self.table_ready:
                table = table.to(device=self.device, dtype=torch.int32).contiguous()
        else:
            k, v, table = cache.k, cache.v, None
        if q.requires_grad or k.requires_grad or v.requires_grad:
            if torch.is_grad_enabled():
                return None
            q, k, v = q.detach(), k.detach(), v.detach()   # DLPack refuses tensors that require grad
        if not self.q_ready:
            q = q.contiguous()
        lengths = cache.lengths.tolist()
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device) if return_lse else self.lse_sink
        self.run(q, k, v, table, out, lse, lengths, self.num_sms)
        return out, lse


_DECODES = PreparedCalls()


# The ContextParallel that flex_attention calls run under, set around the forward of a
# module parallelized with context_parallel.ContextParallelStyle (None: one device).
CONTEXT_PARALLEL: contextvars.ContextVar = contextvars.ContextVar("flexattn_context_parallel", default=None)


# A compiled decode step over a PagedKVCache (``_decode_paged_in_graph``): inference only.
_INFERENCE_OPS.define("decode_paged(Tensor query, Tensor k_pages, Tensor v_pages, Tensor page_table, Tensor lengths,"
                      " Tensor[] buffers, int spec_id) -> (Tensor, Tensor)")
_INFERENCE_OPS.impl("decode_paged", _decode_paged_impl, "CompositeExplicitAutograd")
torch.library.register_fake("flexattn::decode_paged", _decode_paged_fake, lib=_INFERENCE_OPS)


# --- the CUDA forward ---------------------------------------------------------------------------


def _call_key(q, k, v, call):
    """A repeated call's key (``core/prepared.py``): the call's identity plus the tensors'
    shapes, strides, dtypes and devices; None for what is not a tensor."""
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        return None
    return call_key(call, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(),
                    q.dtype, k.dtype, v.dtype, q.get_device(), k.get_device(), v.get_device())


def _remember(key, q, call, spec, shape) -> None:
    """Eager CUDA inference calls that repeat get a ``_PreparedCall`` (on their second
    sighting), so a repeat costs a key, an allocation and the TVM-FFI launch (the full
    path costs ~60 µs of host time). Calls that autograd records go through the custom op."""
    if key is None:
        return

    def make():
        with torch.cuda.device(q.device):
            prepared = prepare_forward(q, shape, spec, _forward_device(q.device))
        return None if prepared is None else _PreparedCall(spec, shape, q, prepared)

    _PREPARED.add(key, call, make)


class _PreparedCall(PreparedEntry):
    __slots__ = ("score_tensors", "launch", "lse_sink", "trains", "backward")

    def __init__(self, spec, shape, q, prepared):
        super().__init__((shape.batch, shape.q_heads, shape.q_len, shape.v_head_dim), q.dtype, q.device,
                         q.get_device())
        self.score_tensors = tuple(_score_tensors(spec.score))
        self.launch = prepared.launch
        # Where the kernel's LSE goes when the caller does not want it: one buffer, never
        # read (racing writes from several streams are harmless), one allocation saved.
        self.lse_sink = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        # Training calls repeat through _PreparedStep where the forward is the flash
        # kernel's (a short query routed to the decode kernel may decline a launch).
        self.trains = isinstance(prepared, PreparedForward)
        self.backward = None   # _PreparedBackward, attached by the first backward

    def __call__(self, q, k, v, return_lse, call=None):
        """``(out, lse)``, or None where the full path must run: another current device
        (it switches devices around the launch), or a call autograd records that cannot
        take ``_PreparedStep`` (not plain eager tensors: the custom op). Each tensor's
        ``requires_grad`` is read once: it decides both."""
        if torch.cuda.current_device() != self.device_index:
            return None
        if q.requires_grad or k.requires_grad or v.requires_grad:
            if torch.is_grad_enabled():
                return self._train(q, k, v, call)
            q, k, v = q.detach(), k.detach(), v.detach()   # DLPack refuses tensors that require grad
        elif self.score_tensors and torch.is_grad_enabled() and any(t.requires_grad for t in self.score_tensors):
            return self._train(q, k, v, call)
        out = _written_empty(self.out_shape, dtype=self.dtype, device=self.device)
        lse = _written_empty(self.lse_shape, dtype=torch.float32, device=self.device) if return_lse else self.lse_sink
        if self.launch(q, k, v, out, lse, _current_raw_stream(self.device_index)) is False:
            return None   # a routed short query on another stream than its plan's
        return out, lse

    def _train(self, q, k, v, call):
        if call is None or not self.trains or not _plain_eager(q, k, v, *self.score_tensors):
            return None
        return _EagerAttention.apply(q, k, v, _PreparedStep(self, call), *self.score_tensors)


_PREPARED = PreparedCalls()   # key -> _PreparedCall


# --- block masks built on the GPU ----------------------------------------------------------------


