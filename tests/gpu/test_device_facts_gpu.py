"""GPU: the driver's answers the planners read (kernels/hopper/device_facts.py) — the SM
count, and how many clusters are resident at once, for every cluster size up to the
non-portable 16. Skipped without CUDA."""

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from flexattn.kernels.hopper import device_facts  # noqa: E402


def test_sm_count_is_torchs():
    assert device_facts.sm_count(0) == torch.cuda.get_device_properties(0).multi_processor_count


@pytest.mark.parametrize("size", [1, 2, 4, 8, 13, 16])
def test_resident_clusters_at_every_size(size):
    """A CTA that fills an SM: at most SMs / size clusters (a cluster lives in one GPC, so
    possibly fewer), at least one. Sizes past 8 need the non-portable attribute, which the
    query sets (it answered CUDA_ERROR_INVALID_CLUSTER_SIZE for 13 before, session 75)."""
    sms = device_facts.sm_count(0)
    whole_sm = device_facts.max_active_clusters(0, size)
    assert 1 <= whole_sm <= sms // size
    # Two CTAs' worth of shared memory per SM never holds fewer clusters than one.
    half_sm = device_facts.max_active_clusters(0, size, smem_bytes=100 * 1024)
    assert whole_sm <= half_sm <= 2 * sms // size


def test_the_empty_kernel_launches_on_torchs_stream_and_leaves_the_context_as_it_was():
    """decode_floor's shared-memory config step and the occupancy query load the empty entry
    through the same two helpers: loaded with a carveout and shared memory, it launches on
    torch's stream; the caller's current context is the same before and after."""
    from cuda.bindings import driver

    ok = device_facts.driver_checker("test")
    torch.cuda.synchronize()
    before = ok(driver.cuCtxGetCurrent())
    with device_facts.primary_context(torch.cuda.current_device(), ok) as dev:
        module, fn, smem = device_facts.load_empty_kernel(ok, dev, 100 << 10, carveout=100)
    assert smem == 100 << 10
    assert int(ok(driver.cuCtxGetCurrent())) == int(before)
    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ok(driver.cuLaunchKernel(fn, 2 * sms, 1, 1, 32, 1, 1, smem, stream, None, 0))
    torch.cuda.synchronize()
    ok(driver.cuModuleUnload(module))
    # Without a size: an SM's whole opt-in shared memory (Hopper: 227 KB).
    with device_facts.primary_context(0, ok) as dev:
        module, _, whole = device_facts.load_empty_kernel(ok, dev)
        ok(driver.cuModuleUnload(module))
    assert whole == 227 * 1024


def test_a_driver_error_names_what_failed():
    ok = device_facts.driver_checker("the empty kernel's shared memory")
    with device_facts.primary_context(0, ok) as dev:
        with pytest.raises(RuntimeError, match="the empty kernel's shared memory: CUDA driver error"):
            device_facts.load_empty_kernel(ok, dev, 1 << 30)   # (1 GiB of shared memory: refused)
