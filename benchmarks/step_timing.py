"""Why a training step's time differs between bench_bwd.py and profile_kernels.py.

bench_bwd.py times each step alone (triton's do_bench: a 256 MB memset flushes L2 before
every step); profile_kernels.py runs steps back to back under the profiler. This script
times the same fwd+bwd step of ours and FA4's both ways in one process, and profiles the
flushed loop kernel by kernel, so a difference shows up as either kernel time (cold L2)
or GPU idle time (host latency exposed between the flush and the step's first kernel).

    python3 benchmarks/step_timing.py [--shape 4x4096x16x128] [--variants full causal]
        [--impls flexattn fa4 flex] [--door]

``--door``: ours called as bench_bwd's headline (torch-style functions, the block mask from
``create_block_mask(fn, ..., device="cuda")``) instead of through our built-in mods.
"""

import argparse
import datetime
from collections import defaultdict

import numpy as np
import torch

from bench_bwd import BWD_FLOPS, fwd_bwd
from bench_fwd import Variant, baselines, ours_mask_args, setup_dynamo
from common import bench_ms
from profile_kernels import _short, step_inputs


def back_to_back_ms(step, n=20):
    for _ in range(3):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def flushed_profile(step, n=10):
    """Kernel µs per step (the flush memset excluded) and the step's span from the end of
    the flush to the end of its last kernel, as do_bench's events see it."""
    cache = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        cache.zero_()
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            cache.zero_()
            step()
        torch.cuda.synchronize()
    events = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda ev: ev.time_range.start)
    kernels = defaultdict(float)
    spans, span_start, last_end = [], None, None
    for ev in events:
        name = _short(ev.name)
        is_flush = "elementwise" in name or "fill" in name.lower() or "zero" in name.lower()
        if is_flush and ev.time_range.elapsed_us() > 30:     # the 256 MB memset
            if span_start is not None:
                spans.append(last_end - span_start)
            span_start = ev.time_range.end
            continue
        kernels[name] += ev.time_range.elapsed_us() / n
        last_end = ev.time_range.end
    if span_start is not None and last_end is not None:
        spans.append(last_end - span_start)
    return dict(kernels), float(np.median(spans)) if spans else float("nan")


def gaps(step, n=6):
    """Back-to-back steps under the profiler: each kernel of the last step with the GPU
    idle time before it (µs), to see where a step's idle time sits."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    events = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda ev: ev.time_range.start)
    per_step = len(events) // n
    out, prev_end = [], None
    for ev in events[-2 * per_step:]:
        gap = ev.time_range.start - prev_end if prev_end is not None else 0.0
        out.append((gap, ev.time_range.elapsed_us(), _short(ev.name)))
        prev_end = ev.time_range.end
    return out[per_step:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4x4096x16x128", help="BxSxHxD")
    ap.add_argument("--variants", nargs="*", default=["full", "causal"])
    ap.add_argument("--impls", nargs="*", default=["flexattn", "fa4"])
    ap.add_argument("--door", action="store_true", help="ours through torch-style functions (bench_bwd's headline)")
    args = ap.parse_args()
    setup_dynamo()
    import flexattn.torch as fa

    B, S, H, D = map(int, args.shape.split("x"))
    (q, k, v), (qh, kh, vh), grad_bshd, grad_bhsd, scale = step_inputs(B, S, H, D, True)
    rows = []
    for name in args.variants:
        var = Variant(name, B, S, H)
        density, kw = ours_mask_args(var, S)
        work = BWD_FLOPS * 4.0 * B * H * S * S * D * density
        if args.door:
            door_bm = fa.create_block_mask(var.mask_fn, None, None, S, S, device="cuda") if var.mask_fn else None
            ours = lambda: (lambda: fa.flex_attention(qh, kh, vh, score_mod=var.score_fn, block_mask=door_bm,
                                                      scale=scale))
        else:
            ours = lambda: (lambda: fa.flex_attention(qh, kh, vh, score_mod=var.score, scale=scale, **kw))
        makers = [("flexattn", ours)] + list(baselines(q, k, v, scale, var, S))
        for impl, make in makers:
            if impl not in args.impls:
                continue
            call = make()
            if call is None:
                continue
            step = fwd_bwd(call, (q, k, v) + tuple(var.trainable), grad_bshd if impl == "fa4" else grad_bhsd)
            flushed = bench_ms(step)
            warm = back_to_back_ms(step)
            kernels, span = flushed_profile(step)
            ksum = sum(kernels.values())
            rows.append((name, impl, flushed, warm, ksum, span))
            print(f"{name} {impl}: do_bench {flushed * 1e3:.0f} µs ({work / flushed / 1e9:.1f} TFLOP/s), "
                  f"back-to-back {warm * 1e3:.0f} µs ({work / warm / 1e9:.1f}), flushed: kernels "
                  f"{ksum:.0f} µs, span {span:.0f} µs", flush=True)
            for kname, t in sorted(kernels.items(), key=lambda kv: -kv[1]):
                if t >= 5:
                    print(f"    {t:8.1f} µs  {kname}")
            print("  back-to-back, last step: idle before | kernel µs | name")
            for gap, t, kname in gaps(step):
                print(f"    {gap:8.1f} | {t:8.1f} | {kname}")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n== fwd+bwd step µs, {args.shape}, {torch.cuda.get_device_name()}, {stamp} ==")
    print("| variant | impl | do_bench (L2 flushed) | back-to-back | flushed: kernels | flushed: span |")
    print("|---|---|---|---|---|---|")
    for name, impl, flushed, warm, ksum, span in rows:
        print(f"| {name} | {impl} | {flushed * 1e3:.0f} | {warm * 1e3:.0f} | {ksum:.0f} | {span:.0f} |")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
