"""torch's CUDA devices as the core sees them: the pieces of a launch that are facts of the
device and its current stream, shared by every route of the adapter (eager calls, the
custom ops of compiled graphs, decoding, block masks built on the GPU).

- ``_forward_device``: the core's ``Device`` for a launch — the current stream, host →
  GPU copies kept per array (``_DeviceCopies``), the backward's allocator, torch's float32
  matmul precision (3xTF32 under "highest"), the decode workspace, the tile tickets and
  the zero-copy views of caches (``_page_view``, ``_heads_view``);
- allocations: ``_written_empty`` (no deterministic NaN fill for arrays the kernels write
  in full), ``_kept_empty`` (arrays that outlive a call, made by a helper thread so that
  no CUDA graph's memory pool holds them);
- device facts: SM counts, the current raw stream;
- ``create_block_mask(device="cuda")``'s arrays (``_block_mask_arrays``, registered with
  the block-mask layer on import).
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import torch

from ..blockmask import DeviceArrays as BlockMaskArrays, register_device as register_block_mask_device
from ..core.decode_device import decode_workspace
from ..core.kernel_path import Device
from ..core.prepared import HostCopies


_SM_COUNTS: dict = {}


def _sm_count(dev) -> int:
    num_sms = _SM_COUNTS.get(dev.index)
    if num_sms is None:
        num_sms = _SM_COUNTS[dev.index] = torch.cuda.get_device_properties(dev).multi_processor_count
    return num_sms


def _current_raw_stream(index: int) -> int:
    """The current stream's handle on device ``index`` (torch's private accessor, ~10x
    cheaper than ``torch.cuda.current_stream``; the public one where it is gone)."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get is not None:
        return get(index)
    return torch.cuda.current_stream(index).cuda_stream


def _decode_workspace(dev, stream):
    """The decode kernel's workspace on ``stream`` of ``dev`` (``core/decode_device.py``):
    its arrays are torch's, kept across calls, so they are allocated by a thread of ours
    (``_kept_empty``), never in a CUDA graph's memory pool."""
    def alloc(shape, dtype, zeroed):
        x = _kept_empty(shape, getattr(torch, dtype), dev, stream)
        if zeroed:
            with torch.cuda.stream(stream):
                x.zero_()
        return x

    return decode_workspace(dev.index, stream.cuda_stream, alloc)


def _kept_empty(shape, dtype, dev, stream) -> torch.Tensor:
    """An uninitialized tensor that outlives the call, used on ``stream``: allocated by a
    helper thread, because torch routes every allocation of the thread that warms up or
    records a CUDA graph to the graph's memory pool, and CUDA graph trees
    (``mode="reduce-overhead"``) refuse pool memory the graph's outputs do not account
    for. Marked used by ``stream``, so its memory is reused only after that work."""
    def make():   # (no deterministic NaN fill: it would run on the helper's stream, unordered with ``stream``)
        with torch.cuda.device(dev):
            return _written_empty(*shape, dtype=dtype, device=dev)

    x = _ALLOCATOR.submit(make).result()
    x.record_stream(stream)
    return x


_ALLOCATOR = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flexattn-alloc")


def _written_empty(*shape, dtype, device):
    """torch.empty for arrays the kernels write in full (outputs, workspaces they
    initialize themselves), without the NaN fill that torch.use_deterministic_algorithms
    adds to every allocation (torch.utils.deterministic.fill_uninitialized_memory): that
    fill is an extra kernel per array (~116 µs per training step at B4 S4096 H16)."""
    fill = torch.utils.deterministic
    if fill.fill_uninitialized_memory and torch.are_deterministic_algorithms_enabled():
        fill.fill_uninitialized_memory = False
        try:
            return torch.empty(*shape, dtype=dtype, device=device)
        finally:
            fill.fill_uninitialized_memory = True
    return torch.empty(*shape, dtype=dtype, device=device)


def _forward_device(dev) -> Device:
    """The core's view of a CUDA device for kernel launches (forward and backward): its
    current stream (which TVM-FFI reads from torch itself), cached host→GPU copies, and
    for float32 inputs scratch memory and torch's float32 matmul precision ("highest":
    3xTF32, as accurate as torch flex's float32 products; "high" / "medium": tf32)."""
    stream = torch.cuda.current_stream(dev)
    copies = _DeviceCopies(dev)
    return Device(stream.cuda_stream, copies, tvm_ffi_stream=True, same_memory=copies.same_memory,
                  decode_resources=lambda: (_sm_count(dev), _decode_workspace(dev, stream)),
                  alloc=_backward_alloc(dev), tf32_passes=3 if torch.get_float32_matmul_precision() == "highest" else 1,
                  tile_tickets=lambda: _tile_tickets(dev), page_view=_page_view, heads_view=_heads_view)


