"""A framework-free adapter: attention into arrays you allocated, by DLPack alone.

What a new framework needs, as one small file: convert nothing, allocate nothing (the
caller passes ``out`` and ``lse``), hand the core a raw stream. Arrays are any objects with
``__dlpack__``, ``__dlpack_device__``, ``shape`` and ``dtype`` (every framework's arrays).

- CUDA arrays run the forward kernel (bf16/fp16, head dims multiples of 16 up to 256) on the raw ``CUstream``
  ``stream`` (0: the legacy default stream). Host arrays the kernel reads — block-mask
  lists, numpy captures of mods — need a ``to_device(host array) -> CUDA DLPack array``
  (e.g. ``cupy.asarray``); calls without any (dense, ``mods.causal()``, numbers or CUDA
  arrays as captures) need none. Nothing is synchronized: ``out``/``lse`` are written in
  ``stream``'s order.
- Host arrays run the exact numpy reference and are written through ``numpy.from_dlpack``
  views of ``out``/``lse`` (numpy dtypes only: no bfloat16).
"""

from __future__ import annotations

import numpy as np

from .arrays import device_type, dtype_name
from .core.api import flex_attention as _host_attention
from .core.kernel_path import Device, forward_into, kernel_unsupported
from .problem.spec import AttentionSpec, lse_dtype
from .problem.validate import check_inputs

__all__ = ["flex_attention_into"]


def flex_attention_into(q, k, v, out, lse, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                        mask=None, score=None, stream: int = 0, to_device=None) -> None:
    """Write attention of ``q`` [B, Hq, Q, D], ``k``/``v`` [B, Hkv, KV, D] into ``out``
    [B, Hq, Q, D] (q's dtype, contiguous) and ``lse`` [B, Hq, Q] (natural log, float32;
    float64 for float64 host inputs). Mod arguments as ``flexattn.flex_attention``."""
    spec = AttentionSpec.from_args(score_mod, block_mask, scale, enable_gqa, mask, score)
    shape = check_inputs(q, k, v, spec)
    _check_destination("out", out, (shape.batch, shape.q_heads, shape.q_len, shape.v_head_dim), dtype_name(q))
    _check_destination("lse", lse, (shape.batch, shape.q_heads, shape.q_len), lse_dtype(q))
    if device_type(q) != "cuda":
        o, lse_host = _host_attention(*(np.from_dlpack(x) for x in (q, k, v)), score=spec.score, mask=spec.mask,
                               block_mask=spec.block_mask, scale=spec.scale, enable_gqa=enable_gqa,
                               return_lse=True)
        np.from_dlpack(out)[...] = o
        np.from_dlpack(lse)[...] = lse_host
        return
    reason = kernel_unsupported(q, shape)
    if reason:
        raise ValueError(f"{reason} (host arrays run the exact reference)")
    if device_type(lse) != "cuda" or device_type(out) != "cuda" or dtype_name(lse) != "float32":
        raise ValueError("out and lse must be CUDA arrays (lse float32) for CUDA inputs")
    forward_into(q, k, v, out, lse, shape, spec, Device(int(stream), _DeviceCopies(to_device)))


class _DeviceCopies:
    """CUDA arrays pass as they are (contiguous, the caller's); host arrays go through ``to_device``."""

    def __init__(self, to_device):
        self.to_device = to_device

    def __call__(self, x):
        if device_type(x) == "cuda":
            return x
        if self.to_device is None:
            raise ValueError(
                "flexattn.dlpack: this call reads a host array on the GPU (a block mask's lists or a numpy"
                " capture); pass to_device= (host array -> CUDA DLPack array, e.g. cupy.asarray)")
        return self.to_device(x)


def _check_destination(name, x, shape, dtype):
    if tuple(x.shape) != shape or dtype_name(x) != dtype:
        raise ValueError(f"{name} must be {dtype} {list(shape)}, got {dtype_name(x)} {list(x.shape)}")

