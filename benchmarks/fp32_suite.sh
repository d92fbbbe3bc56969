#!/usr/bin/env bash
# float32 on one GPU (issue 25): the float32 backward's tests (kernel cases, the torch door
# against torch flex's own float32 errors, JAX gradients) in parallel processes, then the
# forward + backward benchmark beside torch flex under both float32 matmul precisions.
# Usage (device tool, carry [".gpu"]):  bash benchmarks/fp32_suite.sh [--no-bench]
set -u
source .gpu/activate.sh
out=${OUT:-/tmp/fp32-out}
mkdir -p "$out"
t() { timeout 330 python3 -m pytest -q -p no:cacheprovider "$@"; }
t tests/gpu/test_bwd_fp32_gpu.py -k "none or causal or sliding or band or document" > "$out/bwd_a.log" 2>&1 &
t tests/gpu/test_bwd_fp32_gpu.py -k "not (none or causal or sliding or band or document)" > "$out/bwd_b.log" 2>&1 &
t tests/gpu/test_fp32_gpu.py -k "training or errors" > "$out/fp32.log" 2>&1 &
t tests/gpu/test_jax_gpu.py -k "float32" > "$out/jax.log" 2>&1 &
wait
for f in bwd_a bwd_b fp32 jax; do
  echo "== $f: $(tail -1 "$out/$f.log")"
  grep -E "^(FAILED|ERROR)|Error:|assert " "$out/$f.log" | head -12
done
[ "${1:-}" = "--no-bench" ] && exit 0
cd benchmarks && timeout 240 python3 bench_fp32.py --backward --shapes 4x4096x16x128 --out "$out/bench.json" \
    > "$out/bench.log" 2>&1
grep '^|\|UTC\|failed' "$out/bench.log" | tail -12
