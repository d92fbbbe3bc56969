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


def test_threads_compiling_at_once_take_turns():
    """Real CuTeDSL compiles from several threads at once (ranks as threads meeting a new
    kernel together): each gets its kernel — no crash, no deadlock — because every compile
    entry holds the one process-wide compile lock (``launch/compile_lock.py``; without it,
    such compiles segfaulted a GPU test process)."""
    import threading

    results, errors = {}, []

    def compile_one(dtype, dv):
        try:
            results[(dtype, dv)] = compile_merge(dtype, dv, keep_ptx=True, tvm_ffi=True).__ptx__
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=compile_one, args=case) for case in (("bf16", 128), ("fp16", 64), ("bf16", 80))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and not any(t.is_alive() for t in threads)
    assert set(results) == {("bf16", 128), ("fp16", 64), ("bf16", 80)}
    assert all(".entry" in ptx for ptx in results.values())