def _page_view(x: torch.Tensor, block: int, fold: bool = False):
    """``Device.page_view``: [B, H, KV, D] keys or values that every sequence shares (batch
    1, or a stride-0 batch) as pages [KV / block, block, H, D], a view; with ``fold``, a
    batch whose stride is H head strides as pages of B x H heads; else None."""
    batch, heads, length, dim = x.shape
    if length % block:
        return None
    sb, sh, sk, sd = x.stride()
    if not fold:
        if not (batch == 1 or sb == 0):
            return None
        # (one as_strided, not index / unflatten / permute: ~3x less host time per call)
        return x.as_strided((length // block, block, heads, dim), (block * sk, sk, sh, sd), x.storage_offset())
    if sb != heads * sh or sd != 1:
        return None
    return x.as_strided((length // block, block, batch * heads, dim), (block * sk, sk, sh, 1), x.storage_offset())


def _heads_view(x: torch.Tensor, copy: bool):
    """``Device.heads_view``: [B, H, ...] as [1, B x H, ...]."""
    shape = (1, x.shape[0] * x.shape[1], *x.shape[2:])
    try:
        return x.view(shape)
    except RuntimeError:   # strides that do not merge
        return x.reshape(shape) if copy else None


def _tile_tickets(dev):
    """The tile tickets' counter for a forward launch on ``dev``'s current stream (read at
    each launch: a prepared call may be repeated on another stream): the stream's decode
    workspace counters, which the kernels leave zero (no allocation, no fill per call);
    while a CUDA graph is being captured, a zero of the graph's own."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(1, dtype=torch.int32, device=dev)
    return _decode_workspace(dev, torch.cuda.current_stream(dev)).tickets(1)


def _write_target(name, t, size: tuple, dtype, device):
    """``t``, a tensor a kernel is to write an output into (a view: rows of a larger array),
    checked: ``size`` and ``dtype`` on ``device``, its last dim contiguous."""
    if tuple(t.shape) != size or t.dtype != dtype or t.device != device or t.stride(-1) != 1:
        raise ValueError(f"the {name} target must be {size} {dtype} on {device} with its last dim contiguous, "
                         f"got {tuple(t.shape)} {t.dtype} on {t.device}, strides {t.stride()}")
    return t


def _backward_alloc(dev):
    """The backward's allocator (``core.backward_path.Allocator``) on ``dev``: workspaces
    the preprocess initializes are left unfilled."""
    def alloc(shape_, dtype, zeroed):
        if zeroed:
            return torch.zeros(shape_, dtype=getattr(torch, dtype), device=dev)
        return _written_empty(shape_, dtype=getattr(torch, dtype), device=dev)
    return alloc


class _DeviceCopies(HostCopies):
    """Tensors and host arrays → contiguous tensors on ``device`` (host arrays through
    ``core.prepared.HostCopies``: read-only ones copied once per array and device)."""

    _cache: dict = {}   # this adapter's copies

    def __init__(self, device):
        self.device = device

    def copy(self, array):
        return torch.from_numpy(array).to(self.device)

    def __call__(self, x):
        if isinstance(x, torch.Tensor):
            return x.detach().to(self.device).contiguous()
        return self.host(x)

    def same_memory(self, x):
        """``Device.same_memory``: a tensor this returns as a view of itself (on the device,
        contiguous) is keyed by its data pointer, dtype and shape; anything else None."""
        if isinstance(x, torch.Tensor) and x.device == self.device and x.is_contiguous():
            return x.data_ptr(), x.dtype, x.shape
        return None


def _like(array: np.ndarray, ref: torch.Tensor, dtype=None) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device=ref.device, dtype=dtype or ref.dtype)


_INDEX_DTYPES = {"int8": torch.int8, "int32": torch.int32, "int64": torch.int64}


def _block_mask_arrays(device):
    """``create_block_mask(..., device="cuda")``: the GPU builder allocates torch tensors
    and launches on the current stream of the current CUDA device; None (host build) where
    CUDA is unavailable."""
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError, ValueError):
        return None
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    current = torch.cuda.current_device()
    if dev.index is None:
        dev = torch.device("cuda", current)
    elif dev.index != current:
        raise ValueError(f"create_block_mask: device={device!r} is not the current CUDA device"
                         f" (cuda:{current}); build it under torch.cuda.device({dev.index})")
    stream = torch.cuda.current_stream(dev)
    return BlockMaskArrays(
        device=str(dev), stream=stream.cuda_stream,
        empty=lambda shape, dtype: torch.empty(shape, dtype=_INDEX_DTYPES[dtype], device=dev),
        to_device=_DeviceCopies(dev), tvm_ffi_stream=True, download=lambda x: _download(x, stream))


def _download(x: torch.Tensor, stream):
    """Start copying ``x`` to pinned host memory in ``stream``'s order; the poll returns
    its numpy view once the copy has landed, None before (``DeviceArrays.download``)."""
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        host.copy_(x, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return lambda: host.numpy() if done.query() else None


register_block_mask_device(_block_mask_arrays)
