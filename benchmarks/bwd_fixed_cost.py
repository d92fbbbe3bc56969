"""Per-CTA fixed cost against per-step cost of the backward's main kernel, ours and FA4's.

The main kernel runs one CTA per (kv block, kv head, batch); each CTA walks the q tiles.
Keeping the keys (and so the CTAs) fixed and varying the query length changes only the
number of steps per CTA, so the main kernel's device time against steps per CTA is a line:
its slope is the time of one step over the whole grid, its intercept the CTAs' fixed
cost (prologue: K/V and first Q/dO loads; epilogue: dK/dV stores, the last dQ adds; and
the launch). Both implementations, dense, one process, device µs from torch.profiler.

    python3 benchmarks/bwd_fixed_cost.py [--skv 4096] [--sq 640 1280 2560 4096 8192]
"""

import argparse
import datetime
import math

import numpy as np
import torch

from bench_bwd_schedules import fa4, ours
from profile_kernels import profile_step

TILE_M = 80          # both implementations' q tile for dense head dim 128


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--skv", type=int, default=4096)
    ap.add_argument("--sq", type=int, nargs="*", default=[640, 1280, 2560, 4096, 8192])
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    B, H, D, Skv = args.batch, args.heads, args.dim, args.skv
    scale = D ** -0.5
    g = torch.Generator(device="cuda").manual_seed(0)
    k, v = (torch.randn(B, Skv, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ctas = -(-Skv // 128) * H * B
    waves = ctas / sms
    rows = []
    for sq in args.sq:
        q, do = (torch.randn(B, sq, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
                 for _ in range(2))
        qh, kh, vh, doh = (t.transpose(1, 2) for t in (q, k, v, do))
        res = {}
        for name, make in (("ours", lambda: ours(qh, kh, vh, doh, False, scale, {})[0]),
                           ("fa4", lambda: fa4(q, k, v, do, False, scale))):
            kernels, _ = profile_step(make(), args.steps)
            main_name = max(kernels, key=lambda n: kernels[n][0])
            res[name] = (kernels[main_name][0],
                         sum(t for n, (t, _) in kernels.items() if n != main_name))
            print(f"Sq {sq}: {name} main {res[name][0]:.1f} µs ({main_name}), "
                  f"other kernels {res[name][1]:.1f} µs", flush=True)
        rows.append((sq, math.ceil(sq / TILE_M), res))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n== backward main kernel vs steps per CTA, B{B} H{H} D{D} Skv {Skv} dense, "
          f"{ctas} CTAs ({waves:.2f} waves of {sms}), {torch.cuda.get_device_name()}, {stamp} ==")
    print("| Sq | steps/CTA | ours main µs | FA4 main µs | ours/FA4 | ours pre+post µs | FA4 other µs |")
    print("|---|---|---|---|---|---|---|")
    for sq, steps, res in rows:
        print(f"| {sq} | {steps} | {res['ours'][0]:.1f} | {res['fa4'][0]:.1f} | "
              f"{res['ours'][0] / res['fa4'][0]:.3f} | {res['ours'][1]:.1f} | {res['fa4'][1]:.1f} |")
    steps = np.array([r[1] for r in rows], dtype=float)
    for name in ("ours", "fa4"):
        t = np.array([r[2][name][0] for r in rows])
        slope, icpt = np.polyfit(steps, t, 1)
        print(f"{name}: µs = {slope:.2f} x steps + {icpt:.1f}  ->  per step per wave "
              f"{slope / waves:.3f} µs, fixed per CTA {icpt / waves:.2f} µs")


if __name__ == "__main__":
    main()
