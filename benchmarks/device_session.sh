#!/usr/bin/env bash
# One device call that spends the session's GPU minutes in priority order.
# Usage (device tool, carry [".gpu"]):  bash benchmarks/device_session.sh [steps...]
# Steps: fwd (forward + emitter + public-path tests), bwd (backward kernel tests, ~150
# cases), autograd (torch autograd end to end on CUDA), ffi (TVM-FFI launch tests), bench
# (side-by-side forward table), bench-ffi (the same, TVM-FFI launch), bwd-bench and
# bwd-bench-mods (forward + backward table: masks / score mods incl. a trainable bias;
# each compiles fwd+bwd for five libraries, so give each a device call of its own), cupy
# (CuPy adapter on the kernels), public (public path + prepared repeat calls), overhead
# (host µs per call, small shapes), profile (where the host µs of a repeated torch / CuPy
# call go), kprofile (device µs per kernel of a step, ours beside FA4), detprofile (ours,
# deterministic beside default), decode / short-query / decode-bench (decode tests, short-query tests / TB/s table;
# decode-suites: both test files in eight concurrent pytest shards, one call; gpu-all: every GPU test file in twelve
# shards, JAX without its preallocation, failures run again alone (too many for one call: gpu-bwd-kernel,
# gpu-bwd-rest, gpu-fwd and gpu-tail split it, with decode-suites; gpu-rest: the forward, fp32, DLPack and
# notebook files; a sharded step lists the cases its limit cut off in NAME.unrun, and rerun runs them from
# rerun.ids); decode-close: bench_decode's table at issue 24's
# three shapes, recorded, then twelve decode_floor processes of the window rows), jax (JAX adapter on the
# kernels), notebooks (every notebook on the GPU), sched (tile order / persistent CTAs ablation),
# first-call (a new mod's first call alone, fresh processes: issue 3's target), first-call-host (the same beside
# this host's speed: a pure-Python loop and compile_time.py's CPU-only compiles of the same kernels in fresh
# processes, both also run on the CPU box, and first_call.py's compile phases in the GPU process: a slow host,
# slower code and the GPU process told apart), compile-cuda (the window1024 and causal door kernels' fake-tensor
# compile in a CPU-only process and in one with torch's CUDA context up, then first_call.py's phases through the
# door, three alternating rounds: does a GPU process compile slower on the same host?), ab (ours
# against FA4 in alternating rounds, full and causal, three shapes), bwd-sched (backward
# kernel ablation beside FA4's backward), kprofile-shapes (device µs per kernel of a
# fwd+bwd step, ours beside FA4, at S4096 and S8192: where the backward's per-CTA cost
# sits, issue 4), bwd-fixed (main kernel µs against steps per CTA, ours and FA4: per-CTA
# fixed cost vs per-step cost), ncu-bwd (Nsight Compute sections of every kernel of one
# causal fwd+bwd step, ours and FA4, text into $OUT/ncu_bwd.txt), ncu-src (the causal
# backward main kernels, ours and FA4: warp-state samples per SASS instruction as CSV,
# $OUT/src_ours.csv and $OUT/src_fa4.csv, plus the stall-reason details), ncu-bytes (DRAM
# and L2 bytes, instructions and duration of every kernel of a full and a causal fwd+bwd
# step, ours and FA4: where the energy of a step goes once the GPU is power-limited),
# sustained (fwd+bwd, backward and forward under seconds of load: ms, MHz, W, mJ per call),
# ncu-decode (B 8 L 8k decode kernels, ours and SDPA's: duration, DRAM bytes and
# throughput, SM active vs elapsed cycles — where the last few % of bandwidth go, issue 5),
# window-sched (the band forward's persistent schedules incl. the snake order beside FA4,
# three shapes, issue 24), bwd-layouts (the backward's layouts and rings beyond head dim 128,
# forced configs side by side, issue 25), window-bwd-order (a band's backward in head order
# against longest-first, three shapes, issue 24), swap-vdims (split against swapped layouts
# at 128/192 and 192/64, issue 25), window-door (bench_fwd and bench_bwd's window1024 rows
# at three shapes, issue 24), window-tickets (the band forward's snake against tile tickets
# beside FA4, three shapes, issue 24), paged (torch's PagedAttention at the door: the short-query
# GPU tests and the emitter's tiled modes, then bench_paged_door's partial decode rows and
# prefill chunks), gptfast (gpt-fast's decoding step, ours compiled and eager beside torch's compiled and SDPA:
# bench_gpt_fast.py, and the gpt-fast GPU tests; issue 25), gptfast-profile (where the host time of
# gpt-fast's step goes, eager and compiled: cProfile, the kernels a step launches, host µs; profile_gpt_fast.py),
# fp32-errors (float32 "highest" errors beside torch flex at head dims 80 / 96 / 192 / 64, the planned
# kernel and one S accumulator: fp32_error_study.py, issue 25), bits-tier (a mask's own kernel against the
# shared packed-bits kernel: forward ms and first calls, bits_mask_tier.py, issue 24), fp32-next (3xTF32 at
# 144 / 192 / 256: the wide tests on the unserialized pieces, their errors and ms beside an O-sized second
# accumulator; the rows where D32 / D80's max errors lie; issue 25), fp32-dq (D96 / D64 / D128's dQ: the chains
# planned beside pieces of 2 and dQ's own in pieces of 2, and our backward kernels on float64 O / LSE: does D96's
# dQ error come from the forward?; errors and ms; a device call of its own; issue 25), full-only
# (block masks without partial tiles: the document GPU tests, the backward's FLEXATTN_BWD_FULL_ONLY=1, their door
# A/B; session 54, issue 24), full-only-bench (the forward's A/B, bench_bwd's document4 beside flex, and the
# B8 S2048 step's host time with and without the full-only plan), scoreboard (bench_fwd / bench_bwd's every
# variant at B4 S4096, recorded; session 55), scoreboard-tests (the document / full-only GPU tests with the
# backward's full-only walk planned: a call of its own, since on a fresh machine they outran 170 s; session 75),
# scoreboard-shapes (full, causal, window1024, document4 at B8 S2048 and B2 S8192, recorded),
# door-builtin (the door against our built-in spelling in alternating rounds, fwd and fwd+bwd: issue 24's 2%),
# door-builtin-wide (the same at the three scoreboard shapes with softcap and ALiBi, 12 rounds, after the
# control: the door against itself, which says how far from 1.000 two identical calls read; session 56),
# fp32-tail (the float32 rows whose one-seed max exceeded flex's: D32 / D80 forward, D64 / D96 dQ, more seeds,
# with the 0.9999 quantile's ratio beside the max's; session 56), dq-bytes (the backward's kernels one by one, with and without dq_first_store, at the two rows short of 1.5x flex
# Triton: where the preprocess's saved bytes went; session 56's question for KERNELS.md's "D in the main kernel"),
# first-store (dq_first_store with the acquiring ticket that skips the spin: the 16-bit backward tests with it planned,
# the kernels one by one with and without it at document4 B8 S2048 / B4 S4096 and window1024 B2 S8192, then the
# door's fwd+bwd A/B at document4's three shapes; session 57), first-store-wide (dq_first_store planned: the door's
# fwd+bwd against FLEXATTN_DQ_FIRST_STORE=0 on six variants at three shapes, then the bwdwide and autograd suites),
# scoreboard-bwd (bench_bwd's every variant at B4 S4096 and four at B8 S2048 / B2 S8192, recorded, then the
# scoreboard's document GPU tests: the backward's rows after a backward-only change), lazy-rescale (FwdConfig.rescale_threshold = 8, O rescaled only when a warp's max outgrew
# its reference by 2^8: the causal forward at D32 / D64 / D128 and dense D128 against the planned one, 5 rounds, then
# the door's forward A/B with FLEXATTN_RESCALE_THRESHOLD=8 on six variants), lazy-rescale-tests (its GPU cases, then the
# public suite and the head-dim forward cases with it planned; run beside lazy-rescale on a second GPU).
# small-d (issue 25's D32 / D64 forward: the causal sweeps of the planned tiles against four consumer
# warpgroups, 256-row tiles with 64 / 80 keys, 5 rounds; small-d-32 / small-d-64: one head dim each),
# small-d-tests (the 256-row tiles' GPU cases and the rescale threshold's, ~60 s), small-d-door (the door's
# forward A/B, FLEXATTN_FWD_TILES=192x128 / 256x64 against the plan, full and causal at D32 / D64, ~60 s).
# on-demand (FwdConfig.maxima_on_demand, built in session 60: no row maxima on the softmax's fast path, ~23% fewer
# instructions in the D32 / D64 full-block loops, and with exp2_fma_every = 4 / 6 / 8: its GPU cases first (-k
# rescale_threshold, ~60 s), then the causal sweeps at D32 / D64 / D128 with and without, 5 rounds, ~250 s),
# on-demand-door (the door's A/B with FLEXATTN_MAXIMA_ON_DEMAND=1 on six variants at D32 / D64 / D128, and at
# D64 with FLEXATTN_FWD_TILES=256x64 too: ~42 kernels to compile, a call of its own), on-demand-wide (with it
# planned: the max_scores tests, the door's A/B against FLEXATTN_MAXIMA_ON_DEMAND=0 at D80 / D96 / D192 / D256 and
# at D32 / D64's other two shapes, then bench_head_dims' causal forward at every head dim), on-demand-first (a first
# visit's vote before the exponentials, in the block lists' and the one-step walks: the on-demand GPU cases, then
# the door's A/B against FLEXATTN_MAXIMA_ON_DEMAND=0 on document4, softcap and window1024 at D32 / D64),
# small-d-stages (issue 25's last 1-3% at D32 / D64: the planned 256-row tiles on demand with 3 / 4 K/V stages,
# the producer further ahead of blocks this short; D32 with 64 keys; causal sweeps, 5 rounds), own-diagonal
# (FwdConfig.own_diagonal, session 62: each consumer warpgroup's causal walk ends at its own rows' diagonal;
# its GPU cases and the 256-row tiles', the causal sweeps at D32 / D64 with and without, 5 rounds, then
# the door's causal A/B against FLEXATTN_OWN_DIAGONAL=0 at D32 / D64 / D96 / D256: issue 25's 1.5x), head-dims
# (bench_head_dims' causal forward at issue 25's head dims and its forward + backward at 32 / 64 / 80 / 96),
# scored-tiles (score mods and bands on tall tiles at D32 / D64: softcap, ALiBi and window1024, planned 128 x 128,
# against 256-row and 192 x 112 tiles by FLEXATTN_FWD_TILES; their GPU cases first),
# wide-bwd (bench_head_dims' forward + backward at 192/128, 192/192, 256/128 and 256/256: issue 25's cells last read
# in sessions 34 / 38), scaled-indices (planned since session 64: its GPU cases, then the door's A/B on ALiBi with
# FLEXATTN_SCALED_INDICES=0, the plain product, at D32 / D64 / D128, forward and at D128 forward + backward),
# polled-merge (the decode GPU suite with the polled merge planned, decode_floor by FLEXATTN_DECODE_MERGE=tickets / auto,
# the merge's timeline, bench_decode's B1 L128k and B8 L8k rows), band-prefix (a window's masked prefix by arithmetic,
# planned; FLEXATTN_DECODE_BAND_PREFIX=0 is the analysis: its GPU cases, decode_floor's window rows off / on twice, a
# timeline), marks (the window rows' timeline with stream marks: the event time outside the CTAs, lead and trail),
# window-tail (B1 L128k window: the timeline with marks and three groups CTA by CTA, --dump-ctas: which split ends
# last and what the merger waits for; session 66), parity-slots (FLEXATTN_DECODE_SLOTS=parity, opt-in: its GPU
# test across split counts and slot layouts, the polled and fused-merge cases with parity; ~3 min), parity-suites
# (the decode + short-query suites with parity; ~6 min), parity-floor (decode_floor's B1 L128k window row emptied /
# parity / parity-caller / caller in alternating processes, four rounds, ~3 min), parity-timeline (that step's
# timeline with marks for emptied / caller / parity / parity-caller: stream or tail; ~6 min),
# band-tiles (the decode suites in shards, then decode_floor's B1 L128k window row with a band's kv tiles aligned to
# tile_n or starting at its first key, FLEXATTN_DECODE_BAND_TILES, five rounds; band-tiles-ab: eight rounds of both
# with the B8 L8k window row too; session 72), v-overhang (FLEXATTN_DECODE_V_OVERHANG=zero, built in session 73
# without a GPU: its NaN-past-the-length GPU test with the band-tile tests, then decode_floor's B1 window and
# B8 L8k rows keep / zero, four rounds, where nothing is read past the length, and three with sequences 37 keys
# short of the cache, where the zeroing runs), after-flush (decode_floor's B1 window and B8 L8k rows with
# nothing, a small matmul, or the matmul and an elementwise kernel between each L2 flush and each timed launch,
# SDPA timed beside them: what the kernel before ours costs it; three alternating rounds), shared-split (the same
# rows after an empty kernel that leaves the SMs' split at all shared memory / all L1, beside none and the matmul:
# whether a start pays for switching it; session 75), timeline-split (decode_timeline.py's B1 window row after the
# flush alone / smem / l1, three rounds, the CTAs' SMs: where the empty kernel's gain goes; ~3 min), band-one-step
# (FwdConfig.band_one_step, session 76: its GPU cases, the door's window1024 forward A/B against the two-step walk at
# three shapes, then window1024's first call with it; ~4 min), band-one-step-ab (the one-step walk, planned since
# session 77, against FLEXATTN_BAND_ONE_STEP=0's two loops: the forward A/B in 11 rounds, forward + backward in 7,
# and window1024 / causal first calls with and without it in alternating processes; ~6 min), one-step-walk
# (FwdConfig.one_step_walk, session 77: the dense / causal walk without hooks in one step; its GPU cases, the door's
# forward A/B of full and causal at D128's three shapes and D64 / D32, fwd+bwd at D128, and causal's first call with
# and without it in alternating processes; =1 plans it at every head dim; ~7 min; exponentials-once, its session 78
# A/B beside FwdConfig.exponentials_once, left with that field: commit 1592061),
# window-verify (session 78: the door against the built-in for window1024 with the planned one-step band walk,
# alternating, fwd and fwd+bwd at three shapes; FwdConfig.one_step_walk's forward A/B at D64 / D32; the device
# facts test; ~6 min),
# one-step-planned (session 78: FwdConfig.one_step_walk planned up to head dim 64: the head-dim GPU tests and the
# forward's walks in twelve shards, then the door's forward against FLEXATTN_ONE_STEP_WALK=0 at D64 / D32; ~7 min),
# planner-suites (the public door's GPU files through the planner — flex_attention, torch_compat, autograd,
# mod_emit, cupy, jax — in fourteen shards: a change to what the planner picks, session 78; ~6 min),
# merge-chunk (FLEXATTN_DECODE_MERGE_CHUNK=generic / exact: the polled merge's first round clamped to the head
# dim's chunk, or exactly the launch's split count as planned for windows; its GPU tests, then decode_floor's
# B1 L128k window row both ways, five rounds; ~4 min), balanced (FLEXATTN_DECODE_BALANCED=1, opt-in: balanced split ranges, the planner's counts untrimmed — B1 L128k
# window 16 splits instead of 13; its GPU tests, then decode_floor's row both ways in alternating processes, five
# rounds; ~3 min), split-count (decode_floor's B1 L128k window row: emptied and parity with the planner's 13
# splits, parity with 14, 15 and 16 balanced splits; three rounds, ~3 min), slot-layout (the polled slots split-major
# or group-major, FLEXATTN_DECODE_SLOT_LAYOUT: their GPU tests, then
# decode_floor's B1 L128k window row for emptied / caller x split / group, alternating, four rounds; ~5 min).
# Each step has its own time limit; logs and JSON land in $OUT (or /tmp/flexattn-out).
set -u
source .gpu/activate.sh
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/flexattn-out}
mkdir -p "$out"
steps=${*:-fwd bwd ffi bench}

