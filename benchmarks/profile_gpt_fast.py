"""Where the host time of gpt-fast's decoding step goes with our imports: a cProfile of N
steady-state steps, eager and compiled (default mode), top entries by internal and by
cumulative time, the kernels one step launches (torch.profiler: names, count, device µs),
then each step's host µs (a submit-only loop, no sync) beside its µs per step with the GPU
(do_bench). torch's own compiled step (the same code with torch's imports) runs beside ours
unless ``--no-torch``: its host time is torch.compile's floor on the same host.

    python3 benchmarks/profile_gpt_fast.py [--shape 8x8192] [--steps 300] [--top 30]

The step is ``tests/compat_cases.gpt_fast_decode_step`` (bench_gpt_fast.py's).
"""

import argparse
import os
import sys

import torch

from bench_overhead import host_us
from common import bench_ms, cprofile_calls, cprofile_lines

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from compat_cases import gpt_fast_decode_step as decode_step  # noqa: E402

HQ, HKV, D = 32, 8, 128


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8x8192")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--no-torch", action="store_true", help="leave out torch's own compiled step")
    args = ap.parse_args()
    import flexattn.torch as fa

    def causal(b, h, q, kv):
        return q >= kv

    batch, max_len = (int(x) for x in args.shape.split("x"))
    k_cache, v_cache = (torch.randn(batch, HKV, max_len, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    input_pos = torch.tensor([max_len - 1 - 37], device="cuda")
    import torch.nn.attention.flex_attention as torch_flex

    mask = fa.create_block_mask(causal, 1, 1, max_len, max_len, device="cuda")
    torch_mask = torch_flex.create_block_mask(causal, 1, 1, max_len, max_len, device="cuda")
    # (step, its block mask): ours eager and compiled, and torch's own compiled step beside
    # them (the same code with torch's imports), whose host time is torch.compile's floor here
    steps = {"eager": (decode_step(fa, k_cache, v_cache, max_len), mask),
             "default": (torch.compile(decode_step(fa, k_cache, v_cache, max_len), fullgraph=True), mask)}
    if not args.no_torch:
        steps["torch-default"] = (torch.compile(decode_step(torch_flex, k_cache, v_cache, max_len), fullgraph=True),
                                  torch_mask)
    table = []
    with torch.no_grad():
        for name, (step, step_mask) in steps.items():
            fn = lambda step=step, step_mask=step_mask: step(q, input_pos, step_mask)  # noqa: E731
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            prof, _ = cprofile_calls(fn, args.steps)
            torch.cuda.synchronize()
            print(f"\n==== {name}: cProfile of {args.steps} steps, by internal time")
            print("\n".join(cprofile_lines(prof, ("tottime",), args.top)))
            print(f"==== {name}: by cumulative time")
            print("\n".join(cprofile_lines(prof, ("cumulative",), args.top)))
            kernels = kernels_per_step(fn)
            print(f"==== {name}: kernels per step ({sum(n for n, _ in kernels.values()):.1f})")
            for kernel, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
                print(f"  {n:5.1f} x {us:8.2f} µs  {kernel[:110]}")
            table.append((name, host_us(fn, args.steps), bench_ms(fn) * 1e3, sum(n for n, _ in kernels.values())))
    print(f"\ngpt-fast step, B x max_len {args.shape}, Hq {HQ} Hkv {HKV} D {D} bf16, {torch.cuda.get_device_name()}\n")
    print("| step | host µs (submit only) | µs per step (do_bench) | kernels per step |\n|---|---|---|---|")
    for name, host, step_us, count in table:
        print(f"| {name} | {host:.1f} | {step_us:.1f} | {count:.1f} |")


def kernels_per_step(fn, steps: int = 20) -> dict:
    """{kernel name: (launches per step, device µs per launch)} over ``steps`` steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    found = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            n, us = found.get(event.name, (0, 0.0))
            found[event.name] = (n + 1, us + event.device_time)
    return {name: (n / steps, us / n) for name, (n, us) in found.items()}


if __name__ == "__main__":
    main()
