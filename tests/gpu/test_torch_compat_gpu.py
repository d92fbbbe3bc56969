"""Compatibility (issue 25, item 6), GPU half: every case of tests/compat_cases.py through
``flexattn.torch`` on the GPU (bf16 kernels, block masks built on the GPU) against the same
code on the CPU in float64 (the exact reference, itself equal to torch's eager calls:
tests/test_torch_compat.py). Outputs are not poisoned here (the public API allocates
them); tests/gpu/test_flex_attention_gpu.py poisons the core's."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")

from compat_cases import CASES, libraries, outputs  # noqa: E402


@pytest.mark.parametrize("case", sorted(CASES))
def test_case_on_the_gpu_matches_the_reference(case):
    _, ours = libraries()
    got = outputs(case, ours, "cuda", torch.bfloat16)
    want = outputs(case, ours, "cpu", torch.float64)
    assert len(got) == len(want), case
    for g, w in zip(got, want):
        g, w = g.double().cpu().numpy(), w.numpy()
        assert not np.isnan(g).any(), f"{case}: NaN"
        live = np.isfinite(w)
        assert np.array_equal(live, np.isfinite(g)), f"{case}: -inf rows differ"
        assert np.abs(g[live] - w[live]).max() < 3e-2 * max(1.0, np.abs(w[live]).max() / 10), case
