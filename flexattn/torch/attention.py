"""``flexattn.torch.flex_attention``: torch's signature, validated, routed.

An eager call checks its arguments once and runs the kernels through the autograd layer
(``_EagerAttention``: the forward, and the backward when autograd records the call); a call
that repeats (same tensors' facts, same mods and block mask) is served by its prepared
launch (``_PreparedCall``, ``_PreparedStep`` for training steps), skipping the checks and
the planning. Under torch.compile the call is the custom op (``compiled.py``, ``ops.py``);
short queries over a row sliced by a device index walk it on the device
(``ops._row_walk_call``); under context parallelism (``CONTEXT_PARALLEL``) each rank runs its
shards (``context_parallel.py``).
"""

from __future__ import annotations

import contextvars

import torch

from ..blockmask.layout import as_block_mask
from ..core.kernel_path import PreparedForward, backward_unsupported, kernel_unsupported, prepare_forward
from ..core.prepared import PreparedCalls, PreparedEntry, call_key
from ..problem.spec import AttentionSpec
from ..problem.validate import check_inputs
from .compiled import _compiled_call, _compiled_op_inputs, _compiled_route
from .devices import _backward_alloc, _current_raw_stream, _forward_device, _written_empty
from .launches import _PreparedBackward, _backward_arrays, _buffer_grads, _grad_mask, _kernel_backward, _kernel_forward
from .ops import _REGISTRY, _float_grads, _records_grad, _row_walk_call, _score_tensors

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
    parallel_attention = None if torch.compiler.is_compiling() else CONTEXT_PARALLEL.get()
    if parallel_attention is not None:   # inside a module parallelized with context_parallel.ContextParallelStyle
        if return_aux is not None:
            raise ValueError("return_aux is not supported under context parallelism: use return_lse=True")
        return parallel_attention(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                                  mask=mask, score=score)
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


# What flex_attention calls run as inside the forward of a module parallelized with
# context_parallel.ContextParallelStyle, which sets it there: its attention over this rank's
# shards, a function of flex_attention's arguments (None: one device). (The style hands the
# function down, so this module never imports context_parallel, which sits above it.)
CONTEXT_PARALLEL: contextvars.ContextVar = contextvars.ContextVar("flexattn_context_parallel", default=None)


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
