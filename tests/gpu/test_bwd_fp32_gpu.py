"""GPU: the float32 backward (issue 25, kernels/bwd/tf32_sync.py) against the float64
reference, through test_bwd_gpu.py's harness (our forward for O and LSE, the planner's
backward config, NaN-poisoned outputs and workspace, buffer gradients compared): the
warp-MMA kernel under 3xTF32 ("fp32") and one tf32 pass ("tf32"). A file of its own so that
gpu_suites.sh runs it beside test_fp32_gpu.py. Skipped without CUDA."""

import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")

from mod_cases import CASES  # noqa: E402
from flexattn import mods, reference  # noqa: E402
from flexattn.core import AttentionSpec  # noqa: E402
from test_bwd_gpu import check_case, kernel_backward  # noqa: E402

# Every block structure, score-mod derivatives, buffer gradients, GQA, strided
# inputs, odd lengths, head dims 32..256 (80: tile_m 64).
FP32 = [
    ("none", "fp32", 128, 2, 4, 2, 300, 257, "bhsd"),
    ("causal", "fp32", 128, 1, 4, 1, 513, 513, "bshd"),        # MQA, strided
    ("causal", "tf32", 64, 2, 6, 3, 333, 129, "bhsd"),         # Q > KV
    ("sliding_window", "fp32", 64, 1, 4, 2, 700, 700, "bhsd"),
    ("band", "tf32", 128, 1, 2, 2, 600, 600, "bhsd"),          # walked by arithmetic
    ("document", "tf32", 128, 2, 2, 2, 384, 384, "bhsd"),      # block-sparse lists
    ("alibi", "fp32", 128, 1, 8, 8, 300, 300, "bhsd"),         # slope gradients
    ("softcap", "fp32", 80, 2, 4, 2, 211, 257, "bhsd"),        # tile_m 64
    ("relative_bias", "tf32", 64, 2, 4, 2, 250, 250, "bhsd"),  # table gradients (GQA)
    ("bias", "fp32", 32, 1, 2, 2, 130, 140, "bhsd"),           # dense bias gradient
    ("window_document_alibi_softcap", "fp32", 256, 1, 4, 2, 300, 300, "bhsd"),
    ("causal_softcap", "tf32", 192, 1, 2, 2, 400, 400, "bhsd"),
    ("causal", "fp32", 192, 1, 2, 2, 400, 400, "bhsd"),        # dK / dV in column pieces
    ("prefix_lm", "fp32", 96, 2, 2, 1, 200, 260, "bhsd"),
    ("none", "fp32", 64, 1, 1, 1, 1, 1, "bhsd"),               # one element
]


@pytest.mark.parametrize("case", FP32, ids=lambda c: "-".join(map(str, c)))
def test_float32(case):
    name, dtype_name, D, B, Hq, Hkv, Q, KV, layout = case
    seed = zlib.crc32(repr(case).encode())
    mask, score, _, _ = CASES[name](np.random.default_rng(seed), B, Hq, Q, KV)
    check_case(name, dtype_name, D, B, Hq, Hkv, Q, KV, mask, score, layout=layout, seed=seed % 1000,
               with_dlse=name == "causal")


def test_float32_from_dlpack_runner():
    case = FP32[6]
    name, dtype_name, D, B, Hq, Hkv, Q, KV, layout = case
    mask, score, _, _ = CASES[name](np.random.default_rng(7), B, Hq, Q, KV)
    check_case(name, dtype_name, D, B, Hq, Hkv, Q, KV, mask, score, layout=layout, seed=7, ffi=False)


@pytest.mark.parametrize("D,Dv,passes", [(192, 128, 3), (128, 64, 1)])
def test_float32_value_head_dim_apart(D, Dv, passes):
    """Value head dims apart from the query's (DeepSeek's 192/128, 128/64): dV and the dP^T
    GEMM run Dv, dK, dQ and S^T run D."""
    torch.manual_seed(D + Dv)
    B, Hq, Hkv, S = 1, 4, 2, 333
    q, k = torch.randn(B, Hq, S, D, device="cuda"), torch.randn(B, Hkv, S, D, device="cuda")
    v, do = torch.randn(B, Hkv, S, Dv, device="cuda"), torch.randn(B, Hq, S, Dv, device="cuda")
    spec = AttentionSpec.from_args(score=mods.softcap(20.0), mask=mods.causal(), enable_gqa=True)
    dq, dk, dv, *_ = kernel_backward(q, k, v, do, spec, tf32_passes=passes)
    want = reference.backward(q.cpu(), k.cpu(), v.cpu(), do.cpu(), None, spec=spec)
    refs = (want.dq, want.dk, want.dv)
    top = max(np.abs(r).max() for r in refs)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), refs):
        got = got.double().cpu().numpy()
        assert not np.isnan(got).any(), name
        assert np.abs(got - ref).max() / top < (1e-4 if passes == 3 else 1.5e-2), name
