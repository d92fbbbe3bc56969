"""What a backward visit costs on each walk: dense, band and block lists at the same geometry.

A document mask's backward (block lists) took longer per visited q tile than a sliding
window's (band arithmetic) in session 30's profiles. This script runs the same fwd+bwd
step under ``torch.profiler`` for walks that visit the same tiles in different ways and
prints the backward main kernel's µs per visit (tile_m-row q tile × 128-key CTA):

* ``dense S`` — no mask, B·(4096/S) sequences of S tokens: every CTA visits S/64 tiles;
* ``docs S`` — B sequences of 4096 tokens in documents of S tokens (block lists, the
  same visits per CTA as ``dense S``: full blocks only);
* ``docs1`` — one document of 4096 tokens (lists of full blocks, as many visits as dense);
* ``window W`` — the band walk of a causal sliding window (for comparison).

    python3 benchmarks/bwd_walks.py [--batch 4] [--heads 16] [--dim 128]
"""

import argparse

import numpy as np
import torch

from bench_bwd import fwd_bwd
from profile_kernels import profile_step, step_inputs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--docs", nargs="*", type=int, default=[1024, 4096])
    args = ap.parse_args()
    import flexattn.torch as fa

    B, H, D, S = args.batch, args.heads, args.dim, args.seqlen
    rows = []

    def run(label, b, s, block_mask, visits_per_cta):
        (q, k, v), (qh, kh, vh), _, grad, scale = step_inputs(b, s, H, D, True)
        step = fwd_bwd(lambda: fa.flex_attention(qh, kh, vh, block_mask=block_mask, scale=scale), (q, k, v), grad)
        kernels, wall = profile_step(step, 10)
        main_us = sum(t for name, (t, _) in kernels.items() if "FlashBwdSm90" in name)
        fwd_us = sum(t for name, (t, _) in kernels.items() if "FlashFwdSm90" in name)
        ctas = b * H * (s // 128)
        rows.append((label, main_us, fwd_us, visits_per_cta, main_us / (ctas / 132) / visits_per_cta))

    for doc in args.docs:
        run(f"dense S{doc}", B * S // doc, doc, None, doc // 64)
        ids = torch.arange(S, device="cuda") // doc
        bm = fa.create_block_mask(lambda b, h, q, kv: ids[q] == ids[kv], None, None, S, S, device="cuda")
        run(f"docs {doc}", B, S, bm, doc // 64)
    bm = fa.create_block_mask(lambda b, h, q, kv: (q >= kv) & (q - kv <= 1024), None, None, S, S, device="cuda")
    run("window 1024", B, S, bm, 1152 / 64)
    print(f"\n{torch.cuda.get_device_name()}, B{B} S{S} H{H} D{D} (dense rows: B·S/doc sequences of doc tokens)")
    print("| walk | bwd main µs | fwd µs | visits per CTA | µs per visit and SM |\n|---|---|---|---|---|")
    for label, main_us, fwd_us, visits, per in rows:
        print(f"| {label} | {main_us:.1f} | {fwd_us:.1f} | {visits:.1f} | {per:.3f} |")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
