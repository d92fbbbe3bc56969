"""CPU: the context-parallel merge kernel (``kernels.merge.partial``) compiles for sm_90a at
every value head dim the forward writes, with vector loads where rows split evenly across a
warp's lanes."""

import re

import pytest

pytest.importorskip("cutlass")

from flexattn.kernels.launch.compile import compile_merge, resource_usage_from_ptx  # noqa: E402


@pytest.mark.parametrize("dtype,dv,vector,acc", [("bf16", 128, True, "fp32"), ("fp16", 64, True, "fp32"),
                                                 ("bf16", 256, True, "fp32"), ("bf16", 80, False, "fp32"),
                                                 ("bf16", 128, True, "bf16"), ("fp16", 80, False, "fp16")])
def test_merge_compiles(dtype, dv, vector, acc):
    ptx = compile_merge(dtype, dv, acc_dtype=acc, keep_ptx=True, tvm_ffi=True).__ptx__
    loads = set(re.findall(r"ld\.global(?:\.v\d)?\.b\d+", ptx))
    stores = set(re.findall(r"st\.global(?:\.v\d)?\.b\d+", ptx))
    # the two LSEs, then the rows: the accumulator (fp32, or the result's own 16-bit rows)
    # and the partial in its 16-bit dtype
    assert "ld.global.b32" in loads
    if vector:
        # a lane's columns of the accumulator in one vector access (16-bit: 4 columns, 8 bytes)
        vecs = {f"v{min(dv // 32, 4)}.b32"} if acc == "fp32" else {"v2.b32", "v4.b16"}
        assert any(f"ld.global.{v}" in loads for v in vecs) and any(f"st.global.{v}" in stores for v in vecs), \
            (loads, stores)
    else:
        assert "ld.global.b16" in loads
        if acc != "fp32":
            assert "st.global.b16" in stores, stores
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
