#!/usr/bin/env bash
# Context parallelism on a multi-GPU device machine (kind nvidia-h100-x4): the CP GPU tests,
# then the weak-scaling benchmark side by side with torch's context parallelism, with one
# profiled step per row and rank (NCCL overlap, idle time, costliest kernels) in $OUT/traces.tgz.
# Usage (device tool, carry [".gpu"]):  bash benchmarks/context_parallel_suite.sh tests|bench|all [bench args,
# e.g. --masks documents16 --impls "flexattn direct" torch]. On 4 H200s: ~5 min of tests, ~4.5 min of benchmark
# (W 1, 2, 4; causal and documents16, direct and torch): one device call (10 min at most) each.
# Results: $OUT/tests.txt, $OUT/bench.txt/.json.
source .gpu/activate.sh
OUT=${OUT:-/tmp/cp_out}
mkdir -p "$OUT"
PART=${1:-all}; shift
if [ "$PART" = tests ] || [ "$PART" = all ]; then
timeout 330 python -m pytest -q -x --tb=short -p no:warnings tests/gpu/test_context_parallel_gpu.py > "$OUT/tests.txt" 2>&1
echo "CP GPU tests: pytest exit $? (124: timed out, 139: crashed)"   # a crash leaves no summary line
tail -c 1500 "$OUT/tests.txt" | grep -v "^  \|^$" | tail -8
fi
[ "$PART" = tests ] && exit 0
cd benchmarks || exit 1
timeout 340 python bench_context_parallel.py --worlds 1 2 4 --per-gpu 65536 --iters 3 \
    --impls "flexattn ring" "flexattn direct" torch --trace "$OUT/traces" --trace-ranks 0 1 2 3 --out "$OUT/bench.json" "$@" \
    > "$OUT/bench.txt" 2>&1
grep '^|\|UTC\|by rank' "$OUT/bench.txt" | tail -60
# the device tool returns at most 8 files: every rank's traces in one archive
[ -d "$OUT/traces" ] && tar czf "$OUT/traces.tgz" -C "$OUT" traces && rm -rf "$OUT/traces"
