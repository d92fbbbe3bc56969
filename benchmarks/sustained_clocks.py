"""Sustained load: per-call time, SM clock, power and energy per call while ours and FA4
each run for a few seconds (B4 S4096 H16 D128 bf16 by default; batches of back-to-back
calls timed with CUDA events, clock and power read after each batch). Shows whether a
ratio measured by bench_fwd.py / bench_bwd.py depends on how long the GPU has been under
load: the H100 reaches its 700 W limit within a second and lowers its clock, for every
library; from then on the time of a call is set by its energy, not its cycles.

Modes: fwd (the forward), fwdbwd (forward + gradients of q, k, v, as bench_bwd.py), bwd
(the backward kernels alone: ours bound once, FA4's autograd backward on a kept graph).

    python3 benchmarks/sustained_clocks.py [--seconds 3] [--mode fwd|fwdbwd|bwd] [--variants full causal]
"""
import argparse
import datetime
import math
import statistics
import time

import torch


def calls(mode, causal, B, S, H, D):
    """{"ours": f, "fa4": f}: no-argument calls of one step of `mode`."""
    import flexattn.torch as fa
    from flash_attn.cute import flash_attn_func

    from bench_bwd import fwd_bwd
    from bench_bwd_schedules import fa4 as fa4_backward, ours as ours_backward
    from flexattn import mods

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(mode == "fwdbwd")
    qh, kh, vh, doh = (t.transpose(1, 2) for t in (q, k, v, do))
    scale = 1.0 / math.sqrt(D)
    mask = mods.causal() if causal else None
    if mode == "bwd":
        return {"ours": ours_backward(qh, kh, vh, doh, causal, scale, {})[0],
                "fa4": fa4_backward(q, k, v, do, causal, scale)}
    ours = lambda: fa.flex_attention(qh, kh, vh, mask=mask, scale=scale)  # noqa: E731
    fa4 = lambda: flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)  # noqa: E731
    if mode == "fwd":
        return {"ours": ours, "fa4": fa4}
    return {"ours": fwd_bwd(ours, (q, k, v), doh.contiguous()), "fa4": fwd_bwd(fa4, (q, k, v), do)}


def sustain(f, seconds, batch):
    """[(ms per call, MHz, W)] after each batch of `batch` calls, for `seconds`."""
    samples, t0 = [], time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(batch):
            f()
        e1.record()
        e1.synchronize()
        samples.append((e0.elapsed_time(e1) / batch, torch.cuda.clock_rate(), torch.cuda.power_draw() / 1000))
    return samples


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--mode", choices=("fwd", "fwdbwd", "bwd"), default="fwd")
    ap.add_argument("--variants", nargs="*", default=["full"], choices=["full", "causal"])
    ap.add_argument("--shape", default="4x4096x16x128", help="BxSxHxD")
    ap.add_argument("--batch", type=int, default=20)
    args = ap.parse_args()
    B, S, H, D = map(int, args.shape.split("x"))
    rows = []
    for variant in args.variants:
        impls = calls(args.mode, variant == "causal", B, S, H, D)
        for f in impls.values():
            f()
        torch.cuda.synchronize()
        for name in ("ours", "fa4", "ours", "fa4"):
            samples = sustain(impls[name], args.seconds, args.batch)
            (t_a, c_a, p_a) = samples[0]
            tail = samples[len(samples) // 2:]          # the power-limited half
            t_b = statistics.median(s[0] for s in tail)
            c_b = statistics.median(s[1] for s in tail)
            p_b = statistics.median(s[2] for s in tail)
            rows.append((variant, name, t_a, c_a, t_b, c_b, p_b))
            print(f"{variant} {name}: first batch {t_a:.4f} ms @ {c_a} MHz {p_a:.0f} W -> sustained "
                  f"{t_b:.4f} ms @ {c_b:.0f} MHz {p_b:.0f} W, {p_b * t_b:.0f} mJ/call "
                  f"({len(samples)} batches)", flush=True)
            time.sleep(2.0)   # let the GPU cool a little between libraries
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n== sustained {args.mode}, {args.shape}, {torch.cuda.get_device_name()}, {stamp} ==")
    print("| variant | impl | first batch ms @ MHz | sustained ms @ MHz | W | mJ / call |")
    print("|---|---|---|---|---|---|")
    for variant, name, t_a, c_a, t_b, c_b, p_b in rows:
        print(f"| {variant} | {name} | {t_a:.3f} @ {c_a} | {t_b:.3f} @ {c_b:.0f} | {p_b:.0f} | {p_b * t_b:.0f} |")


if __name__ == "__main__":
    main()
