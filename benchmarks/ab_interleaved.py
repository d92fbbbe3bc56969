"""Two implementations of one variant in alternating rounds (by default our door against
FA4), so both sample the GPU's clock / power ramp alike.

bench_fwd.py measures each implementation once, in a fixed order (ours first), and the H100
drops from 1980 to ~1600 MHz within a second of sustained load (sustained_clocks.py): a
single measurement's ratio depends on where in that ramp each fell (bench_fwd's full and
causal ratios moved by +-3% between runs of the same code; its door / built-in column read
0.97-1.05 on one kernel in session 55). Here every round times A then B (even rounds) or B
then A (odd rounds); the table gives the median ms of each and the median of the per-round
ratios A / B in speed.

`--pair A B`: two of door (torch-style functions through flexattn.torch, bench_fwd's
headline), builtin (our built-in mods), fa4, flex (torch flex, Triton), flex-fa (its FLASH
backend). `--mode fwdbwd`: the training step of bench_bwd.py instead (forward + the
gradients of q, k, v; TFLOP/s count 3.5x the forward's work). `--pair door door` (one
implementation twice, two closures) is the control: how far from 1.000 this method reads
two identical calls.

    python3 benchmarks/ab_interleaved.py [--shapes 4x4096x16x128] [--variants full causal] [--rounds 10]
        [--mode fwd|fwdbwd] [--pair door builtin]
"""

import argparse
import datetime
import math
import statistics

import torch

from bench_bwd import BWD_FLOPS, fwd_bwd
from bench_fwd import Variant, beside_the_door, door_call, ours_mask_args, setup_dynamo
from common import bench_ms

IMPLS = ("door", "builtin", "fa4", "flex", "flex-fa")


def make_call(impl, var, q, k, v, scale, S):
    """The forward call of ``impl`` (None where it lacks the variant): bench_fwd's door,
    or one of its columns beside it. q, k, v: [B, S, H, D]."""
    if impl == "door":
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        return door_call(var, qh, kh, vh, scale, S)[1]
    made = dict(beside_the_door(q, k, v, scale, var, S)).get("flexattn-builtin" if impl == "builtin" else impl)
    return made() if made is not None else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["4x4096x16x128"], help="BxSxHxD")
    ap.add_argument("--variants", nargs="*", default=["full", "causal"])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwd")
    ap.add_argument("--pair", nargs=2, default=["door", "fa4"], choices=IMPLS, metavar="IMPL")
    ap.add_argument("--shared-grad", action="store_true",
                    help="fwdbwd: one [B, H, S, D] dO copy for both slots (default: one each, made in slot order)")
    ap.add_argument("--order", choices=("ab", "ba"), default="ab",
                    help="which slot's call is made (and first run) first")
    args = ap.parse_args()
    setup_dynamo()
    a, b = args.pair

    lines = []
    for shape in args.shapes:
        B, S, H, D = map(int, shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        train = args.mode == "fwdbwd"
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(train)
                   for _ in range(3))
        scale = 1.0 / math.sqrt(D)
        grad = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) if train else None
        for name in args.variants:
            var = Variant(name, B, S, H)
            density, _ = ours_mask_args(var, S)
            work = (BWD_FLOPS if train else 1.0) * 4.0 * B * H * S * S * D * density
            # keyed by slot, so that one implementation can face itself (the control)
            slots = (0, 1) if args.order == "ab" else (1, 0)
            calls = [None, None]
            for slot in slots:
                calls[slot] = make_call((a, b)[slot], var, q, k, v, scale, S)
            missing = [impl for impl, call in zip((a, b), calls) if call is None]
            if missing:
                print(f"| B{B} S{S} H{H} D{D} | {name} | {', '.join(missing)} lacks this variant |", flush=True)
                continue
            if train:
                # FA4 takes and returns [B, S, H, D]; the others [B, H, S, D]
                grad_bhsd = grad.transpose(1, 2).contiguous() if args.shared_grad else None
                for slot in slots:
                    impl = (a, b)[slot]
                    dout = grad if impl == "fa4" else (grad_bhsd if grad_bhsd is not None
                                                       else grad.transpose(1, 2).contiguous())
                    calls[slot] = fwd_bwd(calls[slot], (q, k, v), dout)
            for slot in slots:
                calls[slot]()
            torch.cuda.synchronize()
            times = ([], [])
            for r in range(args.rounds):
                for slot in ((0, 1) if r % 2 == 0 else (1, 0)):
                    times[slot].append(bench_ms(calls[slot], warmup_ms=25, rep_ms=200))
            ratios = [tb / ta for ta, tb in zip(*times)]
            ma, mb = statistics.median(times[0]), statistics.median(times[1])
            line = (f"| B{B} S{S} H{H} D{D} | {name} | {work / ma / 1e9:.1f} | {work / mb / 1e9:.1f} | "
                    f"{statistics.median(ratios):.3f} | {min(ratios):.3f}–{max(ratios):.3f} |")
            print(line, flush=True)
            lines.append(line)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n== {a} vs {b}, {args.mode}, {args.rounds} alternating rounds, {torch.cuda.get_device_name()}, "
          f"{stamp} ==")
    print(f"| shape | variant | {a} TFLOP/s (median) | {b} TFLOP/s (median) | {a}/{b} (median of rounds) | range |")
    print("|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
