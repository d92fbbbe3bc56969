"""The forward and backward kernels on torch tensors: the adapter's calls into the core's
launches (``forward_into``, ``backward_into``) with torch's outputs and operands — fresh
outputs or the views a caller gives (``into``: context parallelism's rows), the backward's
operands as the kernels can read them in place, and the gradients of score-mod tensors
mapped back to the op's buffers. Every route of the adapter (eager calls, the custom ops
of compiled graphs, context parallelism) launches through here.
"""

from __future__ import annotations

import numpy as np
import torch

from ..core.backward_path import BackwardArrays, backward_into, prepare_backward
from ..core.decode_device import tma_ready
from ..core.kernel_path import block_lists_to_device, forward_into
from ..core.registry import operand_grad_slots
from ..problem.spec import OPERAND, AttentionSpec
from .devices import _DeviceCopies, _forward_device, _like, _write_target, _written_empty


def _is_tensor(x) -> bool:   # a score-mod tensor capture: an input of each op call
    return isinstance(x, torch.Tensor)


def _forward_outputs(shape, query) -> tuple:
    """(out, lse) for a forward kernel to write in full: query's dtype and float32."""
    out = _written_empty(shape.batch, shape.q_heads, shape.q_len, shape.v_head_dim, dtype=query.dtype,
                         device=query.device)
    return out, _written_empty(shape.batch, shape.q_heads, shape.q_len, dtype=torch.float32, device=query.device)


def _grad_mask(buffers) -> int:
    """Bit n set iff op buffer n requires grad (read back by ``_grad_captures``)."""
    return sum(1 << n for n, b in enumerate(buffers) if b.requires_grad)


def _grad_captures(spec: AttentionSpec, grad_mask: int) -> tuple:
    """Score-capture slots of the op buffers whose bit is set in ``grad_mask``."""
    return operand_grad_slots(spec, _is_tensor, grad_mask)


def _tensor_slots(spec: AttentionSpec) -> tuple:
    """The score-capture slots of the op buffers (the score mod's tensor captures)."""
    if spec.score is None:
        return ()
    return tuple(i for i, c in enumerate(spec.score.captures) if isinstance(c, torch.Tensor))


def _buffer_grads(tensor_slots: tuple, capture_grads, buffers) -> list:
    """Per op buffer (the score mod's tensor captures, at ``tensor_slots``): its gradient as
    a tensor like it (device, dtype, shape; contiguous), zeros where there is none.
    ``capture_grads`` is indexed by score-mod capture (numpy from the reference, fp32 CUDA
    tensors from the kernel)."""
    # (buffers past the score's: a compiled call's mask tensors, never differentiated)
    by_buffer = [capture_grads[i] for i in tensor_slots] + [None] * (len(buffers) - len(tensor_slots))
    out = []
    for b, g in zip(buffers, by_buffer):
        if g is None:
            out.append(b.new_zeros(b.shape))
        elif isinstance(g, torch.Tensor):
            out.append(g.reshape(b.shape).to(device=b.device, dtype=b.dtype).contiguous())
        else:
            out.append(_like(np.reshape(g, tuple(b.shape)), b))
    return out


def _kernel_forward(spec, shape, query, key, value, want_max: bool = False, into=None):
    """(out, lse), or with ``want_max`` (out, lse, max_scores), from the forward kernel.
    ``into``: None, or (out, lse) tensors to write (views: rows of larger arrays; the
    call's shapes and dtypes, last dim contiguous)."""
    if into is None:
        out, lse = _forward_outputs(shape, query)
    else:
        out = _write_target("out", into[0], (shape.batch, shape.q_heads, shape.q_len, shape.v_head_dim),
                            query.dtype, query.device)
        lse = _write_target("lse", into[1], (shape.batch, shape.q_heads, shape.q_len), torch.float32, query.device)
    max_scores = torch.empty_like(lse) if want_max else None
    device = _forward_device(query.device)
    # DLPack refuses tensors that require grad; the kernel only reads them
    if query.requires_grad or key.requires_grad or value.requires_grad:
        query, key, value = query.detach(), key.detach(), value.detach()
    if query.device.index == torch.cuda.current_device():
        forward_into(query, key, value, out, lse, shape, spec, device, max_scores)
    else:
        with torch.cuda.device(query.device):  # the launch goes to the inputs' GPU
            forward_into(query, key, value, out, lse, shape, spec, device, max_scores)
    return (out, lse, max_scores) if want_max else (out, lse)