run() {  # run NAME SECONDS CMD...: log to $out/NAME.log, print its tail
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date -u +%H:%M:%S))"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "rc=$?"
  grep -E "passed|failed|error|^\|" "$out/$name.log" | tail -25
}

floor_ab() {  # floor_ab NAME VAR ROUNDS VALUE...: decode_floor's rows ($FLOOR_ROWS, else B1 L128k window; more
  local name=$1 var=$2 rounds=$3 i value  # arguments: $FLOOR_ARGS) with VAR set to each VALUE in alternating
  shift 3                                 # processes (each value its own disk cache), ROUNDS rounds
  for i in $(seq "$rounds"); do
    for value in "$@"; do
      (export "$var=$value" FLEXATTN_CACHE_DIR="/tmp/flexattn-$name-$value"
       run "${name}_floor_${value}_$i" 60 python3 benchmarks/decode_floor.py --rows ${FLOOR_ROWS:-1x131072:window4096} \
         ${FLOOR_ARGS:-})
    done
  done
}

after_flush_rounds() {  # after_flush_rounds NAME KIND...: decode_floor's B1 window and B8 L8k rows, SDPA beside,
  local name=$1 i kind      # with each --after-flush KIND in alternating processes, three rounds
  shift
  for i in 1 2 3; do
    for kind in "$@"; do
      run "${name}_${kind}_$i" 60 python3 benchmarks/decode_floor.py \
        --rows 1x131072:window4096 8x8192:none --after-flush "$kind" --sdpa
    done
  done
}

