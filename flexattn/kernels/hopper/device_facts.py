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

    def ok(result):
        err, *rest = result
        if int(err) != 0:
            raise RuntimeError(f"cannot read cluster occupancy of CUDA device {device_id}: {err}")
        return (rest[0] if len(rest) == 1 else rest) if rest else None

    # The device's primary context (the one torch / CuPy / the runtime use), made current
    # for this query only: the caller's current device and context stay as they were.
    ok(driver.cuInit(0))
    dev = ok(driver.cuDeviceGet(device_id))
    ctx = ok(driver.cuDevicePrimaryCtxRetain(dev))
    ok(driver.cuCtxPushCurrent(ctx))
    module = None
    try:
        module = ok(driver.cuModuleLoadData(_EMPTY_PTX))
        fn = ok(driver.cuModuleGetFunction(module, b"flexattn_empty"))
        attrs = driver.CUfunction_attribute
        smem = smem_bytes
        if smem is None:
            smem = ok(driver.cuDeviceGetAttribute(
                driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev))
        else:
            ok(driver.cuFuncSetAttribute(fn, attrs.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100))
        ok(driver.cuFuncSetAttribute(fn, attrs.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
        if cluster_size > 8:   # past the portable size the function must allow it (as CuTeDSL's kernels do)
            ok(driver.cuFuncSetAttribute(fn, attrs.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1))
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
        if module is not None:
            driver.cuModuleUnload(module)
        driver.cuCtxPopCurrent()
        driver.cuDevicePrimaryCtxRelease(dev)
