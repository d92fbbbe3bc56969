"""Where a training step's host time goes at the user's door, part by part.

bench_bwd's step (its headline: torch-style mask and score functions through
``flexattn.torch``, the forward, then ``torch.autograd.grad``) is
submitted back to back without synchronizing; each round of N steps reports the host µs
per step, and wrappers (``time.perf_counter``) around our parts say how much of it is
ours: the prepared forward step, the prepared backward (its operands and output
allocations, ``_backward_arrays``; its workspace and three launches,
``PreparedBackward.launch``). Beside it, torch's own floor for the same structure: a custom
``autograd.Function`` that allocates what ours does (5 arrays) and launches nothing, and a
plain ``q * 1.0`` with its gradient. Medians over rounds; the device's host moves by tens
of percent between minutes, so compare trees in alternating processes.

    python3 benchmarks/step_host_parts.py [--shape 8x2048x16x128] [--variants document4 window1024]
        [--steps 50] [--rounds 7]
"""

import argparse
import collections
import time

import torch

from bench_bwd import VARIANTS
from bench_fwd import Variant, ours_mask_args
from common import accumulate_time, device_name
from profile_kernels import step_inputs

_PARTS = collections.defaultdict(float)


class _AllocatesOnly(torch.autograd.Function):
    """torch's floor for our step's structure: a custom Function saving q, k, v, returning
    two fresh arrays, its backward three; no kernel."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q), torch.empty(q.shape[:3], device=q.device)

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def host_us(step, steps: int, rounds: int):
    """(median host µs per step, our parts' µs per step in the median round)."""
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    results = []
    for _ in range(rounds):
        _PARTS.clear()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        results.append(((time.perf_counter() - t0) / steps * 1e6, {k: v / steps * 1e6 for k, v in _PARTS.items()}))
        torch.cuda.synchronize()
    results.sort(key=lambda r: r[0])
    return results[len(results) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8x2048x16x128", help="BxSxHxD")
    ap.add_argument("--variants", nargs="*", default=["document4", "window1024"], choices=VARIANTS)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    import flexattn.torch as fa
    import flexattn.torch.attention as fa_attention
    from flexattn.core import backward_path

    accumulate_time(fa_attention._PreparedStep, "forward", _PARTS, "forward step (outputs, launch)")
    accumulate_time(fa_attention._PreparedStep, "backward", _PARTS, "backward (ours, all)")
    accumulate_time(fa_attention, "_backward_arrays", _PARTS, "  operands, dq dk dv")
    accumulate_time(backward_path.PreparedBackward, "launch", _PARTS, "  workspace, 3 launches")

    B, S, H, D = map(int, args.shape.split("x"))
    (q, k, v), (qh, kh, vh), _, grad, scale = step_inputs(B, S, H, D, True)
    print(f"# {device_name()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, B{B} S{S} H{H} D{D}, "
          f"host µs per step (median of {args.rounds} rounds of {args.steps})")
    for name in args.variants:
        var = Variant(name, B, S, H)
        _, kw = ours_mask_args(var, S)   # bench_bwd's headline: the torch-style function's block mask

        def forward():
            return fa.flex_attention(qh, kh, vh, score_mod=var.score, scale=scale, **kw)

        def no_grad_forward():
            with torch.no_grad():
                return forward()

        def step():
            return torch.autograd.grad(forward(), (q, k, v), grad)

        for label, fn in (("fwd+bwd", step), ("forward, no_grad", no_grad_forward), ("forward, recorded", forward)):
            us, parts = host_us(fn, args.steps, args.rounds)
            print(f"{name} {label}: {us:.0f}  " + ", ".join(f"{part.strip()} {t:.0f}" for part, t in parts.items()),
                  flush=True)
    us, _ = host_us(lambda: torch.autograd.grad(_AllocatesOnly.apply(qh, kh, vh)[0], (q, k, v), grad),
                    args.steps, args.rounds)
    print(f"torch floor, a Function with 5 allocations and no kernel, fwd+bwd: {us:.0f}")
    us, _ = host_us(lambda: torch.autograd.grad(qh * 1.0, (q,), grad), args.steps, args.rounds)
    print(f"torch, q * 1.0 and its gradient: {us:.0f}")


if __name__ == "__main__":
    main()
