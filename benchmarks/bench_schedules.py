"""Forward schedule ablation of our sm90 kernel (overlap / ping-pong / tile order /
persistent CTAs), beside the anchors.

  ours:base  our sm90 CuTeDSL kernel (flexattn.kernels.fwd.sm90), default config (see below)
  fa4        FlashAttention-4 (flash_attn.cute.flash_attn_func)
  flex       torch flex_attention, torch.compile'd (Triton backend)
  flex-fa    torch flex_attention with kernel_options={"BACKEND": "FLASH"}
  cudnn      torch SDPA forced to the cuDNN backend

`ours:base` is the kernel's default config (`FwdConfig()`; causal through a mask hook, one CTA
per tile), the reference every variant's output is compared with: not what the planner runs
(the `ours:<variant>` columns are; e.g. `mcast+builtin` is causal at head dim 128 as planned
for long rows). TFLOP/s count 4*B*H*Sq*Skv*D per forward, halved for causal. All inputs share one
[B, S, H, D] storage (viewed as [B, H, S, D] where a library wants that). Prints a table
at the end; `--out FILE` also writes it as JSON.

    python3 benchmarks/bench_schedules.py [--shapes 4x4096x16x128] [--variants pp ov persist]
        [--anchors fa4 flex] [--out results.json]
"""

import argparse
import datetime
import json
import math
import traceback

import torch

from common import bench_ms, rel_diff


def flops(B, H, S, D, causal):
    f = 4.0 * B * H * S * S * D
    return f / 2 if causal else f


