"""Facts about a GPU that kernel *configurations* depend on, read once per device.

Queried from the driver at planning time, never while a kernel is traced (kernels take
such facts as config values, so they also compile on machines without a GPU).
"""

import functools


@functools.cache
def sm_count(device_id: int) -> int:
    """Number of streaming multiprocessors of CUDA device ``device_id``."""
    from cuda.bindings import runtime

    err, count = runtime.cudaDeviceGetAttribute(
        runtime.cudaDeviceAttr.cudaDevAttrMultiProcessorCount, device_id)
    if err != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cannot read the SM count of CUDA device {device_id}: {err}")
    return int(count)


_DL_CUDA = 2   # DLPack device types: kDLCUDA


def persistent_ctas(x) -> int:
    """CTAs a persistent kernel should launch for array ``x``: one per SM of its CUDA
    device; 0 (no persistence) for arrays elsewhere (planning without a GPU: tests)."""
    kind, ordinal = x.__dlpack_device__()
    return sm_count(int(ordinal)) if int(kind) == _DL_CUDA else 0
