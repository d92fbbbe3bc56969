"""How many decode CTAs the GPU keeps resident, with and without clusters (the driver's
occupancy calculator on the compiled decode kernel, ``cuOccupancyMaxActiveClusters``).

A cluster merge only pays if every cluster of a step is resident at once: a launch of
B 8 x Hkv 8 groups x 4 splits needs 64 clusters of 4 (256 CTAs). For each kernel shape
(the default 64x2x2 tuning and the two-warpgroup 64x6x1) and cluster size this prints the
resident CTAs per SM without clusters and the resident clusters (x size = CTAs).

    python3 benchmarks/decode_clusters.py
"""

import tempfile

from cuda.bindings import driver


def _check(result):
    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA error {err}")
    return result[1] if len(result) == 2 else result[1:]


def kernel_function(cfg):
    """The compiled decode kernel of `cfg` as a CUfunction (its cubin loaded as a library)."""
    from flexattn.kernels.compile import ARCH_OPTION, _dump_dir, compile_kernel
    from flexattn.kernels.decode_compile import fake_decode_args
    from flexattn.kernels.decode_sm90 import DecodeSm90

    with tempfile.TemporaryDirectory() as d, _dump_dir(d):
        compiled = compile_kernel(DecodeSm90(cfg), fake_decode_args(cfg), ARCH_OPTION + " --keep-cubin", False)
    library = _check(driver.cuLibraryLoadData(compiled.__cubin__, None, None, 0, None, None, 0))
    kernels = _check(driver.cuLibraryEnumerateKernels(1, library))
    return _check(driver.cuKernelGetFunction(kernels[0]))


def resident(cfg, cluster: int) -> tuple:
    """(CTAs per SM, clusters of `cluster` CTAs resident at once) for `cfg`'s kernel."""
    fn = kernel_function(cfg)
    smem = cfg.smem_bytes
    threads = 128 * (1 + cfg.num_mma_wg)
    attr = driver.CUfunction_attribute
    _check(driver.cuFuncSetAttribute(fn, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
    _check(driver.cuFuncSetAttribute(fn, attr.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100))
    per_sm = _check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, threads, smem))
    config = driver.CUlaunchConfig()
    config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
    config.gridDimX, config.gridDimY, config.gridDimZ = cluster, 64, 8
    config.sharedMemBytes = smem
    a = driver.CUlaunchAttribute()
    a.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    v = driver.CUlaunchAttributeValue()
    v.clusterDim.x, v.clusterDim.y, v.clusterDim.z = cluster, 1, 1
    a.value = v
    config.attrs = [a]
    config.numAttrs = 1
    clusters = _check(driver.cuOccupancyMaxActiveClusters(fn, config))
    return per_sm, clusters


def main():
    import torch

    from flexattn.kernels.decode_sm90 import DecodeConfig

    torch.cuda.init()
    torch.zeros(1, device="cuda")          # a current context for the driver calls
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"# {torch.cuda.get_device_name()}, {sms} SMs")
    print("| tuning | cluster | CTAs/SM | resident clusters | resident CTAs |")
    print("|---|---|---|---|---|")
    shapes = {"64x2x2": dict(tile_n=64, num_stages=2, ctas_per_sm=2),
              "64x6x1 (2 wg)": dict(tile_n=64, num_stages=6, ctas_per_sm=1, num_mma_wg=2)}
    for name, kw in shapes.items():
        for cluster in (1, 2, 4, 8):
            per_sm, clusters = resident(DecodeConfig(cluster_splits=cluster, **kw), cluster)
            print(f"| {name} | {cluster} | {per_sm} | {clusters} | {clusters * cluster} |", flush=True)


if __name__ == "__main__":
    main()
