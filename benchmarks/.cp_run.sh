source .gpu/activate.sh
timeout 240 python -m pytest -q -x tests/gpu/test_context_parallel_gpu.py 2>&1 | tail -3
cd benchmarks
timeout 330 python bench_context_parallel.py --worlds 1 2 4 --per-gpu 65536 --iters 3 --impls "flexattn ring" "flexattn direct" --trace $OUT/traces > $OUT/bench.txt 2>&1
grep '^|\|UTC' $OUT/bench.txt | tail -30
rm -f $OUT/traces/*w4_r[123]* $OUT/traces/*w2_r1*