first_call_ab() {  # first_call_ab NAME VAR VARIANT...: first_call.py with VAR=0 / 1 in alternating processes, twice
  local name=$1 var=$2 i v
  shift 2
  for i in 1 2; do
    for v in 0 1; do
      run ${name}_${v}_$i 60 env "$var=$v" python3 benchmarks/first_call.py --variants "$@" --reps 2
    done
  done
}

run_sharded() {  # run_sharded NAME SECONDS SHARDS TESTS...: one pytest per shard of the collected cases, at once
  local name=$1 limit=$2 shards=$3 i  # (compiles are CPU-bound and one process uses one core: 16 cores, one GPU)
  shift 3
  echo "== $name x$shards ($(date -u +%H:%M:%S))"
  python3 -m pytest -q --collect-only -p no:cacheprovider "$@" 2>/dev/null | grep "::" > "$out/$name.ids"
  echo "$(wc -l < "$out/$name.ids") cases"
  for i in $(seq 0 $((shards - 1))); do   # (round robin: each shard gets every file's share, in file order)
    awk -v n="$shards" -v i="$i" 'NR % n == i' "$out/$name.ids" | \
      timeout -s INT -k 20 "$limit" xargs -r -d '\n' python3 -m pytest -v -p no:cacheprovider \
        > "$out/${name}_$i.log" 2>&1 &   # (-v and SIGINT: a shard cut off by its limit still names its failures)
  done
  wait
  cat "$out"/${name}_*.log > "$out/$name.log"; rm -f "$out"/${name}_*.log
  grep -E "^FAILED|^ERROR|passed|failed|Interrupted" "$out/$name.log" | tail -30
  echo "$(grep -c " PASSED" "$out/$name.log") passed, $(grep -c " SKIPPED" "$out/$name.log") skipped," \
       "$(grep -cE " (FAILED|ERROR)( |$)" "$out/$name.log") failed of $(wc -l < "$out/$name.ids") (cut-off shards included)"
  # Each case's outcome, from its -v line ("ID STATUS [ n%]"), as "ID<tab>STATUS".
  grep -E "^tests/.*::.* (PASSED|SKIPPED|FAILED|ERROR|XFAIL|XPASS)( |$)" "$out/$name.log" \
    | sed -E 's/ (PASSED|SKIPPED|FAILED|ERROR|XFAIL|XPASS)( .*|$)/\t\1/' | sort -u > "$out/$name.outcomes"
  # Cases a shard's limit cut off (never reached, or interrupted mid-run) into $name.unrun: copy it into the
  # checkout as rerun.ids and run `device_session.sh rerun` in the next call.
  sort -u "$out/$name.ids" | comm -23 - <(cut -f1 "$out/$name.outcomes" | sort -u) > "$out/$name.unrun"
  if [ -s "$out/$name.unrun" ]; then echo "$(wc -l < "$out/$name.unrun") cases not run to the end: $name.unrun"
  else rm -f "$out/$name.unrun"; fi
  # A case that failed in a shard runs again alone, in one process: a failure of the sharding
  # (order, a neighbour's load) passes there, a real one fails again.
  awk -F'\t' '$2 == "FAILED" || $2 == "ERROR" {print $1}' "$out/$name.outcomes" | sort -u > "$out/$name.failed"
  rm -f "$out/$name.outcomes"
  if [ -s "$out/$name.failed" ]; then
    echo "== $name: $(wc -l < "$out/$name.failed") failed in shards, again alone ($(date -u +%H:%M:%S))"
    timeout "${RERUN_SECONDS:-120}" xargs -r -d '\n' python3 -m pytest -q -p no:cacheprovider < "$out/$name.failed" \
      > "$out/${name}_again.log" 2>&1
    grep -E "^FAILED|^ERROR|passed|failed" "$out/${name}_again.log" | tail -20
  fi
  rm -f "$out/$name.ids"
}

save_records() {  # the device tool returns at most 8 files: the records travel as one archive
  tar czf "$out/records.tgz" -C benchmarks/results $(cd benchmarks/results && ls *.jsonl)
}

