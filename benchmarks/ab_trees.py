"""Ours alone, forward and forward + backward, through the public torch API: one line per
variant with the median ms of several measurements. Used to compare two source trees on
one GPU (a refactor that must not change speed): run it alternately with each tree first
on PYTHONPATH, e.g.

    for tree in new base new base; do PYTHONPATH=$tree python3 benchmarks/ab_trees.py --tag $tree; done

Only the public API is called (``flexattn.torch``, ``flexattn.mods``), so any tree runs it.
"""

import argparse
import math
import statistics

import torch

from bench_bwd import BWD_FLOPS, fwd_bwd
from bench_fwd import Variant, ours_mask_args, setup_dynamo
from common import bench_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4x4096x16x128", help="BxSxHxD")
    ap.add_argument("--variants", nargs="*", default=["full", "causal", "window1024", "document4"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    setup_dynamo()
    import flexattn
    import flexattn.torch as fa

    B, S, H, D = map(int, args.shape.split("x"))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    grad = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    scale = 1.0 / math.sqrt(D)
    print(f"tree {args.tag or flexattn.__file__}")
    for name in args.variants:
        var = Variant(name, B, S, H)
        density, kw = ours_mask_args(var, S)
        flops = 4.0 * B * H * S * S * D * density
        fwd = lambda: fa.flex_attention(qh, kh, vh, score_mod=var.score, scale=scale, **kw)  # noqa: E731
        step = fwd_bwd(fwd, (q, k, v), grad)
        fwd(), step()
        torch.cuda.synchronize()
        f = statistics.median(bench_ms(fwd, warmup_ms=25, rep_ms=200) for _ in range(args.reps))
        b = statistics.median(bench_ms(step, warmup_ms=25, rep_ms=200) for _ in range(args.reps))
        print(f"{args.tag:6s} {name:12s} fwd {f:7.3f} ms {flops / f / 1e9:6.1f} TFLOP/s   "
              f"fwd+bwd {b:7.3f} ms {BWD_FLOPS * flops / b / 1e9:6.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
