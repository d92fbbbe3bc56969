"""Facts about a GPU that kernel *configurations* depend on, read once per device.

Queried from the driver at planning time, never while a kernel is traced (kernels take
such facts as config values, so they also compile on machines without a GPU).
"""

import contextlib
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


def persistent_ctas(x, cluster_size: int = 1) -> int:
    """CTAs a persistent kernel should launch for array ``x``: one per SM of its CUDA
    device, or with clusters of ``cluster_size`` CTAs as many as can be resident at once;
    0 (no persistence) for arrays elsewhere (planning without a GPU: tests)."""
    kind, ordinal = x.__dlpack_device__()
    if int(kind) != _DL_CUDA:
        return 0
    if cluster_size == 1:
        return sm_count(int(ordinal))
    return cluster_size * max_active_clusters(int(ordinal), cluster_size)


# An empty kernel to ask the driver about clusters: occupancy questions need a function,
# and the answer for a CTA that takes a whole SM's shared memory is the GPU's own.
_EMPTY_PTX = b""".version 8.0
.target sm_90a
.address_size 64
.visible .entry flexattn_empty() { ret; }
"""


def driver_checker(what: str):
    """``ok(result)`` for cuda.bindings' driver calls: raises ``RuntimeError`` naming
    ``what`` on an error code, else returns the call's value (a tuple if several, None if none)."""
    def ok(result):
        err, *rest = result
        if int(err) != 0:
            raise RuntimeError(f"{what}: CUDA driver error {err}")
        return (rest[0] if len(rest) == 1 else rest) if rest else None
    return ok


@contextlib.contextmanager
def primary_context(device_id: int, ok):
    """CUDA device ``device_id``'s primary context (the one torch, CuPy and the runtime
    use), current for the ``with`` block only: the caller's current device and context
    stay as they were. Yields the driver's device handle."""
    from cuda.bindings import driver

    ok(driver.cuInit(0))
    dev = ok(driver.cuDeviceGet(device_id))
    ctx = ok(driver.cuDevicePrimaryCtxRetain(dev))
    ok(driver.cuCtxPushCurrent(ctx))
    try:
        yield dev
    finally:
        driver.cuCtxPopCurrent()
        driver.cuDevicePrimaryCtxRelease(dev)


def load_empty_kernel(ok, dev, smem_bytes: int | None = None, carveout: int | None = None):
    """(module, function, dynamic shared bytes): the empty sm_90a entry loaded into the
    current context, allowed ``smem_bytes`` of dynamic shared memory (None: all an SM's
    opt-in shared memory) and, given ``carveout``, that preferred L1 / shared split in
    percent. The caller unloads the module (``cuModuleUnload``) when done with it."""
    from cuda.bindings import driver

    module = ok(driver.cuModuleLoadData(_EMPTY_PTX))
    try:
        fn = ok(driver.cuModuleGetFunction(module, b"flexattn_empty"))
        attrs = driver.CUfunction_attribute
        if smem_bytes is None:
            smem_bytes = ok(driver.cuDeviceGetAttribute(
                driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev))
        if carveout is not None:
            ok(driver.cuFuncSetAttribute(fn, attrs.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, carveout))
        ok(driver.cuFuncSetAttribute(fn, attrs.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes))
    except Exception:
        driver.cuModuleUnload(module)
        raise
    return module, fn, smem_bytes


@functools.cache
def max_active_clusters(device_id: int, cluster_size: int, threads: int = 128, smem_bytes: int | None = None) -> int:
    """How many clusters of ``cluster_size`` CTAs can be resident at once on CUDA device
    ``device_id``: CTAs of ``threads`` threads, each filling an SM (all its shared memory)
    or, given ``smem_bytes``, taking that much dynamic shared memory (largest carveout).
    Registers are not modelled (an empty kernel answers): kernels whose launch bounds give
    the same CTAs per SM get the same answer. Not simply SMs / cluster_size: a cluster
    must fit inside one GPC, so SMs of a GPC that cannot form a whole cluster stay idle.
    A launch must not ask for more, or the extra clusters would run after the others, as
    a second wave."""
    from cuda.bindings import driver

    ok = driver_checker(f"cannot read cluster occupancy of CUDA device {device_id}")
    with primary_context(device_id, ok) as dev:
        module, fn, smem = load_empty_kernel(ok, dev, smem_bytes, None if smem_bytes is None else 100)
        try:
            if cluster_size > 8:   # past the portable size the function must allow it (as CuTeDSL's kernels do)
                ok(driver.cuFuncSetAttribute(
                    fn, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1))
            config = driver.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = cluster_size, 1, 1
            config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
            config.sharedMemBytes = smem
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster_size, 1, 1
            config.attrs = [attr]
            config.numAttrs = 1
            return int(ok(driver.cuOccupancyMaxActiveClusters(fn, config)))
        finally:
            driver.cuModuleUnload(module)
