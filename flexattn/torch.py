"""PyTorch adapter: ``flexattn.torch.flex_attention`` with torch's signature and autograd.

Tensors in, tensors out, on the caller's device and dtype. CUDA tensors (bf16/fp16, head
dim 64/128) run the CuTeDSL Hopper forward kernel on the current stream; CPU tensors run
the exact numpy reference. Until the backward kernel lands, gradients of CUDA calls are
computed by the reference on the host (correct, slow). Gradients flow to query, key,
value and to captured float tensors of score mods (trainable biases, slopes, tables).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from . import reference
from .blockmask import BlockMask, create_block_mask
from .core.decode import decode_problem
from .core.kernel_path import Device, forward_into, kernel_unsupported
from .kvcache import KVCache, PagedKVCache
from .core.spec import AttentionSpec
from .core.validate import check_inputs
from .mods import MaskMod, ScoreMod, as_mask, mask_mod

__all__ = ["flex_attention", "decode", "create_block_mask", "BlockMask", "KVCache", "PagedKVCache",
           "MaskMod", "ScoreMod", "mask_mod"]


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
    mask=None,
    score=None,
):
    """Drop-in for ``torch.nn.attention.flex_attention.flex_attention`` ([B, H, S, D] tensors).

    ``score_mod``: a ``ScoreMod`` or a function ``(score, b, h, q_idx, kv_idx) -> score``.
    ``block_mask``: a ``flexattn.BlockMask`` or torch's ``BlockMask`` (converted).
    ``mask=`` / ``score=``: our mod values; a ``mask`` without ``block_mask`` applies
    element-wise. Returns ``out`` or ``(out, lse)`` (lse in natural log; float32, float64 for float64 inputs).
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if kernel_options is not None and not isinstance(kernel_options, dict):
        raise TypeError(f"kernel_options must be a dict or None, got {type(kernel_options).__name__}")
    block_mask = _convert_block_mask(block_mask)
    spec = AttentionSpec.from_args(score_mod, block_mask, scale, enable_gqa, mask, score)
    shape = check_inputs(query, key, value, spec)
    if query.is_cuda:
        reason = kernel_unsupported(query, shape)
        if reason:
            raise ValueError(f"{reason} (CPU tensors run the exact reference for anything else)")
    buffers = tuple(c for c in (spec.score.captures if spec.score is not None else ()) if isinstance(c, torch.Tensor))
    out, lse = _Attention.apply(spec, shape, query, key, value, *buffers)
    return (out, lse) if return_lse else out


def decode(query: torch.Tensor, cache, score_mod=None, mask=None, scale=None, return_lse=False):
    """Decoding step on a ``KVCache``/``PagedKVCache`` of torch tensors.

    ``query`` [B, Hq, q_len, D] holds the last q_len tokens of each sequence (append their
    K/V to the cache first); mods see true positions; GQA is implicit. Paged caches are
    gathered into logical order for now (the split-KV decode kernel will read pages in place).
    """
    k, v, spec = decode_problem(query, cache, score_mod, mask, scale)
    return flex_attention(query, k, v, score=spec.score, mask=spec.mask, scale=spec.scale,
                          enable_gqa=True, return_lse=return_lse)


class _Attention(torch.autograd.Function):
    """Forward on the kernel (CUDA) or the reference (CPU); backward on the reference.
    ``buffers`` are the score mod's captured tensors, so autograd can reach them."""

    @staticmethod
    def forward(ctx, spec: AttentionSpec, shape, query, key, value, *buffers):
        ctx.spec = spec
        ctx.save_for_backward(query, key, value)
        ctx.set_materialize_grads(False)
        if query.is_cuda:
            return _kernel_forward(spec, shape, query, key, value)
        out, lse = reference.forward(query, key, value, spec)
        lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32  # as torch's
        return _like(out, query), _like(lse, query, lse_dtype)

    @staticmethod
    def backward(ctx, d_out, d_lse):
        query, key, value = ctx.saved_tensors
        spec = ctx.spec
        if d_out is None:
            d_out = torch.zeros(query.shape[:-1] + value.shape[-1:], dtype=query.dtype)
        grads = reference.backward(query, key, value, d_out, d_lse, spec)
        captures = spec.score.captures if spec.score is not None else ()
        d_buffers = []
        for value_, grad in zip(captures, grads.d_captures):
            if isinstance(value_, torch.Tensor):
                d_buffers.append(None if grad is None or not value_.requires_grad else _like(grad, value_))
        return (None, None, _like(grads.dq, query), _like(grads.dk, key), _like(grads.dv, value), *d_buffers)


def _kernel_forward(spec, shape, query, key, value):
    out = torch.empty(shape.batch, shape.q_heads, shape.q_len, shape.v_head_dim, dtype=query.dtype, device=query.device)
    lse = torch.empty(shape.batch, shape.q_heads, shape.q_len, dtype=torch.float32, device=query.device)
    device = Device(torch.cuda.current_stream(query.device).cuda_stream, _DeviceCopies(query.device))
    with torch.cuda.device(query.device):  # the launch goes to the inputs' GPU
        # DLPack refuses tensors that require grad; the kernel only reads them
        forward_into(query.detach(), key.detach(), value.detach(), out, lse, shape, spec, device)
    return out, lse


class _DeviceCopies:
    """Host arrays (block-mask lists, numpy captures) → CUDA tensors.

    Read-only numpy arrays (block-mask lists, arrays made by the built-in mods) are copied
    once per array object and device and kept while the array lives, so steady-state calls
    copy nothing (a pageable copy would also stall the stream). Writeable host arrays may
    change between calls and are copied every call: capture CUDA tensors to avoid that.
    """

    _cache: dict = {}

    def __init__(self, device):
        self.device = device

    def __call__(self, x):
        if isinstance(x, torch.Tensor):
            return x.detach().to(self.device).contiguous()
        if not isinstance(x, np.ndarray) or x.flags.writeable:
            return torch.from_numpy(np.ascontiguousarray(x)).to(self.device)
        key = (id(x), str(self.device))
        hit = self._cache.get(key)
        if hit is not None and hit[0]() is x:
            return hit[1]
        t = torch.from_numpy(np.ascontiguousarray(x)).to(self.device)
        ref = weakref.ref(x, lambda _, key=key: _DeviceCopies._cache.pop(key, None))
        self._cache[key] = (ref, t)
        return t


def _like(array: np.ndarray, ref: torch.Tensor, dtype=None) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device=ref.device, dtype=dtype or ref.dtype)


def _convert_block_mask(block_mask):
    """torch's BlockMask → ours (same lists; its mask_mod is traced)."""
    if block_mask is None or isinstance(block_mask, BlockMask):
        return block_mask
    needed = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "BLOCK_SIZE", "seq_lengths", "mask_mod")
    if not all(hasattr(block_mask, a) for a in needed):
        raise TypeError(f"block_mask must be a BlockMask, got {type(block_mask).__name__}")
    return BlockMask.from_kv_blocks(
        block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks, block_mask.full_kv_indices,
        BLOCK_SIZE=tuple(block_mask.BLOCK_SIZE), mask_mod=as_mask(block_mask.mask_mod, "block_mask.mask_mod"),
        seq_lengths=tuple(block_mask.seq_lengths),
    )
