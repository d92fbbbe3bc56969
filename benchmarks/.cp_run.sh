source .gpu/activate.sh
timeout 150 python -m pytest -q -x --tb=short tests/gpu/test_context_parallel_gpu.py -k "direct or nccl" > $OUT/tests.txt 2>&1
grep -v "Warning\|warn\|^  \|^$\|^tests/" $OUT/tests.txt | tail -8
cd benchmarks
timeout 300 python bench_context_parallel.py --worlds 1 2 4 --per-gpu 65536 --iters 3 --impls "flexattn ring" "flexattn direct" --out $OUT/bench.json > $OUT/bench.txt 2>&1
grep '^|\|UTC' $OUT/bench.txt | tail -30
