"""CuPy adapter: functional, JAX-style. ``flex_attention`` returns ``(out, lse)``;
``vjp`` returns ``(out, backward)`` where ``backward(d_out, d_lse=None)`` gives the
gradients. No autograd object, no global state.

The forward runs the CuTeDSL Hopper kernel on CuPy's *current* stream
(``cupy.cuda.get_current_stream()``) through ``flexattn.core.kernel_path.forward_into``;
the outputs are allocated by CuPy on the inputs' device. ``backward`` runs the backward
kernels (``flexattn.core.backward_path.backward_into``) on the current stream, with the
forward's saved ``out`` and ``lse``. The kernels take float16 (CuPy has no bfloat16) at head
dims that are multiples of 16 (the forward up to 256, the backward from 32 to 256); other inputs raise ``ValueError`` (use ``flexattn.flex_attention`` on
host arrays for those).
"""

from __future__ import annotations

try:
    import cupy
except ImportError as e:
    raise ImportError(
        "flexattn.cupy needs CuPy: pip install cupy-cuda12x (or 'flexattn[cupy]'); CuPy needs a CUDA GPU"
    ) from e

import numpy as np

from .blockmask import BlockMask, create_block_mask
from .core.backward_path import BackwardArrays, backward_into
from .core.decode_device import decode_workspace
from .core.kernel_path import Device, backward_unsupported, forward_into, kernel_unsupported, prepare_forward
from .core.prepared import PreparedCalls, PreparedEntry, call_key
from .problem.spec import AttentionSpec
from .problem.validate import check_inputs
from .mods import MaskMod, ScoreMod, mask_mod, score_mod

__all__ = ["flex_attention", "vjp", "create_block_mask", "BlockMask", "MaskMod", "ScoreMod", "mask_mod", "score_mod"]


def flex_attention(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False, *, mask=None, score=None):
    """``(out, lse)`` for CuPy arrays ``[B, H, S, D]`` (``out`` in the query's dtype, ``lse``
    float32, natural log). Arguments as ``flexattn.torch.flex_attention``. A call that
    repeats an earlier one (the same mod / block-mask objects, arrays of the same shapes,
    strides, dtypes and device) skips checks and planning (``core/prepared.py``)."""
    call = (score_mod, block_mask, scale, enable_gqa, mask, score)
    key = _call_key(q, k, v, call)
    repeated = _PREPARED.run(key, q, k, v)
    if repeated is not None:
        return repeated
    spec = AttentionSpec.from_args(score_mod, block_mask, scale, enable_gqa, mask, score)
    out, lse = _forward(q, k, v, spec)
    if key is not None:
        _PREPARED.add(key, call, lambda: _prepare(q, k, v, spec))
    return out, lse


_PREPARED = PreparedCalls()


def _call_key(q, k, v, call):
    if not (isinstance(q, cupy.ndarray) and isinstance(k, cupy.ndarray) and isinstance(v, cupy.ndarray)):
        return None
    return call_key(call, q.shape, q.strides, k.shape, k.strides, v.shape, v.strides, q.dtype, k.dtype, v.dtype,
                    q.device.id, k.device.id, v.device.id)


class _PreparedCall(PreparedEntry):
    """A repeated call: allocate on the inputs' device, launch on the current stream.
    Only while that device is the current one (one runtime query); otherwise the full
    path switches devices around the call."""

    __slots__ = ("prepared",)

    def __init__(self, shape, q, prepared):
        super().__init__((shape.batch, shape.q_heads, shape.q_len, shape.v_head_dim), q.dtype, q.device, q.device.id)
        self.prepared = prepared

    def __call__(self, q, k, v):
        """``(out, lse)``, or None when another device is current."""
        if cupy.cuda.runtime.getDevice() != self.device_index:
            return None
        out = cupy.empty(self.out_shape, dtype=self.dtype)
        lse = cupy.empty(self.lse_shape, dtype=np.float32)
        if self.prepared.launch(q, k, v, out, lse, stream=cupy.cuda.get_current_stream().ptr) is False:
            return None   # a routed short query on another stream than its plan's
        return out, lse


def _prepare(q, k, v, spec):
    shape = check_inputs(q, k, v, spec)
    with cupy.cuda.Device(q.device.id):
        prepared = prepare_forward(q, shape, spec, _current_device())
    return None if prepared is None else _PreparedCall(shape, q, prepared)


