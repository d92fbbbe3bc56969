"""Ours against FA4 in alternating rounds: the same variant, one library then the other,
N times, so both sample the GPU's clock / power ramp alike.

bench_fwd.py measures each library once, in a fixed order (ours first), and the H100
drops from 1980 to ~1600 MHz within a second of sustained load (sustained_clocks.py): a
single measurement's ratio depends on where in that ramp each library fell (bench_fwd's
full and causal ratios moved by +-3% between runs of the same code). Here every round
times ours then FA4 (even rounds) or FA4 then ours (odd rounds); the table gives the
median ms of each and the median of the per-round ratios.

`--mode fwdbwd`: the training step of bench_bwd.py instead (forward + the gradients of q,
k, v; TFLOP/s count 3.5x the forward's work).

    python3 benchmarks/ab_interleaved.py [--shapes 4x4096x16x128] [--variants full causal] [--rounds 10]
        [--mode fwd|fwdbwd]
"""

import argparse
import datetime
import math
import statistics

import torch

from bench_bwd import BWD_FLOPS, fwd_bwd
from bench_fwd import Variant, baselines, ours_mask_args, setup_dynamo
from common import bench_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["4x4096x16x128"], help="BxSxHxD")
    ap.add_argument("--variants", nargs="*", default=["full", "causal"])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwd")
    args = ap.parse_args()
    setup_dynamo()
    import flexattn.torch as fa

    lines = []
    for shape in args.shapes:
        B, S, H, D = map(int, shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        train = args.mode == "fwdbwd"
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(train)
                   for _ in range(3))
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        scale = 1.0 / math.sqrt(D)
        for name in args.variants:
            var = Variant(name, B, S, H)
            density, kw = ours_mask_args(var, S)
            work = (BWD_FLOPS if train else 1.0) * 4.0 * B * H * S * S * D * density
            ours = lambda: fa.flex_attention(qh, kh, vh, score_mod=var.score, scale=scale, **kw)  # noqa: E731
            fa4 = dict(baselines(q, k, v, scale, var, S))["fa4"]()
            if train:
                grad = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
                ours = fwd_bwd(ours, (q, k, v), grad.transpose(1, 2).contiguous())
                fa4 = fwd_bwd(fa4, (q, k, v), grad)
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
    print(f"\n== ours vs FA4, {args.mode}, {args.rounds} alternating rounds, {torch.cuda.get_device_name()}, "
          f"{stamp} ==")
    print("| shape | variant | ours TFLOP/s (median) | fa4 TFLOP/s (median) | ours/fa4 (median of rounds) | range |")
    print("|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
