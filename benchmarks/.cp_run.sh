source .gpu/activate.sh
timeout 220 python -m pytest -q -x --tb=short tests/gpu/test_context_parallel_gpu.py -k "merge_kernel or shard_by_shard or public_door or nccl" > $OUT/tests.txt 2>&1
grep -v "Warning\|warn\|^  \|^$" $OUT/tests.txt | tail -25
cd benchmarks
timeout 340 python bench_context_parallel.py --worlds 1 2 4 --per-gpu 65536 --iters 3 --impls "flexattn ring" "flexattn direct" torch --out $OUT/bench.json > $OUT/bench.txt 2>&1
grep '^|\|UTC' $OUT/bench.txt | tail -30
