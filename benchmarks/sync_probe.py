"""Does a step wait for the GPU? A probe for host synchronizations at the user's door.

Each variant's step (bench_bwd's headline: torch-style functions through
``flexattn.torch``; ``--mode fwd`` the forward alone) is warmed up, then the GPU is kept
busy by a long sleep kernel while the host submits N steps. A step that never waits
submits in its usual host time; one that synchronizes (a device-to-host copy, an event
wait, a cudaMalloc) blocks until the sleep ends, and the functions it blocked in lead a
cProfile by cumulative time. torch's own synchronizing calls are also reported through
``torch.cuda.set_sync_debug_mode("warn")``.

    python3 benchmarks/sync_probe.py [--shape 8x2048x16x128] [--variants document4 window1024]
        [--mode fwd|fwdbwd] [--steps 10] [--sleep-ms 200]
"""

import argparse
import warnings

import numpy as np
import torch

from bench_bwd import fwd_bwd
from bench_fwd import Variant, setup_dynamo
from common import cprofile_calls, cprofile_lines
from profile_kernels import host_profile, step_inputs


def _sleep_ms(ms: float):
    """Keep the current stream busy for about ``ms`` (torch.cuda._sleep counts cycles)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    cycles_per_ms = 1_000_000 / start.elapsed_time(end)
    torch.cuda._sleep(int(ms * cycles_per_ms))


def probe(step, steps: int, sleep_ms: float):
    for _ in range(3):
        step()
    free = host_profile(step, steps, profile=False)   # submit-only µs per step, idle GPU first
    _sleep_ms(sleep_ms)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        pr, busy = cprofile_calls(step, steps)
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    syncs = sorted({str(w.message)[:160] for w in caught if "synchroniz" in str(w.message).lower()})
    return free, busy * 1e6, syncs, "\n".join(cprofile_lines(pr, ("cumulative",), 25))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8x2048x16x128", help="BxSxHxD")
    ap.add_argument("--variants", nargs="*", default=["document4", "window1024", "causal+alibi"])
    ap.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwdbwd")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--sleep-ms", type=float, default=200.0)
    args = ap.parse_args()
    setup_dynamo()
    import flexattn.torch as fa

    B, S, H, D = map(int, args.shape.split("x"))
    train = args.mode == "fwdbwd"
    (q, k, v), (qh, kh, vh), _, grad_bhsd, scale = step_inputs(B, S, H, D, train)
    rows = []
    for name in args.variants:
        var = Variant(name, B, S, H)
        bm = fa.create_block_mask(var.mask_fn, None, None, S, S, device="cuda") if var.mask_fn else None
        call = lambda: fa.flex_attention(qh, kh, vh, score_mod=var.score_fn, block_mask=bm, scale=scale)  # noqa: E731
        step = fwd_bwd(call, (q, k, v) + tuple(var.trainable), grad_bhsd) if train else call
        free, busy, syncs, prof = probe(step, args.steps, args.sleep_ms)
        waits = busy > free + 0.5 * args.sleep_ms * 1e3 / args.steps
        rows.append((name, free, busy, waits))
        print(f"\n## {name} ({args.mode}, {args.shape}): host {free:.0f} µs/step free, {busy:.0f} µs/step behind a "
              f"{args.sleep_ms:.0f} ms sleep -> {'WAITS for the GPU' if waits else 'never waits'}")
        for s in syncs:
            print(f"  torch sync: {s}")
        if waits:
            print("\n".join("    " + ln for ln in prof.splitlines() if ln.strip())[:5000])
    print("\n| variant | host µs/step | behind a busy GPU | waits |\n|---|---|---|---|")
    for name, free, busy, waits in rows:
        print(f"| {name} | {free:.0f} | {busy:.0f} | {'yes' if waits else 'no'} |")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
