"""float32 inputs (issue 25, item 1), causal forward, beside torch flex_attention (Triton,
compiled) and SDPA in one process, under both of torch's float32 matmul precisions:
"highest" (ours: 3xTF32; flex: IEEE float32 products) and "high" (one tf32 pass each).

The headline is the user's door: ``flexattn.torch.flex_attention`` with a torch-style
causal function through ``create_block_mask``. TFLOP/s count 2·B·H·S²·(D + Dv) × the causal
density, median of triton's do_bench. The error column: max |out - float64| over the first
batch and two heads (the float64 reference computed there), the issue's accuracy bar
(ours no worse than flex's under the same setting).

With ``--backward``: forward + backward through autograd (TFLOP/s at 3.5x the forward's
FLOPs); the error column is then the max |grad - float64 grad| over dQ, dK and dV of the
same two heads, relative to the largest reference gradient.

    python3 benchmarks/bench_fp32.py [--shapes 4x4096x16x128 4x4096x16x64] [--backward] [--out results.json]
"""

import argparse
import datetime
import math

import torch

from bench_fwd import setup_dynamo
from common import bench_ms, device_name, report, tflops_ratio


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _error(out, q, k, v, scale):
    qd, kd, vd = (t[:1, :2].double() for t in (q, k, v))
    S = q.shape[2]
    s = (qd @ kd.transpose(-1, -2)) * scale
    s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool, device="cuda").tril(), float("-inf"))
    want = torch.softmax(s, -1) @ vd
    return (out[:1, :2].double() - want).abs().max().item()


def _grad_error(q, k, v, do, scale):
    """max |(dq, dk, dv) - float64| / max |float64 grads| over batch 0, heads 0-1 (q, k, v
    hold the implementation's gradients)."""
    qd, kd, vd = (t[:1, :2].detach().double().requires_grad_() for t in (q, k, v))
    S = q.shape[2]
    s = (qd @ kd.transpose(-1, -2)) * scale
    s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool, device="cuda").tril(), float("-inf"))
    (torch.softmax(s, -1) @ vd).backward(do[:1, :2].double())
    wants = (qd.grad, kd.grad, vd.grad)
    top = max(w.abs().max().item() for w in wants)
    return max((t.grad[:1, :2].double() - w).abs().max().item() for t, w in zip((q, k, v), wants)) / top


def _training(fn, q, k, v, do):
    def step():
        for t in (q, k, v):
            t.grad = None
        fn().backward(do)
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["4x4096x16x128", "4x4096x16x64"], help="BxSxHxD")
    ap.add_argument("--backward", action="store_true", help="forward + backward (autograd)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    setup_dynamo()
    import flexattn.torch as fa
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    rows = []
    before = torch.get_float32_matmul_precision()
    for precision in ("highest", "high"):
        torch.set_float32_matmul_precision(precision)
        torch._dynamo.reset()   # flex's kernels are specialized on the precision
        flex = torch.compile(flex_attention, dynamic=False)
        for spec in args.shapes:
            B, S, H, D = map(int, spec.split("x"))
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(B, H, S, D, device="cuda", generator=g) for _ in range(3))
            door_bm = fa.create_block_mask(causal, None, None, S, S, device="cuda")
            torch_bm = create_block_mask(causal, None, None, S, S, device="cuda")
            scale = 1.0 / math.sqrt(D)
            work = 4.0 * B * H * S * S * D * door_bm.density()
            impls = {
                "flexattn": lambda: fa.flex_attention(q, k, v, block_mask=door_bm),
                "flex": lambda: flex(q, k, v, block_mask=torch_bm),
                "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
            }
            row = {"precision": precision, "shape": f"B{B} S{S} H{H} D{D}", "tflops": {}, "error": {},
                   "phase": "fwd+bwd" if args.backward else "fwd"}
            do = torch.randn(B, H, S, D, device="cuda", generator=g) if args.backward else None
            for t in (q, k, v):
                t.requires_grad_(args.backward)
            for name, fn in impls.items():
                try:
                    if args.backward:
                        step = _training(fn, q, k, v, do)
                        step()
                        row["error"][name] = _grad_error(q, k, v, do, scale)
                        row["tflops"][name] = 3.5 * work / bench_ms(step) / 1e9
                        continue
                    row["error"][name] = _error(fn(), q, k, v, scale)
                    row["tflops"][name] = work / bench_ms(fn) / 1e9
                except Exception as e:   # one library failing must not hide the others
                    print(f"[{name} {precision} {spec}] failed: {type(e).__name__}: {str(e)[:200]}")
            rows.append(row)
            print(row, flush=True)
    torch.set_float32_matmul_precision(before)

    def cell(row, impl):
        t, e = row["tflops"].get(impl), row["error"].get(impl)
        return "—" if t is None else f"{t:.1f} ({e:.1e})"

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    what = "forward + backward" if args.backward else "forward"
    error = "max grad error vs float64, relative to the largest gradient" if args.backward else "max error vs float64"
    md = (f"Causal {what}, float32, {device_name()}, {stamp}. TFLOP/s ({error}).\n\n"
          "| precision | shape | flexattn | flex | sdpa | ours/flex |\n|---|---|---|---|---|---|\n"
          + "\n".join(f"| {r['precision']} | {r['shape']} | {cell(r, 'flexattn')} | {cell(r, 'flex')} | "
                      f"{cell(r, 'sdpa')} | {tflops_ratio(r, 'flex')} |" for r in rows))
    report(md, rows, args.out, stamp)


if __name__ == "__main__":
    main()
