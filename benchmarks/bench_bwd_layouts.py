"""The backward's layouts beyond head dim 128, side by side on one GPU: the split layout
(64-key CTAs) against the swapped one (`BwdConfig.dkv_swap`: 96- or 48-key CTAs), with
the rings the shared memory allows and FA4's (two Q stages, one dO stage, one dS^T
buffer: `do_stages=1, ds_buffers=1`). Configs are forced through tests/gpu's harness
(`kernel_backward`: our forward, then the backward kernels, NaN-poisoned workspace), so
each time is forward + backward kernels plus the harness's fills — compare rows, not
against other benchmarks. Causal, bf16, B4 S4096 H16 by default; median of 5 per round,
two alternating rounds; each layout's dQ / dK / dV against the planned layout's (max
difference over the largest value), so a wrong layout shows. What
`bwd.plan.with_swapped_layout` plans comes from these (`bwd.plan.SWAP_PLANNED`). Head dim
256's (FA4's choices there won, H200, 2026-11-28): `--dims 256/256 256/128 --layouts
planned split split-q2do1 split-dvfirst split-q2do1-dvfirst swap48-q2do1 rows48-q2do1
rows80-q2do1`.
`--mask window1024` and the `by_head` / `longest` layouts compare the CTA orders of a band's
backward instead (head dim 128); `idle` (`BwdConfig.idle_masked_keys`, planned since session
39) a warpgroup idling on visits that mask all its keys (head dims up to 128, causal or a
band), `no_idle` the same kernel without it.

    python3 benchmarks/bench_bwd_layouts.py [--shapes 4x4096x16 ...] [--dims 192/192 256/256]
    python3 benchmarks/bench_bwd_layouts.py --mask window1024 --dims 128/128 --layouts by_head longest
    python3 benchmarks/bench_bwd_layouts.py --dims 192/192 --layouts planned split --score softcap30
"""

import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests", "gpu"), os.path.join(ROOT, "tests")]
from test_bwd_gpu import kernel_backward  # noqa: E402
from flexattn import mods  # noqa: E402
from flexattn.core import AttentionSpec  # noqa: E402

# name -> BwdConfig fields (None: the planner's)
LAYOUTS = {
    "planned": {},
    "split": dict(tile_n=64),
    "swap96": dict(tile_n=96),
    "swap96-q2do1": dict(tile_n=96, num_stages=2, do_stages=1, ds_buffers=1),
    "swap48": dict(tile_n=48),
    "swap48-q2do1": dict(tile_n=48, num_stages=2, do_stages=1, ds_buffers=1),
    # issue 25's head-dim-256 candidates (FA4's choices there; rows48 / rows80 planned since
    # 2026-11-28): the split layout with two Q stages, FA4's tail order, FA4's rows split
    "split-q2do1": dict(tile_n=64, num_stages=2, do_stages=1),
    "split-dvfirst": dict(tile_n=64, tail_order="dv_first"),
    "split-q2do1-dvfirst": dict(tile_n=64, num_stages=2, do_stages=1, tail_order="dv_first"),
    "rows48-q2do1": dict(tile_n=48, num_stages=2, do_stages=1, ds_buffers=1, dkv_rows=True, tail_order="dv_first"),
    "rows80-q2do1": dict(tile_n=80, num_stages=2, do_stages=1, ds_buffers=1, dkv_rows=True, tail_order="dv_first"),
    # the rows split at 96 keys (head dims up to 192), with two stages of both or FA4's rings
    "rows96": dict(tile_n=96, num_stages=2, dkv_rows=True),
    "rows96-q2do1": dict(tile_n=96, num_stages=2, do_stages=1, ds_buffers=1, dkv_rows=True, tail_order="dv_first"),
    "swap96-dvfirst": dict(tile_n=96, num_stages=2, tail_order="dv_first"),
    # FA4's 192/192 layout exactly (its one dO slot freed once dV's GEMM retires, not after
    # dQ's staging): planned at 192/192 since session 38; `swap96-q2do1` runs our dQ-first order
    "swap96-q2do1-dvfirst": dict(tile_n=96, num_stages=2, do_stages=1, ds_buffers=1, tail_order="dv_first"),
    # ... and P^T stored while dP's GEMM runs (BwdConfig.p_early), as FA4 does
    "swap96-q2do1-dvfirst-pearly": dict(tile_n=96, num_stages=2, do_stages=1, ds_buffers=1, tail_order="dv_first",
                                        p_early=True),
    "idle": dict(idle_masked_keys=True),   # idle warpgroups on visits masking all their keys (128/128)
    "no_idle": dict(idle_masked_keys=False),
    "by_head": dict(tile_order="by_head"),
    "longest": dict(tile_order="longest_first"),
}


def time_ms(call, reps=5):
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["4x4096x16"], help="BxSxH each")
    ap.add_argument("--mask", default="causal", help="causal or windowN")
    ap.add_argument("--dims", nargs="*", default=["192/128", "192/192", "256/128", "256/256"])
    ap.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    ap.add_argument("--score", default=None, help="softcapN (a score mod: its registers ride along)")
    args = ap.parse_args()
    mask = mods.causal() if args.mask == "causal" else mods.sliding_window(int(args.mask[len("window"):]))
    score = mods.softcap(float(args.score[len("softcap"):])) if args.score else None
    spec = AttentionSpec.from_args(mask=mask, score=score)
    print(f"{args.mask} {args.score or ''}\n| BxSxH | D/Dv | layout | tile_n | stages Q/dO | dS bufs | order | ms round 1 | ms round 2 |"
          " max rel. diff vs planned (dq, dk, dv) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for shape, dims in ((s, d) for s in args.shapes for d in args.dims):
        B, S, H = map(int, shape.split("x"))
        D, Dv = map(int, dims.split("/"))
        q, k = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        v, do = (torch.randn(B, H, S, Dv, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        rows = {}
        want = kernel_backward(q, k, v, do, spec)[:3]      # the planned layout's dq, dk, dv
        for name in args.layouts:
            try:
                got = kernel_backward(q, k, v, do, spec, **LAYOUTS[name])
            except ValueError as e:          # a layout this head dim does not allow
                print(f"| {shape} | {dims} | {name} | — | — | — | — | {str(e)[:60]} | | |")
                continue
            except Exception as e:           # a compile failure: reported, the other layouts still run
                print(f"| {shape} | {dims} | {name} | — | — | — | — | failed: {type(e).__name__}: {str(e)[:60]} | | |")
                continue
            # a wrong layout shows here (NaN-poisoned outputs: NaN where it wrote nothing)
            diff = [((g.float() - w.float()).abs().max() / w.float().abs().max()).item() for g, w in zip(got[:3], want)]
            rows[name] = [got[6], [], diff]
        for _ in range(2):
            for name, row in rows.items():
                row[1].append(time_ms(lambda: kernel_backward(q, k, v, do, spec, **LAYOUTS[name])))
        for name, (cfg, ms, diff) in rows.items():
            print(f"| {shape} | {dims} | {name} | {cfg.tile_n} | {cfg.num_stages}/{cfg.do_ring} | {cfg.ds_ring} | {cfg.order} | "
                  + " | ".join(f"{t:.3f}" for t in ms) + " | " + ", ".join(f"{d:.1e}" for d in diff) + " |")


if __name__ == "__main__":
    main()
