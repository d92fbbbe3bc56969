"""Forward + backward attention with mods, side by side on one GPU in one process.

The variants and implementations of bench_fwd.py (the headline "flexattn" column calls
flexattn.torch exactly as a torch user calls flex_attention: torch-style functions, a block
mask from create_block_mask(fn, ..., device="cuda"); "flexattn-builtin" the same variant
spelled with our built-in mods; FA4, flex Triton, flex FLASH backend, cuDNN SDPA — a
baseline that cannot run a variant or its backward is skipped with the reason printed), plus
"causal+trainable_bias": a learnable [H, 2S-1] relative-position bias that requires grad
(flexattn and flex Triton only; its gradient is part of the timed work).

One timed step = the forward + ``torch.autograd.grad`` of the output (a fixed random
gradient) w.r.t. q, k, v (and the trainable bias): the backward pass ``out.backward(grad)``
runs, without accumulating into ``.grad``. TFLOP/s count 3.5 × the forward's masked FLOPs
(forward 1 + backward 2.5: five GEMMs instead of two), times the exact density, so every
implementation is credited the same work. "first call s": our first forward + backward of
a new variant (trace + block mask + compiles). "max grad diff": the largest relative
difference of any baseline's gradients from ours.

    python3 benchmarks/bench_bwd.py [--shapes 4x4096x16x128 ...] [--variants causal ...] [--out results.json]
"""

import argparse
import datetime
import math
import time
import traceback

import numpy as np
import torch

from bench_fwd import (OPTIONAL_VARIANTS, VARIANTS as FWD_VARIANTS, Variant, beside_the_door, door_call, setup_dynamo,
                       table)
from common import bench_ms, device_name, measure_until_stopped, rel_diff, report
from results_log import RECORD_HELP, append_rows, tflops_rows

VARIANTS = FWD_VARIANTS + ("causal+trainable_bias",)
BWD_FLOPS = 3.5  # × the forward's


def fwd_bwd(call, inputs, grad):
    """One training step of attention: forward, then the gradients of ``inputs``."""
    def step():
        out = call()
        out = out[0] if isinstance(out, tuple) else out
        return torch.autograd.grad(out, inputs, grad)
    return step


def run_shape(B, S, H, D, variants, rows, deterministic=()):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    grad_bshd = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    grad_bhsd = grad_bshd.transpose(1, 2).contiguous()  # the same values, [B, H, S, D]
    scale = 1.0 / math.sqrt(D)
    for name in variants:
        var = Variant(name, B, S, H)
        inputs = (q, k, v) + tuple(var.trainable)
        # The user's door (headline); our built-in mods are the second column (where they exist).
        density, door = door_call(var, qh, kh, vh, scale, S)
        work = BWD_FLOPS * 4.0 * B * H * S * S * D * density
        ours = fwd_bwd(door, inputs, grad_bhsd)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            ref = ours()
        except Exception as e:
            print(f"[flexattn {name}] failed: {type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc(limit=2)
            continue
        torch.cuda.synchronize()
        first_call = time.perf_counter() - t0
        res, diff = {"flexattn": bench_ms(ours)}, {}
        det_ms = None
        if name in deterministic:  # the same step with bitwise-repeatable gradients
            torch.use_deterministic_algorithms(True)
            try:
                ours()
                torch.cuda.synchronize()
                det_ms = bench_ms(ours)
            finally:
                torch.use_deterministic_algorithms(False)
        for impl, make in beside_the_door(q, k, v, scale, var, S):
            try:
                call = make()
                if call is None:
                    continue
                step = fwd_bwd(call, inputs, grad_bshd if impl == "fa4" else grad_bhsd)
                grads = step()
                torch.cuda.synchronize()
                diff[impl] = max(rel_diff(a, b) for a, b in zip(grads, ref))
                res[impl] = bench_ms(step)
            except Exception as e:  # a baseline that cannot run this variant must not hide the rest
                print(f"[{impl} {name}] failed: {type(e).__name__}: {str(e)[:200]}")
                traceback.print_exc(limit=1)
        tag = f"B{B} S{S} H{H} D{D}"
        row = {"shape": tag, "variant": name, "density": density, "first_call_s": first_call,
               "tflops": {i: work / ms / 1e9 for i, ms in res.items()}, "ms": res, "rel_grad_diff_vs_ours": diff}
        if det_ms is not None:
            row["deterministic_tflops"] = work / det_ms / 1e9
        rows.append(row)
        print(f"{tag} {name:22s} " + "  ".join(f"{i}={row['tflops'][i]:.1f}" for i in res)
              + f"  first call {first_call:.2f}s  max grad diffs {({i: f'{d:.1e}' for i, d in diff.items()})}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["4x4096x16x128"], help="BxSxHxD")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS + OPTIONAL_VARIANTS)
    ap.add_argument("--out", default=None, help="write rows + markdown table as JSON")
    ap.add_argument("--deterministic", nargs="*", default=["full", "causal", "window1024"], choices=VARIANTS,
                    help="variants whose flexattn step is also timed under torch.use_deterministic_algorithms")
    ap.add_argument("--record", action="store_true", help=RECORD_HELP)
    args = ap.parse_args()
    setup_dynamo()
    rows = []

    def measure():
        for shape in args.shapes:
            B, S, H, D = map(int, shape.split("x"))
            run_shape(B, S, H, D, args.variants, rows, args.deterministic)
    measure_until_stopped(measure, rows)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    md = table(rows, device_name(), stamp, title="Forward + backward, bf16",
               flops=f"{BWD_FLOPS} × forward masked FLOPs × exact density")
    md += "\n\nmax grad diff vs ours: " + "; ".join(
        f"{r['variant']} " + ", ".join(f"{i} {d:.1e}" for i, d in r["rel_grad_diff_vs_ours"].items())
        for r in rows if r["rel_grad_diff_vs_ours"])
    det = [r for r in rows if "deterministic_tflops" in r]
    if det:
        md += "\n\ndeterministic flexattn (torch.use_deterministic_algorithms): " + "; ".join(
            f"{r['shape']} {r['variant']} {r['deterministic_tflops']:.1f} TFLOP/s "
            f"({r['deterministic_tflops'] / r['tflops']['flexattn']:.2f}× default)" for r in det)
    report(md, rows, args.out, stamp)
    if args.record:
        append_rows("backward", tflops_rows(rows), script="bench_bwd.py", device=device_name(), date=stamp)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
