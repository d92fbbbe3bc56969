"""One warm step per implementation inside a profiler range, for Nsight Compute.

Every implementation is compiled and warmed up first; then ``cudaProfilerStart``, one
step of each, ``cudaProfilerStop``. So ``ncu --profile-from-start off`` sees exactly one
launch of every kernel of every implementation, ours beside FA4's, with no compile or
warm-up launches in between:

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \\
        --section WarpStateStats ... python3 benchmarks/ncu_step.py --variants full --mode fwd

(`--clock-control none`: the device notes ask to leave the clocks alone.)
"""

import argparse

import numpy as np
import torch

from bench_bwd import VARIANTS, fwd_bwd
from bench_fwd import Variant, baselines, ours_mask_args, setup_dynamo
from profile_kernels import step_inputs


def _scheduled(q, k, v, var, scale, sched):
    """Our forward kernel with one of bench_schedules.py's schedules (full / causal only)."""
    from bench_schedules import ours

    if var.name not in ("full", "causal"):
        return None
    return ours(q, k, v, var.name == "causal", scale, sched)[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4x4096x16x128", help="BxSxHxD")
    ap.add_argument("--variants", nargs="*", default=["full"], choices=VARIANTS)
    ap.add_argument("--impls", nargs="*", default=["flexattn", "fa4"],
                    help="flexattn, a baseline (fa4, flex, flex-fa, cudnn), or sched:NAME: our forward "
                         "kernel with a bench_schedules.py schedule (e.g. sched:by_head; --mode fwd)")
    ap.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwd")
    args = ap.parse_args()
    setup_dynamo()
    import flexattn.torch as fa

    B, S, H, D = map(int, args.shape.split("x"))
    train = args.mode == "fwdbwd"
    (q, k, v), (qh, kh, vh), grad_bshd, grad_bhsd, scale = step_inputs(B, S, H, D, train)
    steps = []
    for name in args.variants:
        var = Variant(name, B, S, H)
        _, kw = ours_mask_args(var, S)
        makers = [("flexattn", lambda var=var, kw=kw: (lambda: fa.flex_attention(
            qh, kh, vh, score_mod=var.score, scale=scale, **kw)))]
        makers += baselines(q, k, v, scale, var, S)
        makers += [(impl, lambda var=var, sched=impl[6:]: _scheduled(q, k, v, var, scale, sched))
                   for impl in args.impls if impl.startswith("sched:")]
        for impl, make in makers:
            if impl not in args.impls:
                continue
            call = make()
            if call is None:
                continue
            step = fwd_bwd(call, (q, k, v) + tuple(var.trainable),
                           grad_bshd if impl == "fa4" else grad_bhsd) if train else call
            for _ in range(3):
                step()
            steps.append((f"{name}/{impl}", step))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for label, step in steps:
        torch.cuda.nvtx.range_push(label)
        step()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.profiler.stop()
    print("profiled:", ", ".join(label for label, _ in steps))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