def _kernel_backward(spec, shape, query, key, value, out, lse, d_out, d_lse, buffers, grad_mask, into=None,
                     merged_lse=False):
    """The backward kernels on the current stream -> (dq, dk, dv, gradient per op buffer:
    ``_buffer_grads``), the buffers' whose bit is set in ``grad_mask``. ``into``: None, or
    (dq, dk, dv), each None or a tensor (a view: rows of a larger gradient) the kernels
    write that gradient into (the inputs' shape and dtype, last dim contiguous).
    ``merged_lse``: ``lse`` covers more keys than this call's (``backward_into``'s)."""
    grad_captures = _grad_captures(spec, grad_mask)
    dev = query.device
    arrays = _backward_arrays(query, key, value, out, lse, d_out, d_lse, into)
    device = _forward_device(dev)  # TVM-FFI launches read torch's current stream (the autograd thread's)
    # torch's switch for bitwise-repeatable algorithms selects the deterministic backward
    deterministic = torch.are_deterministic_algorithms_enabled()
    alloc = device.alloc
    if dev.index == torch.cuda.current_device():
        result = backward_into(arrays, shape, spec, device, alloc, deterministic=deterministic,
                               grad_captures=grad_captures, merged_lse=merged_lse)
    else:
        with torch.cuda.device(dev):  # the launches go to the inputs' GPU
            result = backward_into(arrays, shape, spec, device, alloc, deterministic=deterministic,
                                   grad_captures=grad_captures, merged_lse=merged_lse)
    return arrays.dq, arrays.dk, arrays.dv, _buffer_grads(_tensor_slots(spec), result.capture_grads, buffers)


def _backward_arrays(query, key, value, out, lse, d_out, d_lse, into=None, outputs_later=False) -> BackwardArrays:
    """The backward kernels' operands (detached; dO in the inputs' dtype, dO and the LSEs
    as they are where the kernels read them so, `_kernel_reads_as_is`, else contiguous
    copies) and their dq, dk, dv: freshly allocated, or the views ``into`` gives, or None
    (``outputs_later``: the launch allocates them)."""
    def operand(x, dtype):  # DLPack refuses tensors that require grad
        x = x.detach() if x.dtype == dtype else x.detach().to(dtype)
        return x if _kernel_reads_as_is(x) else x.clone(memory_format=torch.contiguous_format)   # (fresh: aligned)

    def output(name, like, view):
        if view is None:
            return _written_empty(like.shape, dtype=like.dtype, device=like.device)
        return _write_target(name, view, tuple(like.shape), like.dtype, like.device)

    into = into or (None, None, None)
    grads = (None, None, None) if outputs_later else (
        output("dq", query, into[0]), output("dk", key, into[1]), output("dv", value, into[2]))
    return BackwardArrays(
        q=query.detach(), k=key.detach(), v=value.detach(), out=out.detach(), lse=operand(lse, torch.float32),
        d_out=operand(d_out, query.dtype), d_lse=None if d_lse is None else operand(d_lse, torch.float32),
        dq=grads[0], dk=grads[1], dv=grads[2],
    )


def _kernel_reads_as_is(x) -> bool:
    """Whether the backward kernels read ``x`` (dO [B, H, S, Dv] by TMA, or an fp32 LSE
    [B, H, S] row statistic) without a copy: the last dim contiguous, the others' strides
    nonzero, and for 16-bit dO 16-byte aligned rows (strides multiples of 8 elements, the
    base aligned) — as autograd hands over the gradient of a transposed output, or context
    parallelism's rows of one. Else a fresh contiguous copy (e.g. an expanded gradient)."""
    strides = x.stride()
    if (x.shape[-1] != 1 and strides[-1] != 1) or any(st == 0 for n, st in zip(x.shape, strides) if n != 1):
        return False
    if x.dtype == torch.float32 and x.dim() == 3:
        return True
    return tma_ready(strides) and x.data_ptr() % 16 == 0


def _block_lists_to_device(spec: AttentionSpec, shape, device) -> None:
    """While torch.compile traces the op: copy the kernels' host block-mask lists to the
    GPU now (``_DeviceCopies`` keeps them). Made lazily at the first real call instead,
    they would be allocated from the memory pool of a CUDA graph being warmed up or
    recorded (``mode="reduce-overhead"``), which must hold nothing but the graph's own
    tensors; and a pageable copy cannot be captured at all. Static shapes only (with
    symbolic sizes the lists are not known yet: the first real call copies them)."""
    if device.type != "cuda" or not all(isinstance(n, int) for n in shape):
        return
    mask = spec.element_mask
    if mask is not None and any(c is OPERAND for c in mask.captures):
        return   # the mask reads op operands (graph values): its lists follow them, built at the real call
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        block_lists_to_device(spec, shape, _DeviceCopies(device))


class _PreparedBackward:
    """A ``core.backward_path.PreparedBackward`` (``kernels``: it knows its deterministic
    setting) with what the torch side reads: the buffer-gradient mask it was made for and
    the score-capture slots of the op buffers (``_buffer_grads``)."""

    __slots__ = ("kernels", "grad_mask", "tensor_slots")

    @classmethod
    def make(cls, spec, shape, query, deterministic: bool, grad_mask: int, merged_lse: bool = False):
        if query.device.index != torch.cuda.current_device():
            return None
        prepared = prepare_backward(query, shape, spec, _forward_device(query.device), deterministic,
                                    _grad_captures(spec, grad_mask), merged_lse)
        if prepared is None:
            return None
        self = cls()
        self.kernels, self.grad_mask, self.tensor_slots = prepared, grad_mask, _tensor_slots(spec)
        return self
