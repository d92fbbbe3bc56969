"""Backward ablation of our sm90 kernels (BwdConfig variants), beside FA4's backward.

Times the three backward kernels of one call (preprocess, main, dQ postprocess) bound once
(`BackwardRunner.bind`), for dense or causal attention, against FA4's backward (autograd
through `flash_attn.cute.flash_attn_func`, the graph kept). TFLOP/s count 2.5x the forward's
4*B*H*S*S*D (halved for causal), as bench_bwd.py does. Each variant is checked against the
default config's gradients.

    python3 benchmarks/bench_bwd_schedules.py [--shapes 4x4096x16x128] [--variants cluster]
"""

import argparse
import datetime

import torch

from common import bench_ms

VARIANTS = {  # BwdConfig overrides on top of the planner's config (config_from_forward)
    "default": {},
    "cluster": dict(cluster_n=2),      # kv-block pairs share Q / dO loads (TMA multicast)
    "by_head": dict(tile_order="by_head"),            # kv blocks of a head in launch order
    "longest": dict(tile_order="longest_first"),      # (the default under causal)
    # longest-first sections of fewer (kv head, batch) pairs (BwdConfig.l2_section_bytes): at
    # D64 S4096 a pair's rows take 2.1 MB, so 5 / 10 / 20 MB hold 2 / 4 / 8 pairs (default 16)
    "sections2": dict(tile_order="longest_first", l2_section_bytes=5 << 20),
    "sections4": dict(tile_order="longest_first", l2_section_bytes=10 << 20),
    "sections8": dict(tile_order="longest_first", l2_section_bytes=20 << 20),
}


def ours(qh, kh, vh, doh, causal, scale, overrides):
    """-> (launch, (dq, dk, dv)) for our backward with `overrides`."""
    from flexattn import mods
    from flexattn.core import AttentionSpec, check_inputs
    from flexattn.core.kernel_path import Device, forward_into
    from flexattn.kernels.bwd.plan import config_from_forward, workspace_dtypes, workspace_shapes
    from flexattn.kernels.launch.backward import BackwardRunner
    from flexattn.kernels.launch.operands import BackwardArrays
    from flexattn.torch.devices import _backward_alloc, _DeviceCopies

    spec = AttentionSpec.from_args(mask=mods.causal() if causal else None, scale=scale)
    shape = check_inputs(qh, kh, vh, spec)
    stream = torch.cuda.current_stream().cuda_stream
    # (the forward's causal walk takes a tile-order list: copied to the GPU as the door does)
    dev = Device(stream, _DeviceCopies(torch.device("cuda")), alloc=_backward_alloc(torch.device("cuda")))
    out = torch.empty_like(qh)
    lse = torch.empty(qh.shape[:3], device="cuda", dtype=torch.float32)
    plan = forward_into(qh, kh, vh, out, lse, shape, spec, dev)
    cfg = config_from_forward(plan.config, **overrides)
    dtypes = workspace_dtypes(cfg)
    ws = tuple(torch.empty(s, device="cuda", dtype=getattr(torch, dtypes[n])) for n, s in
               workspace_shapes(cfg, shape.batch, shape.q_heads, shape.q_len).items())
    dq, dk, dv = torch.empty_like(qh), torch.empty_like(kh), torch.empty_like(vh)
    launch = BackwardRunner(cfg).bind(BackwardArrays(qh, kh, vh, out, lse, doh, dq, dk, dv), ws, scale, (), None,
                                      stream)
    return launch, (dq, dk, dv)


def fa4(q, k, v, do, causal, scale):
    from flash_attn.cute import flash_attn_func

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)
    o = o[0] if isinstance(o, tuple) else o
    return lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["4x4096x16x128"], help="BxSxHxD")
    ap.add_argument("--variants", nargs="*", default=["cluster"], choices=list(VARIANTS))
    ap.add_argument("--masks", nargs="*", default=["full"], choices=["full", "causal"])
    ap.add_argument("--no-fa4", action="store_true")
    args = ap.parse_args()
    rows = []
    for shape in args.shapes:
        B, S, H, D = map(int, shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
                       for _ in range(4))
        qh, kh, vh, doh = (t.transpose(1, 2) for t in (q, k, v, do))
        scale = D ** -0.5
        for mask in args.masks:
            causal = mask == "causal"
            flops = 2.5 * 4.0 * B * H * S * S * D / (2 if causal else 1)
            res = {}
            ref = None
            for name in ["default"] + [n for n in args.variants if n != "default"]:
                try:
                    launch, grads = ours(qh, kh, vh, doh, causal, scale, VARIANTS[name])
                    launch()
                    torch.cuda.synchronize()
                    if ref is None:
                        ref = [x.float().clone() for x in grads]
                        diff = 0.0
                    else:
                        diff = max(((x.float() - r).norm() / r.norm()).item() for x, r in zip(grads, ref))
                    ms = bench_ms(launch)
                    res[name] = flops / ms / 1e9
                    print(f"{shape} {mask} {name}: {ms:.3f} ms {res[name]:.1f} TFLOP/s rel-diff {diff:.2e}",
                          flush=True)
                except Exception as e:  # noqa: BLE001 (report and go on)
                    print(f"{shape} {mask} {name}: failed: {type(e).__name__}: {e}", flush=True)
            if not args.no_fa4:
                ms = bench_ms(fa4(q, k, v, do, causal, scale))
                res["fa4"] = flops / ms / 1e9
                print(f"{shape} {mask} fa4: {ms:.3f} ms {res['fa4']:.1f} TFLOP/s", flush=True)
            rows.append((shape, mask, res))
    names = ["default"] + [n for n in args.variants if n != "default"] + ([] if args.no_fa4 else ["fa4"])
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n== backward kernels bf16 (TFLOP/s), {torch.cuda.get_device_name()}, {stamp} ==")
    print("| shape | mask | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for shape, mask, res in rows:
        print(f"| {shape} | {mask} | " + " | ".join(f"{res[n]:.1f}" if n in res else "-" for n in names) + " |")


if __name__ == "__main__":
    main()
