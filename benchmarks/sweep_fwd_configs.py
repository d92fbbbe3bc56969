"""Forward kernel configurations side by side at one head-dim pair, causal (built-in
diagonal) or dense: the planner's choice (through the door) against forced tile shapes and
schedules, beside FlashAttention-4 and torch flex (Triton), one process. For choosing the
planner's tiles by measurement (issue 25's head dims).

Each ``--configs`` entry is a comma-separated list of ``FwdConfig`` overrides on top of the
kernel's defaults for the call (``tile_m=128,tile_n=112,cluster_m=2``; ``max_ctas=-1`` is
the SM count; ``tile_tickets=1`` adds the tickets' counter). Every forced config's output is
compared with the door's (rel. Frobenius difference), so a broken config shows up.
TFLOP/s count 2·B·H·S²·(D + Dv) × the causal density, bf16, do_bench with L2 flushed.

    python3 benchmarks/sweep_fwd_configs.py --dims 192/128 --configs tile_n=128 tile_n=112 \
        "tile_n=112,cluster_m=2" [--shape 4x4096x16] [--dense] [--anchors fa4 flex] [--out F]
"""

import argparse
import datetime
import math
import statistics
import traceback

import torch

from common import bench_ms, device_name, rel_diff, report


def parse_overrides(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        value = value.strip()
        if value in ("True", "False"):
            out[key] = value == "True"
        elif value.lstrip("-").isdigit():
            out[key] = int(value)
        else:
            try:
                out[key] = float(value)   # (rescale_threshold=8.0)
            except ValueError:
                out[key] = value
    return out


def forced(qh, kh, vh, causal: bool, scale: float, overrides: dict):
    """(fn, config) of our forward kernel with these overrides, on [B, H, S, D] views."""
    from flexattn.kernels.fwd.sm90 import FwdConfig
    from flexattn.kernels.launch.forward import ForwardRunner

    opts = dict(overrides)
    if opts.get("max_ctas") == -1:
        opts["max_ctas"] = torch.cuda.get_device_properties().multi_processor_count
    if "tile_n" in opts and "kv_aligned" not in opts:   # as the planner sets it
        opts["kv_aligned"] = kh.shape[2] % 128 == 0 and 128 % opts["tile_n"] == 0
    if "tile_tickets" in opts:
        opts["tile_tickets"] = bool(opts["tile_tickets"])
    cfg = FwdConfig(dtype="bf16", head_dim=qh.shape[-1], head_dim_v=vh.shape[-1], causal=causal, **opts)
    lists = (torch.zeros(1, dtype=torch.int32, device="cuda"),) if cfg.tile_tickets else None
    o = torch.empty(*qh.shape[:3], vh.shape[-1], device="cuda", dtype=qh.dtype)
    lse = torch.empty(qh.shape[:3], device="cuda", dtype=torch.float32)
    stream = torch.cuda.current_stream().cuda_stream
    fn = ForwardRunner(cfg).bind(qh, kh, vh, o, lse, scale, (), stream, lists)
    return (lambda: (fn(), o)[1]), cfg


def kernel_us(fn, calls: int = 5) -> float:
    """GPU µs per call of ``fn``'s kernels, ``calls`` calls back to back under the profiler."""
    from profile_kernels import profile_step

    kernels, _ = profile_step(fn, calls)
    return sum(t for t, _ in kernels.values())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="192/128", help="D/Dv")
    ap.add_argument("--shape", default="4x4096x16", help="BxSxH")
    ap.add_argument("--dense", action="store_true", help="no mask (default: causal)")
    ap.add_argument("--configs", nargs="*", default=[])
    ap.add_argument("--anchors", nargs="*", default=["fa4", "flex"])
    ap.add_argument("--rounds", type=int, default=1, help="timings per impl, interleaved; the median is reported")
    ap.add_argument("--kernel-times", action="store_true",
                    help="also each impl's kernel µs per call back to back under the profiler (do_bench times from "
                         "its start event: where a call's host time exceeds the L2 flush, that difference counts)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import flexattn.torch as fa
    from flexattn import mods

    B, S, H = map(int, args.shape.split("x"))
    D, Dv = map(int, args.dims.split("/"))
    causal = not args.dense
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    v = torch.randn(B, S, H, Dv, device="cuda", dtype=torch.bfloat16, generator=g)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    scale = 1.0 / math.sqrt(D)
    density = (S + 1) / (2 * S) if causal else 1.0
    work = 2.0 * B * H * S * S * (D + Dv) * density
    kw = {"mask": mods.causal()} if causal else {}
    impls = {"planned": lambda: fa.flex_attention(qh, kh, vh, scale=scale, **kw)}
    ref = impls["planned"]()
    if "fa4" in args.anchors:
        from flash_attn.cute import flash_attn_func
        impls["fa4"] = lambda: flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)
    if "flex" in args.anchors:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
        bm = (create_block_mask(lambda b, h, i, j: i >= j, None, None, S, S, device="cuda") if causal else None)
        impls["flex"] = lambda: flex(qh, kh, vh, block_mask=bm, scale=scale)
    notes = {}
    for text in args.configs:
        try:
            fn, cfg = forced(qh, kh, vh, causal, scale, parse_overrides(text))
            out = fn()
            torch.cuda.synchronize()
            impls[text] = fn
            notes[text] = (f"m{cfg.tile_m} n{cfg.tile_n} s{cfg.num_stages} c{cfg.cluster_m} "
                           f"ctas{cfg.max_ctas} diff {rel_diff(out, ref):.1e}")
            print(f"[{text}] compiled: {notes[text]}", flush=True)   # (a hang below names its kernel)
        except Exception as e:
            traceback.print_exc()
            print(f"[{text}] failed: {type(e).__name__}: {str(e)[:200]}")
    times = {name: [] for name in impls}
    for _ in range(args.rounds):   # interleaved: a clock drift spreads over every impl
        for name, fn in impls.items():
            try:
                times[name].append(bench_ms(fn))
            except Exception as e:
                print(f"[{name}] bench failed: {type(e).__name__}: {str(e)[:200]}")
    rows = []
    for name, got in times.items():
        if got:
            ms = statistics.median(got)
            rows.append({"impl": name, "ms": ms, "tflops": work / ms / 1e9, "note": notes.get(name, ""),
                         "spread_ms": [min(got), max(got)]})
    if args.kernel_times:
        for r in rows:
            r["kernel_us"] = kernel_us(impls[r["impl"]])
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    base = next((r["tflops"] for r in rows if r["impl"] == "fa4"), None)
    md = (f"{stamp}  {device_name()}  B{B} S{S} H{H} D{D}/{Dv} {'causal' if causal else 'dense'}\n"
          "| impl | ms | TFLOP/s | vs fa4 | kernel µs back to back | config |\n|---|---|---|---|---|---|\n")
    for r in rows:
        ratio = f"{r['tflops'] / base:.3f}" if base else "—"
        kernel = f"{r['kernel_us']:.1f}" if "kernel_us" in r else "—"
        md += f"| {r['impl']} | {r['ms']:.4f} | {r['tflops']:.1f} | {ratio} | {kernel} | {r['note']} |\n"
    report(md, rows, args.out, stamp)


if __name__ == "__main__":
    main()
