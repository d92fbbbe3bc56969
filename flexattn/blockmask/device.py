"""Block masks on a framework's GPU: what an adapter provides (``DeviceArrays``, registered
with ``register_device``) and the GPU builder that ``flexattn.core`` registers
(``register_gpu_builder``), so this layer never imports the kernels above it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class DeviceArrays:
    """What the GPU builder needs from a framework (adapters register a resolver with
    ``register_device``): device arrays, host→device copies, the stream to launch on."""

    device: object  # the name the block mask reports (e.g. "cuda:0")
    stream: int  # a CUstream handle
    empty: Callable  # (shape, dtype name) -> contiguous device array of the framework
    to_device: Callable  # captured value -> contiguous device array
    tvm_ffi_stream: bool = False  # TVM-FFI launches land on `stream` by themselves (torch)
    # device array -> poll(): starts an asynchronous copy to the host in stream order;
    # poll() gives the numpy copy once it has landed, None before (it never waits).
    # Lets the planner learn a GPU-built mask's tile balance without stalling the host.
    download: Callable | None = None


_DEVICE_RESOLVERS: list = []


def register_device(resolve: Callable) -> None:
    """Register ``resolve(device) -> DeviceArrays | None`` for ``create_block_mask(device=)``
    (``flexattn.torch`` registers torch's CUDA devices on import)."""
    if resolve not in _DEVICE_RESOLVERS:
        _DEVICE_RESOLVERS.append(resolve)


def _on_host(device) -> bool:
    return device is None or str(device) == "cpu"


def _device_arrays(device) -> DeviceArrays | None:
    """The registered framework's arrays on ``device``, or None (no adapter imported that
    serves it, e.g. no CUDA here)."""
    if _on_host(device):
        return None
    for resolve in reversed(_DEVICE_RESOLVERS):
        arrays = resolve(device)
        if arrays is not None:
            return arrays
    return None


class GpuBuilder:
    """The kernels behind ``create_block_mask(device=...)`` and ``varlen_block_mask(device=...)``
    (``flexattn.core.blockmask_gpu`` registers one):

    - ``build(mask, B, H, Q_LEN, KV_LEN, block_size, arrays, separate_full_blocks=True) ->
      BlockMask`` classifies every tile on the GPU and compacts the lists there (full tiles
      listed as partial unless ``separate_full_blocks``);
    - ``compact(states, arrays) -> dict`` turns device tile states into the eight lists.
    """

    def build(self, mask, B, H, Q_LEN, KV_LEN, block_size, arrays: DeviceArrays, separate_full_blocks: bool = True):
        raise NotImplementedError

    def compact(self, states, arrays: DeviceArrays) -> dict:
        raise NotImplementedError


_GPU_BUILDER: list = []


def register_gpu_builder(builder: GpuBuilder) -> None:
    """Install the GPU builder (the last registration wins)."""
    _GPU_BUILDER[:] = [builder]


def gpu_builder(device) -> tuple:
    """(builder, arrays) for a GPU ``device`` served by a registered adapter and builder,
    else (None, None): the mask is then built on the host, as torch-style code expects to
    run everywhere."""
    arrays = _device_arrays(device)
    if arrays is None or not _GPU_BUILDER:
        return None, None
    return _GPU_BUILDER[0], arrays
