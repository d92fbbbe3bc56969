"""Is the door's training step host-bound? The same fwd+bwd step timed eagerly and
replayed as one CUDA graph (no host work, no launch latency between its kernels).

Ours only, through the public torch API as bench_bwd's headline calls it (torch-style
functions, the block mask from ``create_block_mask(fn, ..., device="cuda")``), on
contiguous [B, H, S, D] inputs. Where the graph replays no faster than the eager step,
the step is GPU-bound and host time is not what separates it from its kernels' sum. Also
prints the host's submit time per step (200 steps queued without a sync).

    python3 benchmarks/step_graph.py [--shape 8x2048x16x128] [--variant document4] [--rounds 3]
"""

import argparse
import math
import time

import torch

from bench_bwd import BWD_FLOPS
from bench_fwd import Variant
from common import bench_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8x2048x16x128", help="BxSxHxD")
    ap.add_argument("--variant", default="document4")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import flexattn.torch as fa

    B, S, H, D = map(int, args.shape.split("x"))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    grad = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    var = Variant(args.variant, B, S, H)
    bm = fa.create_block_mask(var.mask_fn, None, None, S, S, device="cuda") if var.mask_fn else None
    work = BWD_FLOPS * 4.0 * B * H * S * S * D * (bm.density() if bm is not None else 1.0)
    inputs = (q, k, v) + tuple(var.trainable)

    def step():
        out = fa.flex_attention(q, k, v, score_mod=var.score_fn, block_mask=bm, scale=1.0 / math.sqrt(D))
        return torch.autograd.grad(out, inputs, grad)

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    for r in range(args.rounds):
        t = bench_ms(step)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"eager: do_bench {t * 1e3:.1f} µs ({work / t / 1e9:.1f} TFLOP/s); 200 steps queued: host "
              f"{(t1 - t0) / 200 * 1e6:.1f} µs/step, wall {(t2 - t0) / 200 * 1e6:.1f} µs/step", flush=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up off the capture stream, as torch's graph notes ask
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for r in range(args.rounds):
        t = bench_ms(graph.replay)
        print(f"CUDA graph replay: do_bench {t * 1e3:.1f} µs ({work / t / 1e9:.1f} TFLOP/s)", flush=True)
    print(f"({args.variant} {args.shape}, {torch.cuda.get_device_name()})")


if __name__ == "__main__":
    main()
