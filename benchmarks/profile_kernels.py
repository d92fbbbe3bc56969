"""Where the GPU time of one step goes, kernel by kernel, ours beside the baselines.

The same variants and calls as bench_fwd.py / bench_bwd.py, each step run N times under
``torch.profiler`` (CUPTI), then the device time of every kernel is summed per step and
printed per implementation: which kernel of ours is slower than its counterpart (the
forward, the backward's main kernel, pre/postprocess, memsets), and how much of the step's
wall time the GPU sits idle (host gaps).

    python3 benchmarks/profile_kernels.py [--shapes 4x4096x16x128] [--variants full causal ...]
        [--impls flexattn fa4 flex] [--mode fwd|fwdbwd] [--steps 20] [--host] [--deterministic]

``--host``: also the host time of a step (submit-only loop, no synchronization: if it
comes out near the step's GPU time, something in the step waits for the GPU) and, for
flexattn, a cProfile of that loop (top functions by own and by cumulative time).
"""

import argparse
import math
import re
import time
from collections import defaultdict

import numpy as np
import torch

from bench_bwd import BWD_FLOPS, VARIANTS, fwd_bwd
from bench_fwd import Variant, baselines, ours_mask_args, setup_dynamo
from common import cprofile_calls, cprofile_lines, device_name


def _short(name: str) -> str:
    """A kernel's name without template arguments, at most 60 characters."""
    name = re.sub(r"<.*", "", name)
    name = re.sub(r"\(.*", "", name)
    return name[:60]


def step_inputs(B, S, H, D, train: bool):
    """(q, k, v [B, S, H, D] bf16 leaves, their [B, H, S, D] views, the output gradient in
    both layouts, softmax scale): the tensors every implementation's step reads."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(train)
               for _ in range(3))
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    grad_bshd = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    grad_bhsd = grad_bshd.transpose(1, 2).contiguous()
    return (q, k, v), (qh, kh, vh), grad_bshd, grad_bhsd, 1.0 / math.sqrt(D)


def profile_step(step, steps: int):
    """(kernels: name -> (µs per step, launches per step), wall µs per step)."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps * 1e6
    kernels = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[_short(ev.name)]
            k[0] += ev.device_time / steps
            k[1] += 1 / steps
    return dict(kernels), wall


def host_profile(step, steps: int, profile: bool):
    """µs of host time per step (steps submitted back to back, no synchronization)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    host = (time.perf_counter() - t0) / steps * 1e6
    torch.cuda.synchronize()
    if profile:
        pr, _ = cprofile_calls(step, steps)
        torch.cuda.synchronize()
        for key, limit in (("tottime", 40), ("cumulative", 60)):
            print("\n".join("      " + ln for ln in cprofile_lines(pr, (key,), limit))[:9000])
    return host


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["4x4096x16x128"], help="BxSxHxD")
    ap.add_argument("--variants", nargs="*", default=["full", "causal"], choices=VARIANTS)
    ap.add_argument("--impls", nargs="*", default=["flexattn", "fa4", "flex"])
    ap.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwdbwd")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--host", action="store_true", help="also host µs per step (+ a cProfile of ours)")
    ap.add_argument("--deterministic", action="store_true",
                    help="also ours under torch.use_deterministic_algorithms ('flexattn-det') and "
                         "FA4 with deterministic=True ('fa4-det')")
    args = ap.parse_args()
    setup_dynamo()
    import flexattn.torch as fa

    print(f"# {device_name()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, mode {args.mode}")
    for shape in args.shapes:
        B, S, H, D = map(int, shape.split("x"))
        train = args.mode == "fwdbwd"
        (q, k, v), (qh, kh, vh), grad_bshd, grad_bhsd, scale = step_inputs(B, S, H, D, train)
        for name in args.variants:
            var = Variant(name, B, S, H)
            density, kw = ours_mask_args(var, S)
            work = (BWD_FLOPS if train else 1.0) * 4.0 * B * H * S * S * D * density
            makers = [("flexattn", lambda: (lambda: fa.flex_attention(qh, kh, vh, score_mod=var.score,
                                                                      scale=scale, **kw)))]
            if args.deterministic:
                makers.append(("flexattn-det", makers[0][1]))
            makers += baselines(q, k, v, scale, var, S)
            if args.deterministic and var.fa4_kw is not None:
                def fa4_det():
                    from flash_attn.cute import flash_attn_func

                    return lambda: flash_attn_func(q, k, v, softmax_scale=scale, deterministic=True, **var.fa4_kw)
                makers.append(("fa4-det", fa4_det))
            print(f"\n## B{B} S{S} H{H} D{D} {name}")
            for impl, make in makers:
                if impl not in args.impls and impl.removesuffix("-det") not in args.impls:
                    continue
                torch.use_deterministic_algorithms(impl == "flexattn-det")
                try:
                    call = make()
                    if call is None:
                        continue
                    inputs = (q, k, v) + tuple(var.trainable)
                    step = fwd_bwd(call, inputs, grad_bshd if impl.startswith("fa4") else grad_bhsd) if train else call
                    kernels, wall = profile_step(step, args.steps)
                except Exception as e:  # a baseline that cannot run this variant must not hide the rest
                    print(f"[{impl}] failed: {type(e).__name__}: {str(e)[:200]}")
                    continue
                gpu = sum(t for t, _ in kernels.values())
                print(f"{impl}: wall {wall:.0f} µs/step ({work / wall / 1e6:.1f} TFLOP/s), kernels {gpu:.0f} µs"
                      f" ({work / gpu / 1e6:.1f} TFLOP/s), idle {max(wall - gpu, 0):.0f} µs")
                for kname, (t, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0]):
                    if t >= 1.0:
                        print(f"    {t:9.1f} µs  x{n:.0f}  {kname}")
                if args.host:
                    host = host_profile(step, args.steps, impl == "flexattn")
                    print(f"  {impl}: host {host:.0f} µs/step (submit only)")
            torch.use_deterministic_algorithms(False)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
