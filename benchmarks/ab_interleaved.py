"""Ours against FA4 in alternating rounds: the same variant, one library then the other,
N times, so both sample the GPU's clock / power ramp alike.

bench_fwd.py measures each library once, in a fixed order (ours first), and the H100
drops from 1980 to ~1600 MHz within a second of sustained load (sustained_clocks.py): a
single measurement's ratio depends on where in that ramp each library fell (bench_fwd's
full and causal ratios moved by +-3% between runs of the same code). Here every round
times ours then FA4 (even rounds) or FA4 then ours (odd rounds); the table gives the
median ms of each and the median of the per-round ratios.

    python3 benchmarks/ab_interleaved.py [--shapes 4x4096x16x128] [--variants full causal] [--rounds 10]
"""

import argparse
import datetime
import math
import statistics

import torch

from bench_fwd import Variant, baselines, ours_mask_args, setup_dynamo
from common import bench_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["4x4096x16x128"], help="BxSxHxD")
    ap.add_argument("--variants", nargs="*", default=["full", "causal"])
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    setup_dynamo()
    import flexattn.torch as fa

    lines = []
    for shape in args.shapes:
        B, S, H, D = map(int, shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        scale = 1.0 / math.sqrt(D)
        for name in args.variants:
            var = Variant(name, B, S, H)
            density, kw = ours_mask_args(var, S)
            work = 4.0 * B * H * S * S * D * density
            ours = lambda: fa.flex_attention(qh, kh, vh, score_mod=var.score, scale=scale, **kw)  # noqa: E731
            fa4 = dict(baselines(q, k, v, scale, var, S))["fa4"]()
            ours(), fa4()
            torch.cuda.synchronize()
            times = {"ours": [], "fa4": []}
            for r in range(args.rounds):
                order = ("ours", "fa4") if r % 2 == 0 else ("fa4", "ours")
                for impl in order:
                    times[impl].append(bench_ms(ours if impl == "ours" else fa4, warmup_ms=25, rep_ms=200))
            ratios = [f / o for o, f in zip(times["ours"], times["fa4"])]
            mo, mf = statistics.median(times["ours"]), statistics.median(times["fa4"])
            line = (f"| B{B} S{S} H{H} D{D} | {name} | {work / mo / 1e9:.1f} | {work / mf / 1e9:.1f} | "
                    f"{statistics.median(ratios):.3f} | {min(ratios):.3f}–{max(ratios):.3f} |")
            print(line, flush=True)
            lines.append(line)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n== ours vs FA4, {args.rounds} alternating rounds, {torch.cuda.get_device_name()}, {stamp} ==")
    print("| shape | variant | ours TFLOP/s (median) | fa4 TFLOP/s (median) | ours/fa4 (median of rounds) | range |")
    print("|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