def make_inputs(B, S, H, D, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    return q, k, v


SCHEDULES = {  # our kernel's scheduling options; "ov+pp" is the default config
    "ov+pp": dict(intra_wg_overlap=True, pingpong=True),
    "ov": dict(intra_wg_overlap=True, pingpong=False),
    "pp": dict(intra_wg_overlap=False, pingpong=True),
    "plain": dict(intra_wg_overlap=False, pingpong=False),
    "by_head": dict(tile_order="by_head"),             # tile order (default: longest_first
    "longest": dict(tile_order="longest_first"),       # under causal, by_head otherwise)
    "persist": dict(max_ctas=-1),                      # -1: the GPU's SM count
    "persist+by_head": dict(max_ctas=-1, tile_order="by_head"),
    "persist+snake": dict(max_ctas=-1, snake=True),
    "persist+longest+snake": dict(max_ctas=-1, tile_order="longest_first", snake=True),
    # tiles after the first round by tickets from a global counter (one counter, reused:
    # the kernel leaves it zero)
    "persist+tickets": dict(max_ctas=-1, tile_tickets=True),
    "builtin+persist+longest": dict(builtin=True, max_ctas=-1, tile_order="longest_first"),
    "builtin+persist+longest+tickets": dict(builtin=True, max_ctas=-1, tile_order="longest_first",
                                            tile_tickets=True),
    # wider kv tiles at small head dims (fewer, longer softmax steps per wait): two
    # warpgroups of 128 rows; fit without spills at D32 x 256 and D64 x 192 (CPU SASS,
    # session 27), not measured yet
    "builtin+tickets+m128n256": dict(builtin=True, max_ctas=-1, tile_order="longest_first", tile_tickets=True,
                                     tile_m=128, tile_n=256),
    "builtin+tickets+m128n192": dict(builtin=True, max_ctas=-1, tile_order="longest_first", tile_tickets=True,
                                     tile_m=128, tile_n=192),
    "stages3": dict(num_stages=3),                     # a third K/V slot (one CTA per tile:
                                                       # with the persistent O buffer it won't fit)
    # kv tile width (FA3 / FA4 take 176 for head dim 128 without a causal / local mask)
    "n176": dict(tile_n=176),
    "n176+persist": dict(tile_n=176, max_ctas=-1),
    "n160+persist": dict(tile_n=160, max_ctas=-1),
    "n192": dict(tile_n=192),
    # clusters of 2 CTAs (adjacent q tiles) sharing each K/V load by TMA multicast
    "mcast": dict(cluster_m=2),
    "mcast+persist": dict(cluster_m=2, max_ctas=-1),
    # causal without the mask hook (the production causal kernel), with and without clusters
    "builtin": dict(builtin=True),
    "mcast+builtin": dict(cluster_m=2, builtin=True),
    "mcast+builtin+persist": dict(cluster_m=2, builtin=True, max_ctas=-1),
}


def ours(q, k, v, causal, scale, sched="ov+pp", block_sparse=False, window=None):
    """Returns (fn, first-call compile seconds, (o, lse)). block_sparse: drive the kernel
    with torch's own BlockMask tensors for the causal mask (the FlexAttention path);
    window: a causal sliding window of that many keys as the band structure (what the
    planner runs for it), instead of causal / full."""
    import cutlass  # noqa: F401
    from flexattn.kernels.emit import example_hooks as hooks
    from flexattn.kernels.fwd.sm90 import FwdConfig
    from flexattn.kernels.launch.forward import ForwardRunner

    opts = dict(SCHEDULES[sched])
    if opts.get("max_ctas") == -1:
        opts["max_ctas"] = torch.cuda.get_device_properties().multi_processor_count
    # "builtin": the causal structure's own diagonal mask, as the planner runs causal
    # (the other variants add a causal mask hook).
    builtin = opts.pop("builtin", False)
    hook = causal and not builtin
    if window is not None:
        from flexattn import mods
        from flexattn.kernels.emit.mod_emit import IRModHook
        from flexattn.mods.structure import canonical_band

        cfg = FwdConfig(dtype="bf16", head_dim=q.shape[-1], band=True,
                        mods=IRModHook(None, canonical_band(mods.sliding_window(window))), **opts)
    else:
        cfg = FwdConfig(dtype="bf16", head_dim=q.shape[-1], causal=causal,
                        mods=hooks.CausalHook() if hook else FwdConfig().mods, **opts)
    lists = None
    if block_sparse:
        from torch.nn.attention.flex_attention import create_block_mask
        S = q.shape[1]
        cfg = FwdConfig(dtype="bf16", head_dim=q.shape[-1], block_sparse=True,
                        mods=hooks.CausalHook(), **opts)
        bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device="cuda")
        lists = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
    if cfg.tile_tickets:
        lists = (lists or ()) + (torch.zeros(1, dtype=torch.int32, device="cuda"),)
    runner = ForwardRunner(cfg)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))      # [B, H, S, D] views
    o = torch.empty_like(qh)
    lse = torch.empty(qh.shape[:3], device="cuda", dtype=torch.float32)
    stream = torch.cuda.current_stream().cuda_stream

    args = ()
    if window is not None:   # the band's bounds are captured scalars
        from flexattn.kernels.emit.mod_emit import runtime_args
        args = runtime_args(cfg.mods, torch.as_tensor)
    fn = runner.bind(qh, kh, vh, o, lse, scale, args, stream, lists)   # compiles here
    fn()
    torch.cuda.synchronize()
    return fn, runner.last_compile_seconds, (o, lse)


def fa4(q, k, v, causal, scale, window=None):
    from flash_attn.cute import flash_attn_func
    if window is not None:
        return lambda: flash_attn_func(q, k, v, softmax_scale=scale, window_size=(window, 0))
    return lambda: flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)


def band_density(S: int, window: int) -> float:
    """Attended fraction of the S x S pairs under a causal window of `window` past keys."""
    pairs = sum(min(i, window) + 1 for i in range(S))
    return pairs / (S * S)


def flex(q, k, v, causal, scale, backend=None):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    bm = None
    if causal:
        S = q.shape[1]
        bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device="cuda")
    fa = torch.compile(flex_attention, dynamic=False)
    kw = {"kernel_options": {"BACKEND": backend}} if backend else {}
    return lambda: fa(qh, kh, vh, block_mask=bm, scale=scale, **kw)


