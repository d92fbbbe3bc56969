"""The custom ops of compiled graphs: ``flexattn::attention_fwd`` (with autograd:
``flexattn::attention_bwd``), ``attention_fwd_max`` (max scores too) and
``attention_fwd_inference`` (no autograd layer, for graphs that record no backward), their
fake implementations, and what makes a graph's repeated call cheap (``_OpPrepared``: the
eager door's prepared launch keyed by the op call's shapes).

An op call carries its tensors (q, k, v, the mods' captured tensors as ``buffers``) and the
registry id of everything else (``_REGISTRY``, ``core/registry.py``). A block mask that is
a value of the graph arrives as its lists and layout (``_with_graph_block_mask``); a short
query's graph may pass the walk of its row instead (``torch/graph_walk.py``), which the
decode kernel reads in place (``_graph_walk_forward``). The eager door's short queries over
a row sliced by a device index take the same route (``_row_walk_call``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional

import numpy as np
import torch

from .. import reference
from ..blockmask.layout import _LIST_NAMES, as_block_mask
from ..bounded import keep_bounded
from ..core.kernel_path import PreparedForward, prepare_forward
from ..core.registry import SpecRegistry
from ..core.short_query import SHORT_QUERY_MAX
from ..mods import Mod
from ..problem import bounds
from ..problem.spec import OPERAND, AttentionSpec, lse_dtype
from ..problem.validate import check_inputs
from .devices import _backward_alloc, _current_raw_stream, _forward_device, _like, _written_empty
from .launches import (_PreparedBackward, _backward_arrays, _block_lists_to_device, _buffer_grads, _forward_outputs,
                       _grad_mask, _is_tensor, _kernel_backward, _kernel_forward, _tensor_slots)

def _records_grad(*tensors) -> bool:
    """Whether autograd would record a call over ``tensors`` (its inputs and its mods'
    tensors): grad mode is on and one of them requires grad. Under torch.compile it is
    known while tracing, and guarded."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _score_tensors(score) -> list:
    """The score mod's captured tensors, in capture order (the op's ``buffers``)."""
    if not isinstance(score, Mod):  # None, or a function without tensors (checked above)
        return []
    return [c for c in score.captures if isinstance(c, torch.Tensor)]


_REGISTRY = SpecRegistry(_is_tensor)   # the non-tensor half of each op call (core/registry.py)


