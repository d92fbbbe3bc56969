"""Where the host time of a repeated flexattn.torch call goes: cProfile of N steady-state
calls of one bench_overhead variant (after warm-up), top entries by cumulative time.

    python3 benchmarks/profile_host.py [--variant causal+alibi] [--shape 1x128x4x64] [--calls 2000]
"""

import argparse
import cProfile
import pstats

import torch

from bench_overhead import VARIANTS, ours_torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="causal+alibi", choices=VARIANTS)
    ap.add_argument("--shape", default="1x128x4x64")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    B, S, H, D = map(int, args.shape.split("x"))
    qh, kh, vh = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16) for _ in range(3))
    with torch.no_grad():
        fn = ours_torch(qh, kh, vh, args.variant, S)
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