def cudnn(q, k, v, causal, scale):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))

    def fn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                qh, kh, vh, is_causal=causal, scale=scale)
    return fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["4x4096x16x128", "8x4096x16x64"], help="BxSxHxD")
    ap.add_argument("--variants", nargs="*", default=["plain", "pp", "ov"], choices=list(SCHEDULES))
    ap.add_argument("--anchors", nargs="*", default=["fa4", "flex", "flex-fa", "cudnn"])
    ap.add_argument("--window", type=int, default=None,
                    help="a causal sliding window of this many keys (the band structure; anchors: fa4)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    dev = torch.cuda.get_device_name()
    rows = []
    for shape in args.shapes:
        B, S, H, D = map(int, shape.split("x"))
        q, k, v = make_inputs(B, S, H, D)
        scale = 1.0 / math.sqrt(D)
        for causal in ((None,) if args.window else (False, True)):
            w = args.window
            f = flops(B, H, S, D, False) * band_density(S, w) if w else flops(B, H, S, D, causal)
            res = {}
            fn, compile_s, (o_ours, _) = ours(q, k, v, causal, scale, window=w)
            res["ours:base"] = bench_ms(fn)
            ref_o = o_ours.clone()
            errs = {}
            for sched in args.variants:
                try:
                    fn_s, _, (o_s, _) = ours(q, k, v, causal, scale, sched, window=w)
                except Exception as e:  # e.g. a tile that does not fit in shared memory
                    print(f"[ours:{sched}] failed: {type(e).__name__}: {str(e)[:300]}")
                    continue
                errs[f"ours:{sched}"] = rel_diff(o_s, ref_o)
                res[f"ours:{sched}"] = bench_ms(fn_s)
            if causal and not w:   # same causal attention through torch's BlockMask lists
                fn_s, _, (o_s, _) = ours(q, k, v, causal, scale, block_sparse=True)
                errs["ours:bs"] = rel_diff(o_s, ref_o)
                res["ours:bs"] = bench_ms(fn_s)
            cands = {
                "fa4": lambda: fa4(q, k, v, causal, scale, w),
                "flex": lambda: flex(q, k, v, causal, scale),
                "flex-fa": lambda: flex(q, k, v, causal, scale, backend="FLASH"),
                "cudnn": lambda: cudnn(q, k, v, causal, scale),
            }
            for name, make in cands.items():
                if name not in args.anchors or (w and name != "fa4"):
                    continue
                try:
                    fn_b = make()
                    out = fn_b()
                    torch.cuda.synchronize()
                    errs[name] = rel_diff(out, ref_o)
                    res[name] = bench_ms(fn_b)
                except Exception as e:  # a missing/broken baseline must not hide the rest
                    print(f"[{name}] failed: {type(e).__name__}: {str(e)[:300]}")
                    traceback.print_exc(limit=2)
            tag = f"B={B} S={S} H={H} D={D} " + (f"window{w}" if w else ("causal" if causal else "full"))
            for name, ms in res.items():
                tf = f / ms / 1e9
                print(f"{tag:38s} {name:9s} {ms:8.3f} ms {tf:7.1f} TFLOP/s"
                      + (f"  rel-diff-vs-ours {errs[name]:.2e}" if name in errs else ""))
            rows.append({"shape": tag, "compile_s": compile_s,
                         "tflops": {n: f / ms / 1e9 for n, ms in res.items()}, "diff": errs})

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n== forward bf16, {dev}, {stamp} ==")
    names = ["ours:base"] + args.anchors + [f"ours:{v}" for v in args.variants] + ["ours:bs"]
    print(f"{'case':38s} " + " ".join(f"{n:>10s}" for n in names)
          + "   base/fa4 base/flex compile_s")
    for r in rows:
        t = r["tflops"]
        cells = " ".join(f"{t[n]:10.1f}" if n in t else f"{'-':>10s}" for n in names)
        ra = t["ours:base"] / t["fa4"] if "fa4" in t else float("nan")
        rf = t["ours:base"] / t["flex"] if "flex" in t else float("nan")
        print(f"{r['shape']:38s} {cells}   {ra:8.2f} {rf:9.2f} {r['compile_s']:9.1f}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": dev, "date": stamp, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