def _attention_fwd_impl(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, buffers: list[torch.Tensor],
                        spec_id: int, lists: list[Optional[torch.Tensor]],
                        layout: Optional[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): the kernel for CUDA tensors, the reference for CPU ones. A compiled
    graph's repeated call launches its ``_OpPrepared`` entry. ``lists`` / ``layout``: a
    block mask whose lists are values of the graph (``_with_graph_block_mask``); else
    ``[]`` / None."""
    repeatable = query.is_cuda and layout is None
    if repeatable:
        op_key = _op_key(spec_id, query, key, value)
        entry = _OP_PREPARED.get(op_key)
        if entry is not None and not bounds.enabled():
            hit = entry(query, key, value, buffers)
            if hit is not None:
                return hit
    if len(lists) > 4 and query.is_cuda and not bounds.enabled():
        walked = _graph_walk_forward(spec_id, query, key, value, lists[4], lists[5], layout, buffers=buffers)
        if walked is not None:
            return walked
    spec = _with_graph_block_mask(_REGISTRY.bind_operands(spec_id, buffers), lists, layout)
    if query.is_cuda:
        shape = check_inputs(query, key, value, spec)
        result = _kernel_forward(spec, shape, query, key, value)
        if repeatable and op_key not in _OP_PREPARED:
            _OpPrepared.remember(op_key, query, spec, shape, buffers)
        return result
    out, lse = reference.forward(query, key, value, spec)
    return _like(out, query), _like(lse, query, getattr(torch, lse_dtype(query)))


def _graph_walk_forward(spec_id: int, query, key, value, table, lengths, layout, spec: AttentionSpec | None = None,
                        buffers=()):
    """(out, lse) of a short query whose graph walked its block mask's lists
    (``graph_walk``): the decode kernel reads the table and lengths where they are; None
    where it cannot take the call (the caller converts the lists). A repeated call (a
    graph's, every step) launches its ``PreparedDeviceWalk``. ``spec``: the call's, with
    its captures (eager); None for an op call, whose ``buffers`` go into the registered
    template (put in place by slot on a repeat: no spec is bound)."""
    from ..core.short_query import DeviceLists, device_walk_into, mod_captures

    dev = query.device
    if dev.index != torch.cuda.current_device():
        with torch.cuda.device(dev):
            return _graph_walk_forward(spec_id, query, key, value, table, lengths, layout, spec, buffers)
    op_key = ("walk", _current_raw_stream(dev.index), tuple(table.shape), tuple(lengths.shape),
              tuple(layout), *_op_key(spec_id, query, key, value))
    entry = _OP_PREPARED.get(op_key)
    if entry is not None:
        shape, prepared = entry
        out, lse = _forward_outputs(shape, query)
        captures = mod_captures(spec) if spec is not None else _template_captures(spec_id, buffers)
        if prepared.launch(query, key, value, out, lse, captures, table, lengths):
            return out, lse
    if spec is None:
        spec = _REGISTRY.bind_operands(spec_id, buffers)
    shape = check_inputs(query, key, value, spec)
    out, lse = _forward_outputs(shape, query)
    prepared = device_walk_into(query, key, value, out, lse, shape, spec,
                                DeviceLists(table, lengths, int(layout[1]), int(layout[0])), _forward_device(dev))
    if prepared is None:
        return None
    if prepared is not False:
        _op_remember(op_key, (shape, prepared))
    return out, lse


def _template_captures(spec_id: int, buffers) -> dict:
    """``short_query.mod_captures`` of registry entry ``spec_id`` bound to an op call's
    ``buffers`` (the score's operands first, then the mask's, as ``bind_operands`` puts
    them), without making the bound mods."""
    template, operands = _REGISTRY.get(spec_id), iter(buffers)
    return {kind: () if mod is None else tuple(next(operands) if c is OPERAND else c for c in mod.captures)
            for kind, mod in (("score", template.score), ("mask", template.element_mask))}


def _row_walk_call(query, key, value, call):
    """(out, lse) of an eager short query whose block mask is one row sliced by a device
    index (gpt-fast's eager step: ``block_mask[:, :, input_pos // 128]``, ``BlockMask._device_rows``):
    every row of the sliced mask is walked once on the device (``_row_walks``), the row's
    table and length are picked there by the same index, and the decode kernel reads them
    as it reads a compiled graph's walk (``_graph_walk_forward``) — no host copy of the
    position, no wait for the GPU. None where this route does not apply (the full path
    runs: it copies the index to the host)."""
    score_mod, block_mask, scale, enable_gqa, mask, score = call
    parent, picks = block_mask._row_source
    mod, states = block_mask._mask_mod, block_mask._device_states
    q_block, kv_block = block_mask.BLOCK_SIZE
    q_len, kv_len = block_mask.seq_lengths
    if (mod is None or mask is not None or bounds.enabled() or len(picks) != 3 or isinstance(picks[2], slice)
            or tuple(states.shape[1:3]) != (1, 1) or not isinstance(key, torch.Tensor) or query.dim() != 4
            or query.shape[2] > min(SHORT_QUERY_MAX, q_block) or kv_len % kv_block
            or kv_len // kv_block != parent.num_blocks[1] or query.is_nested):
        return None
    spec = AttentionSpec.from_args(score_mod, None, scale, enable_gqa, mod, score)
    if _records_grad(query, key, value, *_score_tensors(spec.score)):
        return None
    if query.requires_grad or key.requires_grad or value.requires_grad:   # (no_grad around leaves that want it)
        query, key, value = query.detach(), key.detach(), value.detach()
    tables, lengths = _row_walks(parent, query.device, picks[:2])
    table, lengths = tables[:, :, picks[2]], lengths[:, :, picks[2]].reshape(-1)
    table = table.reshape(table.shape[0], -1)
    return _graph_walk_forward(_REGISTRY.register(spec, masks=True), query, key, value, table, lengths,
                               (q_block, kv_block, q_len, kv_len), spec=spec)


def _row_walks(block_mask, device, picks: tuple = (slice(None), slice(None))) -> tuple:
    """``(tables, lengths)`` [B, H, Q_BLOCKS, W] / [B, H, Q_BLOCKS] int32 on ``device``: each
    row of ``block_mask[picks]`` (slices of its batch and head dims) walked as
    ``graph_walk.walk_lists`` walks one (its full blocks, then its partial ones), once per
    mask, picks and device: its lists never change."""
    walks = block_mask.__dict__.setdefault("_row_walks", {})
    key = (str(device), *((p.start, p.stop, p.step) for p in picks))
    found = walks.get(key)
    if found is None:
        from .graph_walk import walk_lists

        lists = [block_mask._present(name) for name in _LIST_NAMES[:4]]
        lists = [None if x is None else torch.as_tensor(x)[picks].to(device) for x in lists]
        b, h, rows = (int(n) for n in lists[0].shape)
        flat = [None if x is None else x.reshape(b * h * rows, 1, 1, *x.shape[3:]) for x in lists]
        table, lengths, _ = walk_lists(*flat, block_mask.BLOCK_SIZE[1], block_mask.num_blocks[1])
        found = walks[key] = (table.reshape(b, h, rows, -1), lengths.reshape(b, h, rows))
    return found


def _with_graph_block_mask(spec: AttentionSpec, lists, layout) -> AttentionSpec:
    """``spec`` with the block mask of a call whose torch ``BlockMask`` was built inside the
    compiled code (``torch/nested.py``): its kv-side lists arrive as op inputs (partial
    then full, torch's order; for a short query the graph walked, four Nones and the walk,
    from which they are rebuilt: ``graph_walk.lists_of_walk``),
    ``layout`` = (q block, kv block, Q_LEN, KV_LEN), and the spec's mask is its
    ``mask_mod``. The lists come to the host in one copy; conversions are kept by what the
    lists hold (``_GRAPH_BLOCK_MASKS``) — never by where they are: a graph's lists are new
    tensors each call, often at the addresses of the last call's, whatever they hold."""
    if layout is None:
        return spec
    from types import SimpleNamespace

    from ..arrays import to_numpy_all
    from ..blockmask.layout import _copy_of, _tiles_are_the_masks

    layout = tuple(int(x) for x in layout)
    if len(lists) > 4 and lists[0] is None:   # (the graph passed its walk alone: graph_walk)
        from .graph_walk import lists_of_walk

        lists = lists_of_walk(*lists[4:7], layout[1])
    host = [None if x is None else np.ascontiguousarray(x) for x in to_numpy_all(lists[:4])]
    mask = spec.mask
    numbers = tuple(c if isinstance(c, (int, float)) else None for c in mask.captures)
    key = (layout, mask.structure_key, numbers) + tuple(
        None if x is None else (x.shape, x.dtype.str, hashlib.blake2b(x.data, digest_size=16).digest()) for x in host)
    template = _GRAPH_BLOCK_MASKS.get(key)
    if template is None:
        q_block, kv_block, q_len, kv_len = layout
        torch_like = SimpleNamespace(kv_num_blocks=host[0], kv_indices=host[1], full_kv_num_blocks=host[2],
                                     full_kv_indices=host[3], BLOCK_SIZE=(q_block, kv_block),
                                     seq_lengths=(q_len, kv_len), mask_mod=mask)
        block_mask = as_block_mask(torch_like)
        keep_bounded(_GRAPH_BLOCK_MASKS, key, block_mask, 16)
    else:
        block_mask = _copy_of(template)
        block_mask.mask_mod = mask        # this call's captures
        if template.from_mask and None in numbers:   # (tensor captures: their values may differ)
            block_mask.from_mask = _tiles_are_the_masks(block_mask)
    return dataclasses.replace(spec, block_mask=block_mask, mask=None)


# Converted graph block masks by list contents and mask structure (a training loop's block
# mask built in the graph converts once; one rebuilt per step with new lists, per step).
_GRAPH_BLOCK_MASKS: dict = {}


_attention_fwd = torch.library.custom_op("flexattn::attention_fwd", mutates_args=())(_attention_fwd_impl)


@_attention_fwd.register_fake
def _attention_fwd_fake(query, key, value, buffers, spec_id, lists, layout):
    spec = _REGISTRY.get(spec_id)
    shape = check_inputs(query, key, value, spec)  # shape errors surface while compiling
    if layout is None:   # (a graph's own block mask: its lists are graph tensors already)
        _block_lists_to_device(spec, shape, query.device)
    out = query.new_empty(shape.batch, shape.q_heads, shape.q_len, shape.v_head_dim)
    lse = query.new_empty(shape.batch, shape.q_heads, shape.q_len, dtype=getattr(torch, lse_dtype(query)))
    return out, lse


# ``attention_fwd``'s twin for compiled graphs that record no backward: the same function
# through a plain ``torch.library`` op with no autograd kernel (the dispatcher's C++
# fallback), since a ``custom_op``'s Python autograd layer runs on every call, also under
# no_grad (this CPU box: a custom op's dispatch 43-56 µs against a plain op's 16-38; an H100
# compiled inference call at B1 S512 ran 155 µs against the eager call's 73).
_INFERENCE_OPS = torch.library.Library("flexattn", "FRAGMENT")
_INFERENCE_OPS.define("attention_fwd_inference(Tensor query, Tensor key, Tensor value, Tensor[] buffers, int spec_id,"
                      " Tensor?[] lists, int[]? layout) -> (Tensor, Tensor)")
_INFERENCE_OPS.impl("attention_fwd_inference", _attention_fwd_impl, "CompositeExplicitAutograd")
torch.library.register_fake("flexattn::attention_fwd_inference", _attention_fwd_fake, lib=_INFERENCE_OPS)


def _op_key(spec_id: int, q, k, v) -> tuple:
    """A compiled graph's forward op call: its registry entry (pinned: the spec never
    changes) and what the checks read of the tensors."""
    return (spec_id, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
            q.get_device(), k.get_device(), v.get_device())


class _OpPrepared:
    """The forward op of a compiled graph, repeated: the eager door's prepared launch
    (``kernel_path.PreparedForward``: no checks, no planning) with each call's score-mod
    tensors put in place of the first call's. Made on the first call (a graph repeats its
    calls); entries hold that call's tensors and are bounded by ``_OP_PREPARED_CAPACITY``."""

    __slots__ = ("prepared", "positions", "out_shape", "lse_shape", "dtype", "device", "device_index")

    @staticmethod
    def remember(op_key, q, spec, shape, buffers) -> None:
        if bounds.enabled():
            return
        with torch.cuda.device(q.device):
            prepared = prepare_forward(q, shape, spec, _forward_device(q.device))
        if isinstance(prepared, PreparedForward):   # short queries, float32: the full path
            _op_remember(op_key, _OpPrepared(prepared, shape, q, buffers))

    def __init__(self, prepared, shape, q, buffers):
        self.prepared = prepared
        self.positions = prepared.operand_positions(buffers)
        self.out_shape = (shape.batch, shape.q_heads, shape.q_len, shape.v_head_dim)
        self.lse_shape = self.out_shape[:3]
        self.dtype, self.device, self.device_index = q.dtype, q.device, q.get_device()

    def __call__(self, q, k, v, buffers):
        """(out, lse), or None where the full path must run (another current device)."""
        if torch.cuda.current_device() != self.device_index:
            return None
        if q.requires_grad or k.requires_grad or v.requires_grad:
            q, k, v = q.detach(), k.detach(), v.detach()   # DLPack refuses tensors that require grad
        out = _written_empty(self.out_shape, dtype=self.dtype, device=self.device)
        lse = _written_empty(self.lse_shape, dtype=torch.float32, device=self.device)
        self.prepared.launch_operands(q, k, v, out, lse, buffers, self.positions)
        return out, lse


class _OpPreparedBackward:
    """The backward op of a compiled graph, repeated: a ``_PreparedBackward`` launched with
    each call's score-mod tensors (as ``_OpPrepared``)."""

    __slots__ = ("prepared", "positions")

    @staticmethod
    def remember(op_key, spec, shape, query, grad_mask: int, buffers) -> None:
        if bounds.enabled():
            return
        prepared = _PreparedBackward.make(spec, shape, query, op_key[2], grad_mask)
        if prepared is not None:
            entry = _OpPreparedBackward()
            entry.prepared, entry.positions = prepared, prepared.kernels.operand_positions(buffers)
            _op_remember(op_key, entry)

    def __call__(self, q, k, v, out, lse, d_out, d_lse, buffers):
        """(dq, dk, dv, d_buffers), or None where the full path must run (another current
        device)."""
        if q.get_device() != torch.cuda.current_device():
            return None
        arrays = _backward_arrays(q, k, v, out, lse, d_out, d_lse)
        capture_grads = self.prepared.kernels.launch(arrays, _backward_alloc(q.device), buffers, self.positions)
        return arrays.dq, arrays.dk, arrays.dv, _buffer_grads(self.prepared.tensor_slots, capture_grads, buffers)


_OP_PREPARED: dict = {}   # _op_key (forward), ("bwd", ...) + _op_key -> _OpPrepared(Backward)
_OP_PREPARED_CAPACITY = 64


def _op_remember(op_key, entry) -> None:
    keep_bounded(_OP_PREPARED, op_key, entry, _OP_PREPARED_CAPACITY)


@torch.library.custom_op("flexattn::attention_fwd_max", mutates_args=())
def _attention_fwd_max(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, buffers: list[torch.Tensor],
                       spec_id: int, lists: list[Optional[torch.Tensor]],
                       layout: Optional[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, max_scores): ``attention_fwd`` plus each row's max score (``lists`` /
    ``layout`` as there)."""
    spec = _with_graph_block_mask(_REGISTRY.bind_operands(spec_id, buffers), lists, layout)
    if query.is_cuda:
        return _kernel_forward(spec, check_inputs(query, key, value, spec), query, key, value, want_max=True)
    out, lse, max_scores = reference.forward(query, key, value, spec, max_scores=True)
    stats = getattr(torch, lse_dtype(query))
    return _like(out, query), _like(lse, query, stats), _like(max_scores, query, stats)


@_attention_fwd_max.register_fake
def _(query, key, value, buffers, spec_id, lists, layout):
    out, lse = _attention_fwd_fake(query, key, value, buffers, spec_id, lists, layout)
    return out, lse, torch.empty_like(lse)


@torch.library.custom_op("flexattn::attention_bwd", mutates_args=())
def _attention_bwd(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, d_out: torch.Tensor, d_lse: torch.Tensor | None,
                   buffers: list[torch.Tensor], spec_id: int, grad_mask: int,
                   lists: list[Optional[torch.Tensor]], layout: Optional[list[int]],
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(dq, dk, dv, d_buffers): the backward kernels for CUDA tensors, the reference for CPU
    ones. ``out``/``lse`` are the forward's outputs (the kernels start from them; the exact
    reference recomputes its own). ``d_buffers[i]`` is zeros for buffers without a gradient
    and for those whose bit in ``grad_mask`` is clear (not requiring grad: the kernel then
    skips their gradient entirely). All outputs are contiguous. ``lists`` / ``layout``: as
    ``attention_fwd``'s."""
    repeatable = query.is_cuda and layout is None
    if repeatable:
        op_key = ("bwd", grad_mask, torch.are_deterministic_algorithms_enabled(), d_lse is None,
                  *_op_key(spec_id, query, key, value))
        entry = _OP_PREPARED.get(op_key)
        if entry is not None and not bounds.enabled():
            hit = entry(query, key, value, out, lse, d_out, d_lse, buffers)
            if hit is not None:
                return hit
    spec = _with_graph_block_mask(_REGISTRY.bind_operands(spec_id, buffers), lists, layout)
    shape = check_inputs(query, key, value, spec)
    if query.is_cuda:
        grads = _kernel_backward(spec, shape, query, key, value, out, lse, d_out, d_lse, buffers, grad_mask)
        if repeatable and op_key not in _OP_PREPARED:
            _OpPreparedBackward.remember(op_key, spec, shape, query, grad_mask, buffers)
        return grads
    grads = reference.backward(query, key, value, d_out, d_lse, spec)
    return (_like(grads.dq, query), _like(grads.dk, key), _like(grads.dv, value),
            _buffer_grads(_tensor_slots(spec), grads.d_captures, buffers))


@_attention_bwd.register_fake
def _(query, key, value, out, lse, d_out, d_lse, buffers, spec_id, grad_mask, lists, layout):
    def new(x):
        return x.new_empty(x.shape)  # contiguous, as the real outputs

    return new(query), new(key), new(value), [new(b) for b in buffers]


def _setup_context(ctx, inputs, output):
    query, key, value, buffers, spec_id, lists, layout = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, *buffers, *lists)
    ctx.spec_id = spec_id
    ctx.grad_mask = _grad_mask(buffers)
    ctx.n_buffers = len(buffers)
    ctx.layout = layout
    ctx.set_materialize_grads(False)


def _backward(ctx, d_out, d_lse):
    query, key, value, out, lse, *rest = ctx.saved_tensors
    buffers, lists = rest[:ctx.n_buffers], list(rest[ctx.n_buffers:])
    # no gradients for spec_id, the lists and layout: one None per input of each
    rest_none = (None, [None] * len(lists), None)
    if d_out is None and d_lse is None:
        return None, None, None, [None] * len(buffers), *rest_none
    if d_out is None:
        d_out = torch.zeros_like(out)
    dq, dk, dv, d_buffers = torch.ops.flexattn.attention_bwd(query, key, value, out, lse, d_out, d_lse, buffers,
                                                              ctx.spec_id, ctx.grad_mask, lists, ctx.layout)
    return dq, dk, dv, _float_grads(buffers, d_buffers), *rest_none


def _float_grads(buffers, d_buffers) -> list:
    """Autograd's gradients of the op buffers: none for integer ones."""
    return [g if b.is_floating_point() else None for b, g in zip(buffers, d_buffers)]


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def _setup_context_max(ctx, inputs, output):
    _setup_context(ctx, inputs, output[:2])
    ctx.mark_non_differentiable(output[2])


def _backward_max(ctx, d_out, d_lse, d_max):
    return _backward(ctx, d_out, d_lse)   # max_scores is not differentiable


_attention_fwd_max.register_autograd(_backward_max, setup_context=_setup_context_max)