for step in $steps; do
  case $step in
    fwd) run fwd 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fwd_gpu.py \
           tests/gpu/test_mod_emit_gpu.py tests/gpu/test_flex_attention_gpu.py -k "not ffi" ;;
    bwd) run bwd 540 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_bwd_gpu.py ;;
    autograd) run autograd 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_autograd_gpu.py ;;
    ffi) run ffi 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_flex_attention_gpu.py -k ffi ;;
    bench) run bench 420 python3 benchmarks/bench_fwd.py --out "$out/bench.json" ;;
    bench-ffi) run bench_ffi 420 python3 benchmarks/bench_fwd.py --tvm-ffi --out "$out/bench_ffi.json" ;;
    bwd-bench) run bwd_bench 560 python3 benchmarks/bench_bwd.py --variants full causal window1024 document4 \
           --out "$out/bench_bwd.json" ;;
    decode) run decode 540 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_gpu.py ;;   # (session 71: 80
           # of its 117 cases took 210 s on a fresh machine: a kernel per split count where the merge chunk is exact)
    gpu-all) XLA_PYTHON_CLIENT_PREALLOCATE=false RERUN_SECONDS=90 run_sharded gpu_all 450 12 tests/gpu ;;   # (every GPU suite:
           # session 73 saw ~430 of its 1138 cases in 450 s, so it needs the parts below, a call each;
           # GPU_FIRST: files gpu-fwd runs first, SHARD_LIMIT: its seconds)
    # The backward's GPU files, a call each: in one step (session 79's gpu-bwd) they took ~470 s on a fresh machine,
    # past one call's limit; session 80: 299 cases in 275 s, and 102 in 159 s.
    gpu-bwd-kernel) RERUN_SECONDS=90 run_sharded gpu_bwd_kernel "${SHARD_LIMIT:-440}" 12 tests/gpu/test_bwd_gpu.py ;;
    gpu-bwd-rest) RERUN_SECONDS=90 run_sharded gpu_bwd_rest "${SHARD_LIMIT:-440}" 12 tests/gpu/test_autograd_gpu.py \
           tests/gpu/test_blockmask_gpu.py tests/gpu/test_bwd_fp32_gpu.py tests/gpu/test_context_parallel_gpu.py ;;
    gpu-fwd) XLA_PYTHON_CLIENT_PREALLOCATE=false RERUN_SECONDS=90 run_sharded gpu_fwd "${SHARD_LIMIT:-440}" 12 \
           ${GPU_FIRST:-} tests/gpu/test_cupy_gpu.py \
           tests/gpu/test_dlpack_gpu.py tests/gpu/test_flex_attention_gpu.py tests/gpu/test_fp32_gpu.py \
           tests/gpu/test_fwd_gpu.py tests/gpu/test_head_dims_gpu.py tests/gpu/test_jax_gpu.py \
           tests/gpu/test_mod_emit_gpu.py tests/gpu/test_notebooks_gpu.py tests/gpu/test_torch_compat_gpu.py ;;
    gpu-tail) XLA_PYTHON_CLIENT_PREALLOCATE=false RERUN_SECONDS=90 run_sharded gpu_tail "${SHARD_LIMIT:-440}" 12 \
           tests/gpu/test_notebooks_gpu.py tests/gpu/test_mod_emit_gpu.py tests/gpu/test_torch_compat_gpu.py \
           tests/gpu/test_jax_gpu.py tests/gpu/test_cupy_gpu.py tests/gpu/test_head_dims_gpu.py ;;   # (gpu-fwd's
           # files its 405 s did not reach in session 73, head dims last: 135 of its 141 cases passed there)
    gpu-rest) XLA_PYTHON_CLIENT_PREALLOCATE=false RERUN_SECONDS=90 run_sharded gpu_rest "${SHARD_LIMIT:-440}" 12 \
           tests/gpu/test_fwd_gpu.py tests/gpu/test_fp32_gpu.py tests/gpu/test_dlpack_gpu.py \
           tests/gpu/test_notebooks_gpu.py ;;   # (gpu-fwd's files that gpu-tail and planner-suites leave out)
    rerun) ids_file=${RERUN_IDS:-rerun.ids}   # (a sharded step's cut-off cases: its .unrun file copied into the checkout)
           if [ -s "$ids_file" ]; then   # (never without ids: pytest would collect every test)
             mapfile -t rerun_ids < "$ids_file"
             RERUN_SECONDS=90 run_sharded rerun "${SHARD_LIMIT:-300}" 8 "${rerun_ids[@]}"
           else echo "rerun: $ids_file is missing or empty"; fi ;;
    decode-close) run decode_close_bench 300 python3 benchmarks/bench_decode.py --shapes 1x131072 8x8192 8x65536 \
                    --variants none window4096 --layouts contiguous --record --out "$out/bench_decode.json"
                  save_records
                  for i in $(seq 12); do   # (the window cells against the read: one process each)
                    run "decode_close_floor_$i" 40 python3 benchmarks/decode_floor.py \
                      --rows 1x131072:window4096 8x8192:window4096
                  done ;;
    decode-suites) run_sharded decode_suites 400 8 tests/gpu/test_decode_gpu.py tests/gpu/test_short_query_gpu.py ;;
    short-query) run short_query 420 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_short_query_gpu.py ;;
    decode-bench) run decode_bench 420 python3 benchmarks/bench_decode.py --out "$out/bench_decode.json" ;;
    jax) run jax 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_jax_gpu.py ;;
    cupy) run cupy 180 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cupy_gpu.py ;;
    public) run public 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_flex_attention_gpu.py ;;
    notebooks) run notebooks 400 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_notebooks_gpu.py ;;
    overhead) run overhead 200 python3 benchmarks/bench_overhead.py --out "$out/overhead.json" ;;
    profile) run profile_torch 120 python3 benchmarks/profile_host.py --adapter torch
             run profile_cupy 120 python3 benchmarks/profile_host.py --adapter cupy ;;
    kprofile) run kprofile 560 python3 benchmarks/profile_kernels.py --variants full window1024 document4 \
           --impls flexattn fa4 flex-fa
             run kprofile_fwd 200 python3 benchmarks/profile_kernels.py --mode fwd --variants full causal \
           --impls flexattn fa4 ;;
    detprofile) run detprofile 300 python3 benchmarks/profile_kernels.py --variants full window1024 document4 \
           --impls flexattn --deterministic --steps 10 ;;
    first-call) run first_call 300 python3 benchmarks/first_call.py --reps 5 --out "$out/first_call.json" ;;
    first-call-host) run host_loop 30 python3 benchmarks/compile_time.py --host-loop   # (this host's Python speed)
                     tail -1 "$out/host_loop.log"
                     run compile_host 250 python3 benchmarks/compile_time.py --warm full --processes 2 \
                       --kernels door-causal door-window1024 door-document4 door-causal+softcap30 door-causal+alibi
                     tail -7 "$out/compile_host.log"
                     run first_call 300 python3 benchmarks/first_call.py --reps 3 --phases --out "$out/first_call.json"
                     grep PHASES "$out/first_call.log"
                     run host_loop_after 30 python3 benchmarks/compile_time.py --host-loop
                     tail -1 "$out/host_loop_after.log" ;;
    compile-cuda) run host_loop 30 python3 benchmarks/compile_time.py --host-loop; tail -1 "$out/host_loop.log"
                  for i in 1 2 3; do   # (the same fake-tensor compiles in a CPU-only process and in a GPU process)
                    for mode in cpu cuda; do
                      run "compile_${mode}_$i" 90 python3 benchmarks/compile_time.py --processes 1 --warm full \
                        --kernels door-window1024 door-causal $([ $mode = cuda ] && echo --cuda)
                      tail -3 "$out/compile_${mode}_$i.log"
                    done
                    run "first_call_$i" 90 python3 benchmarks/first_call.py --reps 1 --phases \
                      --variants window1024 causal
                    grep PHASES "$out/first_call_$i.log"
                  done ;;
    kprofile-shapes) run kprofile_shapes 400 python3 benchmarks/profile_kernels.py \
           --shapes 4x4096x16x128 2x8192x16x128 --variants full causal --impls flexattn fa4 ;;
    bwd-fixed) run bwd_fixed 300 python3 benchmarks/bwd_fixed_cost.py ;;
    ncu-bwd) echo "== ncu-bwd ($(date -u +%H:%M:%S))"
             timeout 400 ncu --profile-from-start off --clock-control none --section SpeedOfLight \
               --section ComputeWorkloadAnalysis --section WarpStateStats --section LaunchStats \
               --section Occupancy python3 benchmarks/ncu_step.py --mode fwdbwd --variants causal \
               --impls flexattn fa4 > "$out/ncu_bwd.txt" 2>&1
             echo "rc=$?"; grep -E "^  [a-zA-Z_].*\(|Duration|Compute \(SM\) Throughput|Executed Ipc A" "$out/ncu_bwd.txt" | head -60 ;;
    ncu-src) echo "== ncu-src ($(date -u +%H:%M:%S))"
             timeout 300 ncu --profile-from-start off --clock-control none \
               -k "regex:FlashBwdSm90|BackwardSm90_" --section SourceCounters --section WarpStateStats \
               -f -o "$out/bwd_src" python3 benchmarks/ncu_step.py --mode fwdbwd --variants causal \
               --impls flexattn fa4 > "$out/ncu_src.log" 2>&1
             echo "rc=$?"; tail -3 "$out/ncu_src.log"
             ncu -i "$out/bwd_src.ncu-rep" -k regex:FlashBwdSm90 --page source --csv --print-source sass \
               > "$out/src_ours.csv" 2> "$out/src_err.txt"
             ncu -i "$out/bwd_src.ncu-rep" -k regex:BackwardSm90_ --page source --csv --print-source sass \
               > "$out/src_fa4.csv" 2>> "$out/src_err.txt"
             ncu -i "$out/bwd_src.ncu-rep" --page details --print-details all > "$out/src_details.txt" 2>&1
             rm -f "$out/bwd_src.ncu-rep"
             ls -la "$out"; head -c 600 "$out/src_err.txt"; grep -i "stall" "$out/src_details.txt" | head -60 ;;
    ncu-bytes) echo "== ncu-bytes ($(date -u +%H:%M:%S))"
             timeout 300 ncu --profile-from-start off --clock-control none --metrics \
               gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,sm__inst_executed.sum \
               python3 benchmarks/ncu_step.py --mode fwdbwd --variants full causal --impls flexattn fa4 \
               > "$out/ncu_bytes.txt" 2>&1
             echo "rc=$?"; grep -E "^  [a-z].*CC 9|duration|bytes|inst_executed" "$out/ncu_bytes.txt" \
               | sed -E 's/object_at.*(\([0-9]+, [0-9]+, [0-9]+\)x)/\1/' | cut -c1-110 ;;
    sustained) for m in fwdbwd bwd fwd; do run sustained_$m 200 python3 benchmarks/sustained_clocks.py \
               --mode $m --variants full causal --seconds 2.5; done ;;
    ncu-decode) echo "== ncu-decode ($(date -u +%H:%M:%S))"
             timeout 300 ncu --profile-from-start off --clock-control none --metrics \
               gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__cycles_active.avg,sm__cycles_elapsed.max,launch__grid_size,sm__warps_active.avg.pct_of_peak_sustained_active \
               python3 benchmarks/ncu_decode.py > "$out/ncu_decode.txt" 2>&1
             echo "rc=$?"; grep -E "^  [a-zA-Z_].*CC 9|duration|bytes|throughput|cycles|grid_size|warps_active|profiled" \
               "$out/ncu_decode.txt" | sed -E 's/_object_at_.*(\([0-9]+, [0-9]+, [0-9]+\)x)/ \1/' | cut -c1-110 ;;
    ab) run ab 300 python3 benchmarks/ab_interleaved.py --shapes 4x4096x16x128 8x2048x16x128 \
           2x8192x16x128 --variants full causal --rounds 10 ;;
    bwd-sched) run bwd_sched 300 python3 benchmarks/bench_bwd_schedules.py --shapes 4x4096x16x128 \
           --variants cluster ;;
    sched) run sched 300 python3 benchmarks/bench_schedules.py --shapes 4x4096x16x128 8x2048x16x128 \
           --variants by_head longest persist persist+by_head --anchors fa4 ;;
    window-sched) run window_sched 300 python3 benchmarks/bench_schedules.py \
           --shapes 8x2048x16x128 4x4096x16x128 2x8192x16x128 --window 1024 \
           --variants persist persist+snake persist+longest+snake --anchors fa4 ;;
    bwd-layouts) run bwd_layouts 300 python3 benchmarks/bench_bwd_layouts.py \
           --dims 192/192 256/128 256/256 ;;
    window-tickets) run window_tickets 300 python3 benchmarks/bench_schedules.py \
           --shapes 8x2048x16x128 4x4096x16x128 2x8192x16x128 --window 1024 \
           --variants persist+snake persist+tickets --anchors fa4 ;;
    small-causal-tickets) run small_causal_tickets_tests 300 python3 -m pytest -q -p no:cacheprovider \
           tests/gpu/test_fwd_gpu.py -k tickets
             for t in auto 1; do FLEXATTN_TILE_TICKETS=$t run head_dims_tickets_$t 300 python3 \
               benchmarks/bench_head_dims.py --dims 32/32 64/64 80/80 96/96; done ;;
    window-bwd-order) run window_bwd_order 300 python3 benchmarks/bench_bwd_layouts.py --mask window1024 \
           --shapes 8x2048x16 4x4096x16 2x8192x16 --dims 128/128 --layouts by_head longest ;;
    swap-vdims) run swap_vdims 240 python3 benchmarks/bench_bwd_layouts.py --dims 128/192 192/64 \
           --layouts planned split swap96 ;;
    window-door) run window_door_fwd 300 python3 benchmarks/bench_fwd.py --variants window1024 \
           --shapes 8x2048x16x128 4x4096x16x128 2x8192x16x128 --out "$out/window_fwd.json"
             run window_door_bwd 400 python3 benchmarks/bench_bwd.py --variants window1024 \
           --shapes 8x2048x16x128 4x4096x16x128 2x8192x16x128 --out "$out/window_bwd.json" ;;
    bwd-bench-mods) run bwd_bench_mods 560 python3 benchmarks/bench_bwd.py \
           --variants causal+softcap30 causal+alibi causal+trainable_bias --out "$out/bench_bwd_mods.json" ;;
    paged) run paged_tests 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_short_query_gpu.py \
           tests/gpu/test_mod_emit_gpu.py -k "paged or prefill or tiled"
           (cd benchmarks && run paged_bench 300 python3 bench_paged_door.py --shapes 8x8192 8x32768 1x131072 \
           --blocks partial --prefill 4x8192 2x32768 --out "$out/paged.json") ;;
    gptfast) run gptfast_tests 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_short_query_gpu.py -k gpt_fast
           # (one process per shape: compiled steps read slower after an eager loop in the process)
           for shape in 8x8192 1x32768; do
             (cd benchmarks && run gptfast_bench_$shape 150 python3 bench_gpt_fast.py --shapes $shape \
              --modes default reduce-overhead --out "$out/gptfast_$shape.json")
           done ;;
    gptfast-profile) (cd benchmarks && run gptfast_profile 200 python3 profile_gpt_fast.py --shape 8x8192 --steps 300) ;;
    fp32-errors) (cd benchmarks && run fp32_errors 240 python3 fp32_error_study.py --seeds 3 \
                    --shapes 1x4096x8x80 1x4096x8x96 1x4096x8x192 1x4096x8x64 \
                    --ours "" FLEXATTN_FWD_S_PROMOTE=0) ;;
    bits-tier) (cd benchmarks && run bits_tier 240 python3 bits_mask_tier.py) ;;
    fp32-next) run fp32_wide_tests 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp32_gpu.py \
                 tests/gpu/test_bwd_fp32_gpu.py -k "d192-192 or d256-256 or d144-144 or 192 or 256"
               (cd benchmarks && run fp32_wide_fwd 240 python3 fp32_error_study.py --seeds 2 \
                    --shapes 1x4096x8x192 1x4096x8x256 --ours "" FLEXATTN_FWD_PV_PIECES=1 \
                    FLEXATTN_FWD_PV_PIECES=1,FLEXATTN_FWD_S_PROMOTE=0
                  run fp32_short_dims 150 python3 fp32_error_study.py --seeds 3 --shapes 1x4096x8x32 1x4096x8x80 \
                    --ours "") ;;
    fp32-tail) (cd benchmarks && run fp32_tail_fwd 200 python3 fp32_error_study.py --seeds 5 \
                    --shapes 1x4096x8x32 1x4096x8x80 --ours ""
                  run fp32_tail_bwd 300 python3 fp32_error_study.py --backward --seeds 4 \
                    --shapes 1x1025x4x96 1x1025x4x64 --ours "") ;;
    fp32-dq) (cd benchmarks && run fp32_dq 420 python3 fp32_error_study.py --backward --seeds 2 \
                    --shapes 1x1025x4x96 1x1025x4x64 1x4096x4x128 --ours "" FLEXATTN_BWD_CHAIN_PROMOTE=2 \
                    FLEXATTN_BWD_DQ_PROMOTE=2 --exact-forward) ;;
    full-only) run full_only_tests 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_flex_attention_gpu.py \
                 tests/gpu/test_bwd_gpu.py -k "row_pairs_match or document or listed_as_partial"
               (cd benchmarks && FLEXATTN_BWD_FULL_ONLY=1 run full_only_bwd_tests 120 python3 -m pytest -q \
                    -p no:cacheprovider ../tests/gpu/test_flex_attention_gpu.py -k row_pairs_match
                  run full_only_ab 150 python3 ab_env.py --env FLEXATTN_FULL_ONLY=0 --also FLEXATTN_BWD_FULL_ONLY=1 \
                    --variants document4 --shapes 8x2048x16x128 4x4096x16x128 --rounds 5 --backward) ;;
    full-only-bench) (cd benchmarks && run full_only_ab_fwd 90 python3 ab_env.py --env FLEXATTN_FULL_ONLY=0 \
                    --variants document4 --shapes 8x2048x16x128 4x4096x16x128 2x8192x16x128 --rounds 5
                  run full_only_bench 300 python3 bench_bwd.py --variants document4 --shapes 8x2048x16x128 4x4096x16x128
                  run full_only_host 60 python3 step_host_parts.py --variants document4 --rounds 5
                  FLEXATTN_FULL_ONLY=0 run full_only_host_old 60 python3 step_host_parts.py --variants document4 \
                    --rounds 5) ;;
    scoreboard) run scoreboard_fwd 200 python3 benchmarks/bench_fwd.py --record     # (cold machine: ~140 s)
                run scoreboard_bwd 330 python3 benchmarks/bench_bwd.py --deterministic --record   # (~280 s)
                save_records ;;
    scoreboard-tests) run scoreboard_tests 400 python3 -m pytest -q -p no:cacheprovider \
                 tests/gpu/test_flex_attention_gpu.py tests/gpu/test_bwd_gpu.py \
                 -k "row_pairs_match or document or listed_as_partial" ;;
    scoreboard-shapes) for m in fwd bwd; do run scoreboard_shapes_$m 260 python3 benchmarks/bench_$m.py --record \
                 --shapes 8x2048x16x128 2x8192x16x128 --variants full causal window1024 document4 \
                 $([ $m = bwd ] && echo --deterministic); done
                save_records ;;
    door-builtin) for m in fwd fwdbwd; do run door_builtin_$m 270 python3 benchmarks/ab_interleaved.py --pair door builtin \
                    --mode $m --variants full causal window1024 document4 --rounds 6; done ;;
    door-builtin-wide)
                  shapes="4x4096x16x128 8x2048x16x128 2x8192x16x128"
                  run door_door_fwdbwd 150 python3 benchmarks/ab_interleaved.py --pair door door --mode fwdbwd \
                    --variants full causal document4 --shapes $shapes --rounds 12
                  for m in fwd fwdbwd; do run door_builtin_wide_$m 200 python3 benchmarks/ab_interleaved.py \
                    --pair door builtin --mode $m --shapes $shapes --rounds 12 \
                    --variants full causal window1024 document4 causal+softcap30 causal+alibi; done ;;
    dq-bytes)   for fs in "" 1; do for row in 8x2048x16x128:document4 2x8192x16x128:window1024; do
                  run dq_bytes_${row#*:}_first_store${fs:-0} 150 env FLEXATTN_DQ_FIRST_STORE=$fs \
                    python3 benchmarks/profile_kernels.py --impls flexattn --mode fwdbwd --steps 30 \
                    --shapes ${row%:*} --variants ${row#*:}; done; done ;;
    first-store) run first_store_tests 280 env FLEXATTN_DQ_FIRST_STORE=1 python3 -m pytest -q -x -p no:cacheprovider \
                   tests/gpu/test_bwd_gpu.py -k "(test_fixed or test_random or test_persistent) and not deterministic"
                 for fs in "" 1; do for row in 8x2048x16x128:document4 4x4096x16x128:document4 2x8192x16x128:window1024; do
                   run fs_${row%%x*}_${row#*:}_${fs:-0} 60 env FLEXATTN_DQ_FIRST_STORE=$fs python3 benchmarks/profile_kernels.py \
                     --impls flexattn --mode fwdbwd --steps 30 --shapes ${row%:*} --variants ${row#*:}
                   grep -E "wall|µs  x1" "$out/fs_${row%%x*}_${row#*:}_${fs:-0}.log"; done; done
                 run first_store_ab 200 python3 benchmarks/ab_env.py --backward --env FLEXATTN_DQ_FIRST_STORE=1 --rounds 11 \
                   --shapes 8x2048x16x128 4x4096x16x128 2x8192x16x128 --variants document4 ;;
    first-store-wide) run first_store_wide 250 python3 benchmarks/ab_env.py --backward --env FLEXATTN_DQ_FIRST_STORE=0 \
                        --rounds 9 --shapes 4x4096x16x128 8x2048x16x128 2x8192x16x128 \
                        --variants full causal window1024 document4 causal+softcap30 causal+alibi
                      bash benchmarks/gpu_suites.sh 320 bwdwide bwdwide2 autograd ;;
    scoreboard-bwd) run scoreboard_bwd 240 python3 benchmarks/bench_bwd.py --deterministic --record
                    run scoreboard_shapes_bwd 170 python3 benchmarks/bench_bwd.py --record --deterministic \
                      --shapes 8x2048x16x128 2x8192x16x128 --variants full causal window1024 document4
                    save_records
                    run scoreboard_tests 170 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_flex_attention_gpu.py \
                      tests/gpu/test_bwd_gpu.py -k "row_pairs_match or document or listed_as_partial" ;;
    small-d-tests) run small_d_tests 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fwd_gpu.py \
               -k "256_row_tiles or rescale_threshold" ;;
    small-d|small-d-32|small-d-64)   # (small-d: both head dims; small-d-N: one, for a short call)
             c="max_ctas=-1,tile_tickets=1"
             (cd benchmarks
              [[ $step == small-d || $step == small-d-32 ]] &&
              run small_d_32 200 python3 sweep_fwd_configs.py --dims 32/32 --rounds 5 --anchors fa4 flex --configs \
                "tile_m=192,$c" "tile_m=256,tile_n=64,$c" "tile_m=256,tile_n=80,$c" "tile_m=128,$c"
              [[ $step == small-d || $step == small-d-64 ]] &&
              run small_d_64 180 python3 sweep_fwd_configs.py --dims 64/64 --rounds 5 --anchors fa4 flex --configs \
                "tile_m=192,$c" "tile_m=256,tile_n=64,$c" "tile_m=128,$c") ;;
    small-d-door) run small_d_tiles 300 python3 benchmarks/ab_env.py --env FLEXATTN_FWD_TILES=192x128 \
                    --also FLEXATTN_FWD_TILES=256x64 --rounds 7 --variants full causal \
                    --shapes 4x4096x16x32 8x2048x16x32 2x8192x16x32 4x4096x16x64 ;;
    on-demand) c="max_ctas=-1,tile_tickets=1"; od="rescale_threshold=8.0,maxima_on_demand=True"
               run od_tests 180 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fwd_gpu.py -k "rescale_threshold or block_sparse"
               (cd benchmarks
                run od_32 150 python3 sweep_fwd_configs.py --dims 32/32 --rounds 5 --anchors fa4 flex --configs \
                  "tile_m=256,tile_n=80,$c" "tile_m=256,tile_n=80,$c,$od" "tile_m=192,$c" "tile_m=192,$c,$od" \
                  "tile_m=192,$c,$od,exp2_fma_every=4" "tile_m=192,$c,$od,exp2_fma_every=6" \
                  "tile_m=256,tile_n=80,$c,$od,exp2_fma_every=4" "tile_m=256,tile_n=80,$c,$od,exp2_fma_every=6"
                run od_64 150 python3 sweep_fwd_configs.py --dims 64/64 --rounds 5 --anchors fa4 flex --configs \
                  "tile_m=192,$c" "tile_m=192,$c,$od" "tile_m=256,tile_n=64,$c,$od" \
                  "tile_m=192,$c,$od,exp2_fma_every=4" "tile_m=192,$c,$od,exp2_fma_every=8"
                run od_128 90 python3 sweep_fwd_configs.py --dims 128/128 --rounds 5 --anchors fa4 --configs \
                  "tile_m=128,rescale_threshold=8.0" "tile_m=128,$od") ;;
    on-demand-door) v="full causal window1024 document4 causal+softcap30 causal+alibi"
                 run od_door_32 200 python3 benchmarks/ab_env.py --env FLEXATTN_MAXIMA_ON_DEMAND=1 --rounds 7 \
                   --variants $v --shapes 4x4096x16x32
                 run od_door_64 240 python3 benchmarks/ab_env.py --env FLEXATTN_MAXIMA_ON_DEMAND=1 --rounds 7 \
                   --also FLEXATTN_MAXIMA_ON_DEMAND=1+FLEXATTN_FWD_TILES=256x64 --variants $v --shapes 4x4096x16x64
                 run od_door_128 150 python3 benchmarks/ab_env.py --env FLEXATTN_MAXIMA_ON_DEMAND=1 --rounds 7 \
                   --variants $v --shapes 4x4096x16x128 ;;
    on-demand-wide) v="full causal window1024 document4 causal+softcap30 causal+alibi"
                 run od_max_scores 80 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_flex_attention_gpu.py -k max_scores
                 run od_wide_dims 170 python3 benchmarks/ab_env.py --env FLEXATTN_MAXIMA_ON_DEMAND=0 --rounds 7 \
                   --variants $v --shapes 4x4096x16x80 4x4096x16x96 4x4096x16x192 4x4096x16x256
                 run od_wide_shapes 110 python3 benchmarks/ab_env.py --env FLEXATTN_MAXIMA_ON_DEMAND=0 --rounds 7 \
                   --variants full causal document4 causal+softcap30 \
                   --shapes 8x2048x16x32 2x8192x16x32 8x2048x16x64 2x8192x16x64
                 run od_head_dims 190 python3 benchmarks/bench_head_dims.py --dims 32/32 64/64 80/80 96/96 128/128 256/256 \
                   --out "$out/head_dims.json" ;;
    on-demand-first) run od_first_tests 170 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fwd_gpu.py \
                   -k "rescale_threshold or block_sparse"
                 run od_first_door 150 python3 benchmarks/ab_env.py --env FLEXATTN_MAXIMA_ON_DEMAND=0 --rounds 7 \
                   --variants document4 causal+softcap30 window1024 \
                   --shapes 8x2048x16x32 4x4096x16x32 8x2048x16x64 4x4096x16x64 ;;
    small-d-stages) c="max_ctas=-1,tile_tickets=1,rescale_threshold=8.0,maxima_on_demand=True"
                 (cd benchmarks
                  run stages_64 150 python3 sweep_fwd_configs.py --dims 64/64 --rounds 5 --anchors fa4 flex --configs \
                    "tile_m=256,tile_n=64,$c" "tile_m=256,tile_n=64,num_stages=3,$c" "tile_m=256,tile_n=64,num_stages=4,$c"
                  run stages_32 150 python3 sweep_fwd_configs.py --dims 32/32 --rounds 5 --anchors fa4 flex --configs \
                    "tile_m=256,tile_n=80,$c" "tile_m=256,tile_n=64,$c" "tile_m=256,tile_n=80,num_stages=3,$c" \
                    "tile_m=256,tile_n=64,num_stages=4,$c") ;;
    head-dims) run head_dims_fwd 300 python3 benchmarks/bench_head_dims.py \
                 --dims 32/32 64/64 80/80 96/96 128/128 192/128 256/256 --out "$out/head_dims.json"
               run head_dims_bwd 300 python3 benchmarks/bench_head_dims.py --backward \
                 --dims 32/32 64/64 80/80 96/96 --out "$out/head_dims_bwd.json" ;;
    polled-merge) run polled_tests 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_gpu.py \
                    tests/gpu/test_short_query_gpu.py
                  for m in tickets auto; do
                    FLEXATTN_DECODE_MERGE=$m run polled_floor_$m 70 python3 benchmarks/decode_floor.py \
                      --rows 1x131072:window4096 1x131072:none 1x8192:none 8x65536:window4096
                  done
                  (cd benchmarks && run polled_timeline 90 python3 decode_timeline.py --shapes 1x131072 \
                    --variants window4096 none --layouts contiguous --merges tickets polled --reps 5)
                  run polled_bench 110 python3 benchmarks/bench_decode.py --shapes 1x131072 8x8192 \
                    --variants none window4096 --layouts contiguous --out "$out/bench_decode_polled.json" ;;
    band-prefix) run band_prefix_tests 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_gpu.py \
                   -k "polled_merge_planned or window_skips"
                 for v in 0 1 0 1; do
                   FLEXATTN_DECODE_BAND_PREFIX=$v run band_prefix_floor_$v 50 python3 benchmarks/decode_floor.py \
                     --rows 1x131072:window4096 8x8192:window4096 8x65536:window4096
                 done
                 (cd benchmarks && FLEXATTN_DECODE_BAND_PREFIX=1 run band_prefix_timeline 70 python3 decode_timeline.py \
                   --shapes 1x131072 --variants window4096 --layouts contiguous --merges polled --reps 5) ;;
    parity-slots) FLEXATTN_DECODE_SLOTS=parity run parity_test 400 python3 -m pytest -q -p no:cacheprovider \
                    tests/gpu/test_decode_gpu.py -k "parity_slots or polled_merge_planned or fused_merge" ;;
    parity-suites) FLEXATTN_DECODE_SLOTS=parity run parity_suites 500 python3 -m pytest -q -p no:cacheprovider \
                     tests/gpu/test_decode_gpu.py tests/gpu/test_short_query_gpu.py ;;
    parity-floor) for i in 1 2 3 4; do
                    for slots in emptied parity parity-caller caller; do
                      zero=""; [ "${slots#*-}" = caller ] && zero=--zero-slots   # (caller, parity-caller)
                      FLEXATTN_DECODE_SLOTS=$slots FLEXATTN_CACHE_DIR=/tmp/flexattn-slots-$slots \
                        run parity_floor_${slots}_$i 40 python3 benchmarks/decode_floor.py \
                        --rows 1x131072:window4096 $zero
                    done
                  done ;;
    parity-timeline) for slots in emptied caller parity parity-caller; do
                       (cd benchmarks && FLEXATTN_DECODE_SLOTS=$slots FLEXATTN_CACHE_DIR=/tmp/flexattn-slots-$slots \
                         run timeline_$slots 150 python3 decode_timeline.py --shapes 1x131072 --variants window4096 \
                         --layouts contiguous --merges polled --reps 9 --marks)
                     done ;;
    split-count) for i in 1 2 3; do
                   for v in emptied:0 parity:0 parity:14 parity:15 parity:16; do
                     slots=${v%%:*} n=${v#*:}
                     splits=""; balanced=0; [ "$n" != 0 ] && splits="--splits $n" && balanced=1
                     FLEXATTN_DECODE_SLOTS=$slots FLEXATTN_DECODE_BALANCED=$balanced \
                       FLEXATTN_CACHE_DIR=/tmp/flexattn-slots-$slots-$balanced \
                       run split_count_${slots}_${n}_$i 40 python3 benchmarks/decode_floor.py \
                       --rows 1x131072:window4096 $splits
                   done
                 done ;;
    balanced) run balanced_tests 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_gpu.py \
                -k "balanced_splits or parity_slots or polled_merge_planned"
              floor_ab balanced FLEXATTN_DECODE_BALANCED 5 0 1 ;;
    band-tiles) run_sharded decode_suites 300 8 tests/gpu/test_decode_gpu.py tests/gpu/test_short_query_gpu.py
                floor_ab band_tiles FLEXATTN_DECODE_BAND_TILES 5 aligned start ;;
    v-overhang) run v_overhang_tests 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_gpu.py \
                  -k "nan_past_the_length or band_tiles"
                FLOOR_ROWS="1x131072:window4096 8x8192:none" floor_ab v_overhang FLEXATTN_DECODE_V_OVERHANG 4 keep zero
                # (the zeroing taken: sequences 37 keys short of the cache)
                FLOOR_ROWS="1x131072:window4096 8x8192:none" FLOOR_ARGS="--short-by 37" \
                  floor_ab v_overhang_short FLEXATTN_DECODE_V_OVERHANG 3 keep zero ;;
    after-flush) after_flush_rounds after_flush none gemm gemm-add ;;   # (a small matmul / and an add before)
    shared-split) after_flush_rounds shared_split none smem l1 gemm ;;   # (does a start pay to switch the split?)
    band-one-step) run band_one_step_tests 70 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fwd_gpu.py \
                     -k band_one_step
                   run band_one_step_ab 110 python3 benchmarks/ab_env.py --env FLEXATTN_BAND_ONE_STEP=0 \
                     --variants window1024 --shapes 4x4096x16x128 8x2048x16x128 2x8192x16x128 --rounds 5
                   run band_one_step_first_call 45 python3 benchmarks/first_call.py \
                     --variants window1024 --reps 2 --phases ;;
    one-step-walk) run one_step_walk_tests 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fwd_gpu.py \
                     -k one_step_walk
                   run one_step_walk_fwd 200 python3 benchmarks/ab_env.py --env FLEXATTN_ONE_STEP_WALK=1 --rounds 9 \
                     --variants full causal --shapes 4x4096x16x128 8x2048x16x128 2x8192x16x128 4x4096x16x64 4x4096x16x32
                   run one_step_walk_bwd 200 python3 benchmarks/ab_env.py --env FLEXATTN_ONE_STEP_WALK=1 --rounds 7 \
                     --backward --variants full causal --shapes 4x4096x16x128 8x2048x16x128 2x8192x16x128
                   first_call_ab one_step_first_call FLEXATTN_ONE_STEP_WALK causal window1024 ;;
    window-verify) run window_door_builtin_fwd 150 python3 benchmarks/ab_interleaved.py --pair door builtin --mode fwd \
                     --variants window1024 --shapes 4x4096x16x128 8x2048x16x128 2x8192x16x128 --rounds 12
                   run window_door_builtin_fwdbwd 150 python3 benchmarks/ab_interleaved.py --pair door builtin \
                     --mode fwdbwd --variants window1024 --shapes 4x4096x16x128 8x2048x16x128 2x8192x16x128 --rounds 12
                   run one_step_walk_small_d 150 python3 benchmarks/ab_env.py --env FLEXATTN_ONE_STEP_WALK=1 --rounds 9 \
                     --variants full causal --shapes 4x4096x16x64 4x4096x16x32
                   run device_facts 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_device_facts_gpu.py ;;
    one-step-planned) XLA_PYTHON_CLIENT_PREALLOCATE=false RERUN_SECONDS=60 run_sharded one_step_planned 330 12 \
                        tests/gpu/test_head_dims_gpu.py tests/gpu/test_fwd_gpu.py \
                        -k "head_dims or 256_row_tiles or one_step_walk or own_diagonal or rescale_threshold"
                      run one_step_planned_ab 120 python3 benchmarks/ab_env.py --env FLEXATTN_ONE_STEP_WALK=0 --rounds 7 \
                        --variants full causal --shapes 4x4096x16x64 4x4096x16x32 8x2048x16x64 ;;
    planner-suites) XLA_PYTHON_CLIENT_PREALLOCATE=false RERUN_SECONDS=60 run_sharded planner_suites \
                      "${SHARD_LIMIT:-330}" 14 tests/gpu/test_flex_attention_gpu.py tests/gpu/test_torch_compat_gpu.py \
                      tests/gpu/test_autograd_gpu.py tests/gpu/test_mod_emit_gpu.py tests/gpu/test_cupy_gpu.py \
                      tests/gpu/test_jax_gpu.py ;;
    band-one-step-ab) run band_one_step_fwd 200 python3 benchmarks/ab_env.py --env FLEXATTN_BAND_ONE_STEP=0 \
                        --variants window1024 --shapes 4x4096x16x128 8x2048x16x128 2x8192x16x128 --rounds 11
                      run band_one_step_bwd 200 python3 benchmarks/ab_env.py --env FLEXATTN_BAND_ONE_STEP=0 \
                        --variants window1024 --shapes 4x4096x16x128 8x2048x16x128 2x8192x16x128 --rounds 7 --backward
                      first_call_ab band_first_call FLEXATTN_BAND_ONE_STEP window1024 causal ;;
    timeline-split) for i in 1 2 3; do   # (the shared-split rows' timelines: where an empty kernel's 0.3 µs goes)
                      for kind in none smem l1; do
                        (cd benchmarks && run timeline_split_${kind}_$i 90 python3 decode_timeline.py \
                          --shapes 1x131072 --variants window4096 --layouts contiguous --merges polled --reps 15 \
                          --by-sm --after-flush $kind)
                      done
                    done ;;
    band-tiles-ab) FLOOR_ROWS="1x131072:window4096 8x8192:window4096" floor_ab band_tiles_ab \
                     FLEXATTN_DECODE_BAND_TILES 8 aligned start ;;
    merge-chunk) run merge_chunk_tests 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_gpu.py \
                   -k "merge_chunk or parity_slots or polled_merge_planned"
                 floor_ab merge_chunk FLEXATTN_DECODE_MERGE_CHUNK 5 generic exact ;;
    slot-layout) run slot_layout_tests 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_gpu.py \
                   -k "parity_slots or polled_merge_planned"
                 for i in 1 2 3 4; do
                   for v in emptied:split emptied:group caller:split caller:group; do
                     slots=${v%%:*} layout=${v#*:}
                     zero=""; [ "$slots" = caller ] && zero=--zero-slots
                     FLEXATTN_DECODE_SLOTS=$slots FLEXATTN_DECODE_SLOT_LAYOUT=$layout \
                       FLEXATTN_CACHE_DIR=/tmp/flexattn-slots-$slots \
                       run layout_floor_${slots}_${layout}_$i 40 python3 benchmarks/decode_floor.py \
                       --rows 1x131072:window4096 $zero
                   done
                 done ;;
    window-tail) (cd benchmarks && run window_tail 90 python3 decode_timeline.py --shapes 1x131072 \
                   --variants window4096 --layouts contiguous --merges polled --reps 9 --marks --dump-ctas 3) ;;
    marks) (cd benchmarks && run marks_timeline 120 python3 decode_timeline.py --shapes 1x131072 8x8192 \
             --variants window4096 --layouts contiguous --merges tickets polled --reps 9 --marks) ;;
    scaled-indices) run scaled_tests 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_head_dims_gpu.py \
                      -k "scaled_indices"
                    run scaled_door 200 python3 benchmarks/ab_env.py --env FLEXATTN_SCALED_INDICES=0 --rounds 7 \
                      --variants causal+alibi --shapes 4x4096x16x32 4x4096x16x64 4x4096x16x128 8x2048x16x128
                    run scaled_door_bwd 150 python3 benchmarks/ab_env.py --env FLEXATTN_SCALED_INDICES=0 --rounds 5 \
                      --backward --variants causal+alibi --shapes 4x4096x16x128 ;;
    wide-bwd) run head_dims_wide_bwd 420 python3 benchmarks/bench_head_dims.py --backward \
                --dims 192/128 192/192 256/128 256/256 --out "$out/head_dims_wide_bwd.json" ;;
    scored-tiles) run scored_tiles_tests 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fwd_gpu.py \
                    -k "256_row_tiles and (softcap or window)"
                  run scored_tiles_32 150 python3 benchmarks/ab_env.py --env FLEXATTN_FWD_TILES=256x80 \
                    --also FLEXATTN_FWD_TILES=192x112 --rounds 7 --variants causal+softcap30 causal+alibi window1024 \
                    --shapes 4x4096x16x32 8x2048x16x32
                  run scored_tiles_64 150 python3 benchmarks/ab_env.py --env FLEXATTN_FWD_TILES=256x64 \
                    --also FLEXATTN_FWD_TILES=192x112 --rounds 7 --variants causal+softcap30 causal+alibi window1024 \
                    --shapes 4x4096x16x64 8x2048x16x64 ;;
    own-diagonal) c="max_ctas=-1,tile_tickets=1,rescale_threshold=8.0,maxima_on_demand=True"
                 run own_tests 130 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fwd_gpu.py \
                   -k "own_diagonal or 256_row_tiles"
                 (cd benchmarks
                  run own_32 70 python3 sweep_fwd_configs.py --dims 32/32 --rounds 5 --anchors fa4 flex --configs \
                    "tile_m=256,tile_n=80,$c,own_diagonal=False" "tile_m=256,tile_n=80,$c" "tile_m=256,tile_n=64,$c"
                  run own_64 70 python3 sweep_fwd_configs.py --dims 64/64 --rounds 5 --anchors fa4 flex --configs \
                    "tile_m=256,tile_n=64,$c,own_diagonal=False" "tile_m=256,tile_n=64,$c")
                 run own_door 100 python3 benchmarks/ab_env.py --env FLEXATTN_OWN_DIAGONAL=0 --rounds 7 \
                   --variants causal --shapes 4x4096x16x32 8x2048x16x32 4x4096x16x64 8x2048x16x64 4x4096x16x96 \
                   4x4096x16x256 ;;
    lazy-rescale) c="tile_m=192,max_ctas=-1,tile_tickets=1"   # (GPU 0 of two: the sweeps and the A/B)
                  (cd benchmarks
                   for d in 32 64; do
                     run lazy_$d 150 python3 sweep_fwd_configs.py --dims $d/$d --rounds 5 --anchors fa4 flex \
                       --configs "$c" "$c,rescale_threshold=8.0"
                   done
                   run lazy_128 150 python3 sweep_fwd_configs.py --dims 128/128 --rounds 5 --anchors fa4 flex \
                     --configs "tile_m=128" "tile_m=128,rescale_threshold=8.0"
                   run lazy_128_dense 150 python3 sweep_fwd_configs.py --dims 128/128 --dense --rounds 5 --anchors fa4 \
                     --configs "tile_m=128,max_ctas=-1" "tile_m=128,max_ctas=-1,rescale_threshold=8.0")
                  run lazy_door 300 python3 benchmarks/ab_env.py --env FLEXATTN_RESCALE_THRESHOLD=8 --rounds 5 \
                    --variants full causal window1024 document4 causal+softcap30 causal+alibi --shapes 4x4096x16x128 ;;
    lazy-rescale-tests)   # (GPU 1 of two: the threshold's own cases, then the door suites with it planned)
                  run lazy_tests 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fwd_gpu.py -k rescale_threshold
                  FLEXATTN_RESCALE_THRESHOLD=8 run lazy_public 330 python3 -m pytest -q -p no:cacheprovider \
                    tests/gpu/test_flex_attention_gpu.py
                  FLEXATTN_RESCALE_THRESHOLD=8 run lazy_heads 200 python3 -m pytest -q -p no:cacheprovider \
                    tests/gpu/test_head_dims_gpu.py -k "test_head_dims_against_reference" ;;
    *) echo "unknown step $step" ;;
  esac
done
