"""A planner switch (an environment variable) A/B at the user's door, interleaved in one
process: rounds alternate the settings, so clock drift as the GPU warms up spreads over
both alike (separate processes run one after the other read a few % apart).

Each round sets the variable (or removes it), drops the prepared calls (so the next call
plans again and reads it), calls once, then times (do_bench, L2 flushed). The call is
bench_fwd's headline: torch-style functions through ``flexattn.torch``, the block mask
built by ``create_block_mask(device="cuda")``; ``--backward``: forward + backward steps.

    python3 benchmarks/ab_env.py --env FLEXATTN_LIST_CLUSTERS=0 [--shapes 2x8192x16x128]
        [--variants document4 full] [--rounds 7] [--backward]

``--also`` adds more settings, each a column: ``NAME=VALUE``, or several joined by ``+``
(``--also FLEXATTN_DQ_FINISH=1+FLEXATTN_X=2``); every round runs them all, in turn.
"""

import argparse
import math
import os
import statistics

import torch

from bench_bwd import fwd_bwd
from bench_fwd import Variant, setup_dynamo
from common import bench_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", required=True, help="NAME=VALUE, against NAME unset")
    ap.add_argument("--also", nargs="*", default=[], help="more settings: NAME=VALUE[+NAME=VALUE...]")
    ap.add_argument("--shapes", nargs="*", default=["4x4096x16x128"], help="BxSxHxD")
    ap.add_argument("--variants", nargs="*", default=["full", "document4"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--backward", action="store_true")
    args = ap.parse_args()
    settings = [()] + [tuple(tuple(p.split("=", 1)) for p in s.split("+")) for s in [args.env] + args.also]
    names = {n for setting in settings for n, _ in setting}
    setup_dynamo()
    import flexattn.torch as fa
    import flexattn.torch.attention as fa_attention

    cols = " | ".join(f"{s} ms | / unset" for s in [args.env] + args.also)
    print(f"| shape | variant | unset ms | {cols} |\n|---|---|---|" + "---|---|" * (len(settings) - 1))
    for shape in args.shapes:
        B, S, H, D = map(int, shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
                   .requires_grad_(args.backward) for _ in range(3))
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        grad = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
        for variant in args.variants:
            var = Variant(variant, B, S, H)
            bm = fa.create_block_mask(var.mask_fn, None, None, S, S, device="cuda") if var.mask_fn else None
            fwd = lambda: fa.flex_attention(qh, kh, vh, score_mod=var.score_fn, block_mask=bm,  # noqa: E731
                                            scale=1.0 / math.sqrt(D))
            step = fwd_bwd(fwd, (q, k, v), grad) if args.backward else fwd
            times = [[] for _ in settings]
            for _ in range(args.rounds):
                for i, setting in enumerate(settings):
                    for n in names:
                        os.environ.pop(n, None)
                    os.environ.update(dict(setting))
                    fa_attention._PREPARED.clear()
                    step()
                    torch.cuda.synchronize()
                    times[i].append(bench_ms(step, warmup_ms=25, rep_ms=150))
            for n in names:
                os.environ.pop(n, None)
            med = [statistics.median(t) for t in times]
            rest = " | ".join(f"{b:.4f} | {b / med[0]:.3f}" for b in med[1:])
            print(f"| B{B} S{S} H{H} D{D} | {variant}{' fwd+bwd' if args.backward else ''} | {med[0]:.4f} | {rest} |",
                  flush=True)


if __name__ == "__main__":
    main()
