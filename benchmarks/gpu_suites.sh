#!/usr/bin/env bash
# Every GPU test suite in one device call, in parallel processes: the suites are dominated
# by kernel compiles (CPU-bound, 2-8 s each, ~16 cores on the device) while their GPU work
# is short, so groups run side by side on the one GPU. Logs land in $OUT (or /tmp).
# Usage (device tool, carry [".gpu"]):  bash benchmarks/gpu_suites.sh [seconds per group] [group ...]
# (no groups named: all of them)
set -u
source .gpu/activate.sh
out=${OUT:-/tmp/flexattn-out}
mkdir -p "$out"
limit=${1:-540}
shift $(( $# > 0 ? 1 : 0 ))
# name:seconds:files. seconds = the group's wall time beside others on one H200 (sessions
# 43-45), which spreads the groups over several GPUs (below).
all_groups=(
  "fwd:200:tests/gpu/test_fwd_gpu.py tests/gpu/test_mod_emit_gpu.py"
  "public:330:tests/gpu/test_flex_attention_gpu.py tests/gpu/test_dlpack_gpu.py"
  "bwd:300:tests/gpu/test_bwd_gpu.py -k '(test_fixed or test_random or from_dlpack) and not deterministic'"
  # (bwdwide in two: 125 tests ran past 470 s beside four groups and past 330 s alone, session 62)
  "bwdwide:250:tests/gpu/test_bwd_gpu.py -k 'not (deterministic or test_fixed or test_random or from_dlpack or idle or cluster or persistent or dq_finish or pdl or lse_gradient or never_recompile)'"
  "bwdwide2:250:tests/gpu/test_bwd_gpu.py -k '(idle or cluster or persistent or dq_finish or pdl or lse_gradient or never_recompile) and not deterministic'"
  "bwddet:100:tests/gpu/test_bwd_gpu.py -k deterministic"
  "autograd:150:tests/gpu/test_autograd_gpu.py tests/gpu/test_cupy_gpu.py"
  "decode:250:tests/gpu/test_decode_gpu.py tests/gpu/test_blockmask_gpu.py tests/gpu/test_short_query_gpu.py"
  "jax:250:tests/gpu/test_jax_gpu.py tests/gpu/test_notebooks_gpu.py"
  "heads:400:tests/gpu/test_head_dims_gpu.py tests/gpu/test_torch_compat_gpu.py"
  "fp32:200:tests/gpu/test_fp32_gpu.py"
  "fp32bwd:100:tests/gpu/test_bwd_fp32_gpu.py"
)
groups=()
for g in "${all_groups[@]}"; do
  if [ $# -eq 0 ] || [[ " $* " == *" ${g%%:*} "* ]]; then groups+=("$g"); fi
done
# On a machine of several GPUs (nvidia-h200-x2 ...) the groups spread over them, unless the
# caller chose the GPUs (CUDA_VISIBLE_DEVICES set): longest first, each to the GPU with the
# fewest seconds so far (taking them in turn put public and heads, the two longest, on one
# GPU of two, where public ran past a 420 s limit in session 45).
gpus=1
if [ -z "${CUDA_VISIBLE_DEVICES:-}" ]; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  [ "$gpus" -ge 1 ] || gpus=1
fi
mapfile -t groups < <(for g in "${groups[@]}"; do rest=${g#*:}; echo "${rest%%:*} $g"; done | sort -rn | cut -d' ' -f2-)
load=()
for (( d = 0; d < gpus; d++ )); do load[$d]=0; done
pids=()
for g in "${groups[@]}"; do
  name=${g%%:*}
  rest=${g#*:}
  secs=${rest%%:*}
  files=${rest#*:}
  gpu_env=""
  if [ "$gpus" -gt 1 ]; then
    best=0
    for (( d = 1; d < gpus; d++ )); do [ "${load[$d]}" -lt "${load[$best]}" ] && best=$d; done
    load[$best]=$(( load[best] + secs ))
    gpu_env="CUDA_VISIBLE_DEVICES=$best"
  fi
  # (eval: a group's -k expression is quoted inside its string)
  eval "$gpu_env timeout $limit python3 -m pytest -q -p no:cacheprovider $files" > "$out/gpu_$name.log" 2>&1 &
  pids+=($!)
done
rc=0
for i in "${!groups[@]}"; do
  wait "${pids[$i]}" || rc=1
done
for g in "${groups[@]}"; do
  name=${g%%:*}
  echo "== $name: $(grep -E '(passed|failed|error|no tests ran)' "$out/gpu_$name.log" | tail -1)"
  grep -E "^(FAILED|ERROR)" "$out/gpu_$name.log" | head -10
done
exit $rc
