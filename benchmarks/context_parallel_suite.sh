#!/usr/bin/env bash
# Context parallelism on a multi-GPU device machine (kind nvidia-h100-x4): the CP GPU tests,
# then the weak-scaling benchmark side by side with torch's context parallelism, with one
# profiled step per row (NCCL overlap, idle time, costliest kernels) under $OUT/traces.
# Usage (device tool, carry [".gpu"]):  bash benchmarks/context_parallel_suite.sh [bench args, e.g. --kv-heads 2]
# ~2.5 min of tests, ~4 min of benchmark (W 1, 2, 4) on 4 H100s. Results: $OUT/tests.txt, $OUT/bench.txt/.json.
source .gpu/activate.sh
OUT=${OUT:-/tmp/cp_out}
mkdir -p "$OUT"
timeout 240 python -m pytest -q -x --tb=short tests/gpu/test_context_parallel_gpu.py > "$OUT/tests.txt" 2>&1
grep -v "Warning\|warn\|^  \|^$\|^tests/" "$OUT/tests.txt" | tail -8
cd benchmarks || exit 1
timeout 340 python bench_context_parallel.py --worlds 1 2 4 --per-gpu 65536 --iters 3 \
    --impls "flexattn ring" "flexattn direct" torch --trace "$OUT/traces" --trace-ranks 0 --out "$OUT/bench.json" "$@" \
    > "$OUT/bench.txt" 2>&1
grep '^|\|UTC' "$OUT/bench.txt" | tail -40