def vjp(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False, *, mask=None, score=None,
        deterministic=False):
    """``(out, backward)``: ``backward(d_out, d_lse=None) -> (dq, dk, dv, d_captures)``, with
    ``d_captures`` one entry per score-mod capture (an array shaped and typed like a float
    buffer capture, else None). ``deterministic``: bitwise-repeatable gradients."""
    spec = AttentionSpec.from_args(score_mod, block_mask, scale, enable_gqa, mask, score)
    if isinstance(q, cupy.ndarray):   # what the backward cannot do, refused before the forward runs
        reason = backward_unsupported(check_inputs(q, k, v, spec), q)
        if reason:
            raise ValueError(reason)
    out, lse = _forward(q, k, v, spec)
    shape = check_inputs(q, k, v, spec)

    def backward(d_out, d_lse=None):
        if tuple(d_out.shape) != tuple(out.shape):
            raise ValueError(f"d_out must have the output's shape {tuple(out.shape)}, got {tuple(d_out.shape)}")
        if d_lse is not None and tuple(d_lse.shape) != tuple(lse.shape):
            raise ValueError(f"d_lse must have the LSE's shape {tuple(lse.shape)}, got {tuple(d_lse.shape)}")
        with cupy.cuda.Device(q.device.id):
            arrays = BackwardArrays(
                q=q, k=k, v=v, out=out, lse=lse,
                d_out=cupy.ascontiguousarray(cupy.asarray(d_out).astype(q.dtype, copy=False)),
                d_lse=None if d_lse is None else cupy.ascontiguousarray(cupy.asarray(d_lse).astype(np.float32, copy=False)),
                dq=cupy.empty(q.shape, dtype=q.dtype), dk=cupy.empty(k.shape, dtype=k.dtype),
                dv=cupy.empty(v.shape, dtype=v.dtype))
            result = backward_into(arrays, shape, spec, _current_device(), _alloc, deterministic=deterministic)
        captures = spec.score.captures if spec.score is not None else ()
        d_captures = tuple(None if g is None else _like_capture(g, c) for c, g in zip(captures, result.capture_grads))
        return arrays.dq, arrays.dk, arrays.dv, d_captures

    return out, backward


def _forward(q, k, v, spec):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, cupy.ndarray):
            raise TypeError(f"{name} must be a cupy.ndarray, got {type(x).__name__}")
    shape = check_inputs(q, k, v, spec)
    reason = kernel_unsupported(q, shape)
    if reason:
        raise ValueError(f"{reason} (flexattn.flex_attention runs the exact reference on host arrays)")
    with cupy.cuda.Device(q.device.id):  # allocations and the launch on the inputs' GPU
        out = cupy.empty((shape.batch, shape.q_heads, shape.q_len, shape.v_head_dim), dtype=q.dtype)
        lse = cupy.empty((shape.batch, shape.q_heads, shape.q_len), dtype=np.float32)
        forward_into(q, k, v, out, lse, shape, spec, _current_device())
    return out, lse


def _current_device() -> Device:
    """The core's view of the current CuPy device: its current stream, host→GPU copies,
    and the decode kernel's resources (short queries are routed there)."""
    stream = cupy.cuda.get_current_stream().ptr
    return Device(stream, _to_device, decode_resources=lambda: _decode_resources(stream), alloc=_alloc)


_SM_COUNTS: dict = {}


def _decode_resources(stream: int):
    """(SM count, the decode workspace of ``stream`` on the current device), CuPy arrays."""
    index = cupy.cuda.runtime.getDevice()
    num_sms = _SM_COUNTS.get(index)
    if num_sms is None:
        num_sms = _SM_COUNTS[index] = cupy.cuda.runtime.getDeviceProperties(index)["multiProcessorCount"]

    def alloc(shape, dtype, zeroed):
        with cupy.cuda.Device(index):
            return (cupy.zeros if zeroed else cupy.empty)(shape, dtype=dtype)

    return num_sms, decode_workspace(index, stream, alloc)


def _to_device(x):
    """Host/CuPy array → contiguous CuPy array on the current device (copies host arrays
    on the current stream)."""
    return cupy.ascontiguousarray(cupy.asarray(x))


def _alloc(shape, dtype, zeroed):
    """The backward's scratch and buffer-gradient arrays, on the current device."""
    return (cupy.zeros if zeroed else cupy.empty)(shape, dtype=dtype)


def _like_capture(grad, capture):
    """A buffer gradient (fp32, 0-d captures as [1]) shaped and typed like its capture."""
    dtype = getattr(capture, "dtype", None)
    dtype = dtype if dtype is not None and np.dtype(dtype).kind == "f" else grad.dtype
    return grad.reshape(tuple(capture.shape)).astype(dtype, copy=False)
