"""Sustained load: per-call time, SM clock and power while ours and FA4 each run for a few
seconds (dense forward, B4 S4096 H16 D128 bf16; batches of 50 back-to-back calls timed
with CUDA events, clock and power read after each batch). Shows whether a ratio measured
by bench_fwd.py depends on how long the GPU has been under load: the H100 reaches its
700 W limit within seconds and lowers its clock, for every library.

    python3 benchmarks/sustained_clocks.py [--seconds 3]
"""
import argparse
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    import flexattn.torch as fa
    from flash_attn.cute import flash_attn_func

    B, S, H, D = 4, 4096, 16, 128
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    impls = {"ours": lambda: fa.flex_attention(qh, kh, vh), "fa4": lambda: flash_attn_func(q, k, v)}
    for f in impls.values():
        f()
    torch.cuda.synchronize()
    for name in ("ours", "fa4", "ours", "fa4"):
        f, samples, t0 = impls[name], [], time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(50):
                f()
            e1.record()
            e1.synchronize()
            samples.append((e0.elapsed_time(e1) / 50, torch.cuda.clock_rate(), torch.cuda.power_draw() / 1000))
        (t_a, c_a, p_a), (t_b, c_b, p_b) = samples[0], samples[-1]
        print(f"{name}: first batch {t_a:.4f} ms @ {c_a} MHz {p_a:.0f} W -> last {t_b:.4f} ms @ {c_b} MHz"
              f" {p_b:.0f} W ({len(samples)} batches)", flush=True)
        time.sleep(2.0)   # let the GPU cool a little between libraries


if __name__ == "__main__":
    main()
