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
