"""Causal forward at head dims beyond 64 / 128 and value head dims apart from the query's
(issue 25, item 1), beside FlashAttention-4, torch flex_attention (Triton, and its FLASH
backend: ``kernel_options={"BACKEND": "FLASH"}``) and cuDNN SDPA (``is_causal``), one
process.

The headline is the user's door: ``flexattn.torch.flex_attention`` with a torch-style causal
function through ``create_block_mask`` (the kernel's causal structure, read from the mask's
IR). TFLOP/s count 2·B·H·S²·(D + Dv) × the causal density (the two GEMMs' FLOPs), bf16,
median of triton's do_bench with L2 flushed. A library may lack a head dim: then "—".

    python3 benchmarks/bench_head_dims.py [--shape 4x4096x16] [--dims 64/64 96/96 192/128 256/256]
        [--backward] [--out results.json]

``--backward``: forward + backward steps (``torch.autograd.grad`` of q, k, v; TFLOP/s at
3.5x the forward's FLOPs), for the head dims each library differentiates.
"""

import argparse
import datetime
import math
import traceback

import torch

from bench_bwd import BWD_FLOPS, fwd_bwd
from bench_fwd import setup_dynamo
from common import bench_ms, device_name, rel_diff, report, tflops_ratio


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4x4096x16", help="BxSxH")
    ap.add_argument("--dims", nargs="*", default=["32/32", "64/64", "80/80", "96/96", "128/128", "192/128",
                                                   "192/192", "256/128", "256/256"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--backward", action="store_true", help="forward + backward steps")
    args = ap.parse_args()
    train = args.backward
    setup_dynamo()
    import flexattn.torch as fa
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, S, H = map(int, args.shape.split("x"))
    flex = torch.compile(flex_attention, dynamic=False)
    door_bm = fa.create_block_mask(causal, None, None, S, S, device="cuda")
    torch_bm = create_block_mask(causal, None, None, S, S, device="cuda")
    density = door_bm.density()
    rows = []
    for dims in args.dims:
        D, Dv = map(int, dims.split("/"))
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(train)
                for _ in range(2))
        v = torch.randn(B, S, H, Dv, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(train)
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        scale = 1.0 / math.sqrt(D)
        work = 2.0 * B * H * S * S * (D + Dv) * density * (BWD_FLOPS if train else 1.0)
        impls = {"flexattn": lambda: fa.flex_attention(qh, kh, vh, block_mask=door_bm, scale=scale)}

        def fa4():
            from flash_attn.cute import flash_attn_func

            return flash_attn_func(q, k, v, softmax_scale=scale, causal=True)

        impls["fa4"] = fa4
        impls["flex"] = lambda: flex(qh, kh, vh, block_mask=torch_bm, scale=scale)
        impls["flex-fa"] = lambda: flex(qh, kh, vh, block_mask=torch_bm, scale=scale,
                                        kernel_options={"BACKEND": "FLASH"})

        def cudnn():
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, scale=scale, is_causal=True)

        impls["cudnn"] = cudnn
        if train:   # one step each: the gradients of q, k, v (FA4 returns [B, S, H, Dv])
            grad = torch.randn(B, H, S, Dv, device="cuda", dtype=torch.bfloat16, generator=g)
            impls = {name: fwd_bwd(fn, (q, k, v), grad.transpose(1, 2) if name == "fa4" else grad)
                     for name, fn in impls.items()}
        try:
            ref = impls["flexattn"]()
        except Exception as e:   # a head dim our backward refuses: the others still run
            print(f"[flexattn {D}/{Dv}] failed: {type(e).__name__}: {str(e)[:160]}")
            ref = None
        torch.cuda.synchronize()
        row = {"dims": f"{D}/{Dv}", "tflops": {}, "rel_diff_vs_ours": {}}
        for name, fn in impls.items():
            try:
                out = fn()
                torch.cuda.synchronize()
                if name != "flexattn" and ref is not None:
                    row["rel_diff_vs_ours"][name] = (max(rel_diff(a, b) for a, b in zip(out, ref)) if train
                                                     else rel_diff(out, ref))
                row["tflops"][name] = work / bench_ms(fn) / 1e9
            except Exception as e:   # a library without this head dim must not hide the others
                print(f"[{name} {D}/{Dv}] failed: {type(e).__name__}: {str(e)[:160]}")
                traceback.print_exc(limit=1)
        rows.append(row)
        print(f"D{D}/{Dv} " + "  ".join(f"{i}={t:.1f}" for i, t in row["tflops"].items())
              + f"  diffs {row['rel_diff_vs_ours']}", flush=True)

    others = ("fa4", "flex", "flex-fa", "cudnn")

    def cell(row, impl):
        t = row["tflops"].get(impl)
        return "—" if t is None else f"{t:.1f}"

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    what = "Causal forward + backward" if train else "Causal forward"
    md = (f"{what}, bf16, B{B} S{S} H{H}, {device_name()}, {stamp}. TFLOP/s.\n\n"
          "| D/Dv | flexattn | fa4 | flex | flex-fa | cudnn | ours/fa4 | ours/flex | ours/flex-fa | ours/cudnn |\n"
          "|---|---|---|---|---|---|---|---|---|---|\n"
          + "\n".join(f"| {r['dims']} | " + " | ".join(cell(r, i) for i in ("flexattn", *others))
                      + " | " + " | ".join(tflops_ratio(r, i) for i in others) + " |" for r in rows))
    report(md, rows, args.out, stamp)


if __name__ == "__main__":
    main()
