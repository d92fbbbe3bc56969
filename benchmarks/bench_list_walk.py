"""What walking block lists costs against the dense walk, same tiles (issue 24: documents
ran 0.95x flex FLASH at B2 S8192 while our dense kernel leads FA4).

Every row below does the same work: 2048 q tiles of 128 rows, 16 kv blocks each, H16 D128
bf16 (B2 S8192 in 4 documents of 2048 tokens is B8 S2048 dense, tile for tile). Kernels
launched directly (ForwardRunner) in bursts of ten, median ms over rounds that visit every
kernel in turn (do_bench, L2 flushed per burst), TFLOP/s of the
attended pairs:

  dense              B8 S2048, the dense walk (no lists)
  lists:full         B8 S2048, every block listed as full (the list walk, no mask)
  lists:doc          B2 S8192, 4 documents' lists (all full: no mask is evaluated)
  band:full          B8 S2048, the band walk (blocks by arithmetic, partial then full, as
                     the lists) of a band wider than the sequence: every block full
each with persistent CTAs, alone (x1) and in clusters of two sharing K/V loads (x2; not
bands). Layouts: bhsd (contiguous heads) and bshd ([B, S, H, D] storage, as bench_fwd).

    python3 benchmarks/bench_list_walk.py
"""

import math
import statistics

import torch

from common import bench_ms


ROUNDS = 7
# Launches per timed call: this runner's host time per launch (tens of µs, more with the
# lists' and a cluster's arguments) must not show as GPU idle between do_bench's L2 flush
# and the kernel, so each timed call queues a burst (L2 flushed once per burst).
BURST = 10


def main():
    from flexattn import mods
    from flexattn.kernels.emit.mod_emit import IRModHook, runtime_args
    from flexattn.kernels.fwd.sm90 import FwdConfig
    from flexattn.kernels.launch.forward import ForwardRunner
    from flexattn.mods.structure import canonical_band

    sms = torch.cuda.get_device_properties().multi_processor_count
    H, D = 16, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []

    cases = [(name, B, S, layout) for layout in ("bhsd", "bshd")
             for name, B, S in (("dense", 8, 2048), ("lists:full", 8, 2048), ("lists:doc", 2, 8192), ("band:full", 8, 2048))]
    for name, B, S, layout in cases:
        if layout == "bhsd":
            q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        else:
            q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
                       for _ in range(3))
        nq = S // 128
        lists, args, extra = None, (), {}
        if name == "band:full":
            extra = dict(band=True, mods=IRModHook(None, canonical_band(mods.sliding_window(S, S))))
            args = runtime_args(extra["mods"], torch.as_tensor)
        elif name != "dense":
            per_doc = nq if name == "lists:full" else nq // 4
            rows_ = torch.arange(nq, device="cuda")
            first = rows_ // per_doc * per_doc
            idx = (first[:, None] + torch.arange(nq, device="cuda")[None, :]).clamp(max=nq - 1).int()
            full_num = torch.full((1, 1, nq), per_doc, device="cuda", dtype=torch.int32)
            zero = torch.zeros((1, 1, nq), device="cuda", dtype=torch.int32)
            lists = (zero, torch.zeros(1, 1, nq, nq, device="cuda", dtype=torch.int32), full_num, idx[None, None])
        work = 4.0 * B * H * S * (S // 4 if name == "lists:doc" else S) * D
        outs = {}
        for cluster in (1,) if name.startswith("band") else (1, 2):
            cfg = FwdConfig(dtype="bf16", head_dim=D, tile_m=128, block_sparse=lists is not None,
                            max_ctas=(sms if cluster == 1 else 120), cluster_m=cluster, **extra)
            runner = ForwardRunner(cfg)
            o = torch.empty_like(q)
            lse = torch.empty(q.shape[:3], device="cuda")
            fn = runner.bind(q, k, v, o, lse, 1 / math.sqrt(D), args, torch.cuda.current_stream().cuda_stream, lists)
            fn()
            torch.cuda.synchronize()
            outs[cluster] = o.clone()
            rows.append((f"{layout} {name} x{cluster}", fn, work, []))
        assert len(outs) == 1 or torch.equal(outs[1], outs[2]), name
    # Rounds over every kernel, so clock drift (the GPU warming up) spreads over all alike.
    for _ in range(ROUNDS):
        for _, fn, _, times in rows:
            times.append(bench_ms(lambda fn=fn: [fn() for _ in range(BURST)], warmup_ms=25, rep_ms=150) / BURST)
    print(f"| walk | ms (median of {ROUNDS} rounds) | TFLOP/s | rounds min..max ms |\n|---|---|---|---|")
    for label, _, work, times in rows:
        ms = statistics.median(times)
        print(f"| {label} | {ms:.4f} | {work / ms / 1e9:.1f} | {min(times):.4f}..{max(times):.4f} |")


if __name__ == "__main__":
    main()
