"""Compatibility (issue 25, item 6), CPU half: every case of tests/compat_cases.py — torch
FlexAttention code as torch users write it — gives the same result through torch's
``flex_attention`` (eager, CPU) and ``flexattn.torch.flex_attention``."""

import pytest
import torch

from compat_cases import CASES, libraries, outputs


@pytest.mark.parametrize("case", sorted(CASES))
def test_case_matches_torch(case):
    torch_lib, ours = libraries()
    want = outputs(case, torch_lib, "cpu", torch.float64)
    got = outputs(case, ours, "cpu", torch.float64)
    assert len(got) == len(want), case
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.to(g.dtype), atol=1e-6, rtol=1e-6, msg=case)
