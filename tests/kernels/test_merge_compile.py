"""CPU: the context-parallel merge kernel (``kernels.merge.partial``) compiles for sm_90a at
every value head dim the forward writes, with vector loads where rows split evenly across a
warp's lanes."""

import re

import pytest

pytest.importorskip("cutlass")

from flexattn.kernels.launch.compile import compile_merge, resource_usage_from_ptx  # noqa: E402


@pytest.mark.parametrize("dtype,dv,vector", [("bf16", 128, True), ("fp16", 64, True), ("bf16", 256, True),
                                             ("bf16", 80, False)])
def test_merge_compiles(dtype, dv, vector):
    ptx = compile_merge(dtype, dv, keep_ptx=True, tvm_ffi=True).__ptx__
    loads = set(re.findall(r"ld\.global(?:\.v\d)?\.b\d+", ptx))
    stores = set(re.findall(r"st\.global(?:\.v\d)?\.b\d+", ptx))
    # the two LSEs, then the rows: fp32 acc and the partial in its 16-bit dtype
    assert "ld.global.b32" in loads
    if vector:
        width = dv // 32
        assert f"ld.global.v{min(width, 4)}.b32" in loads and f"st.global.v{min(width, 4)}.b32" in stores, (loads, stores)
    else:
        assert "ld.global.b16" in loads
    usage = resource_usage_from_ptx(ptx)     # None without ptxas on PATH
    assert usage is None or (usage.spill_store_bytes, usage.spill_load_bytes, usage.stack_bytes) == (0, 0, 0), usage
