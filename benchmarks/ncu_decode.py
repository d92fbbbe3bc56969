"""One warm decode step per (layout, variant) inside a profiler range, for Nsight Compute.

The planned step's kernel (as bench_decode.py's "flexattn-k") and, for contiguous caches,
SDPA's, each launched once between ``cudaProfilerStart`` / ``cudaProfilerStop`` after a
read-only L2 flush, so ``ncu --profile-from-start off`` sees exactly those launches:

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum,... \\
        python3 benchmarks/ncu_decode.py --shape 8x8192
"""

import argparse

import torch

from bench_decode import baselines, make_inputs, variant_mods


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8x8192", help="BxL")
    ap.add_argument("--variants", nargs="*", default=["none", "alibi"])
    ap.add_argument("--layouts", nargs="*", default=["contiguous", "paged64"])
    args = ap.parse_args()
    from flexattn.torch.decoding import _kernel_decode

    B, L = map(int, args.shape.split("x"))
    flush = torch.ones(64 << 20, dtype=torch.int32, device="cuda")
    steps = []
    for layout in args.layouts:
        cache, k, v = make_inputs(B, L, layout)
        q = torch.randn(B, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        for name in args.variants:
            mask, score = variant_mods(name)
            _, _, step = _kernel_decode(q, cache, score, mask, None, launch=False)
            steps.append((f"{layout}/{name}/flexattn", step.launch))
            if layout == "contiguous":
                sdpa = baselines(name, q, k, v, L, 128 ** -0.5, False, False).get("sdpa")
                if sdpa is not None:
                    steps.append((f"{layout}/{name}/sdpa", sdpa))
    for _, fn in steps:
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _, fn in steps:
        flush.sum()
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled:", ", ".join(label for label, _ in steps))


if __name__ == "__main__":
    main()
