"""Context parallelism's bookkeeping on one GPU (issue 26), for when no multi-GPU machine
is lent: every rank of a ``--world``-rank schedule runs as a thread of one process
(``LoopbackWorld``: messages handed over, no transfers) on the direct schedule, the same
problem as ``bench_context_parallel.py`` (B1 H16 D128 bf16, ``--per-gpu`` tokens per rank,
its 16 random documents). One forward and one forward + backward are profiled; their GPU
time summed over the ranks, by kind: the attention kernels (the same work whatever the
bookkeeping), the merges, and torch's elementwise / copy / fill kernels (the schedules'
sums, casts and staging). An A/B of a schedule change then reads the last columns; the
overlap of transfers with compute needs the multi-GPU benchmark.

    python3 benchmarks/bench_cp_bookkeeping.py [--world 2] [--per-gpu 65536] [--masks documents16 causal]
"""

import argparse
import datetime
import os
import sys
import threading

import torch

from flexattn.torch.context_parallel import TorchOps

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_context_parallel import B, D, H, _documents  # noqa: E402


def _kind(name: str) -> str:
    n = name.lower()
    if "merge" in n:
        return "merge"
    if "flexattn" in n or "flash" in n:
        return "attention"
    return "torch elementwise"


def _profiled(step):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    sums, counts = {}, {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start:
            k = _kind(e.name)
            sums[k] = sums.get(k, 0.0) + (e.time_range.end - e.time_range.start) / 1e3
            counts[k] = counts.get(k, 0) + 1
    return sums, counts


class _OneLaunchAtATime(TorchOps):
    """TorchOps whose kernels launch from one rank-thread at a time (as the GPU tests'
    ``_SerialKernels``): messages between the ranks still interleave freely."""

    lock = threading.Lock()

    def attention(self, *args):
        with self.lock:
            return super().attention(*args)

    def attention_backward(self, *args):
        with self.lock:
            return super().attention_backward(*args)


def rank_step(comm, spec, layout, shards, train: bool, ops) -> None:
    """One rank's direct-schedule forward (and backward) on its shards (q, k, v, d_out),
    called as the door's autograd function calls it — not through autograd itself: torch
    runs every backward on one GPU from a single worker thread, where ranks as threads
    would wait on each other forever."""
    from flexattn.core import context_parallel as cp
    from flexattn.torch import context_parallel as tcp

    q, k, v, d_out = shards
    plan = tcp._plan(spec, layout, comm.rank, q)
    with torch.no_grad():
        out, lse, fetched = cp.direct_forward(plan, comm, ops, q, k, v)
        if train:
            cp.direct_backward(plan, comm, ops, q, k, v, out, lse, d_out, None, (), fetched)


def main():
    from flexattn.core import AttentionSpec
    from flexattn.core.context_parallel import LoopbackWorld
    from flexattn.torch import context_parallel as tcp

    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--per-gpu", type=int, default=65536)
    ap.add_argument("--masks", nargs="*", default=["documents16", "causal"])
    ap.add_argument("--tag", default="", help="a label for this tree (A/B runs)")
    args = ap.parse_args()
    world, seq = args.world, args.per_gpu * args.world
    lengths = _documents(seq)
    doc = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.as_tensor(lengths)).cuda()

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def documents(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, d_out = (torch.randn(B, H, seq, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC  {torch.cuda.get_device_name()}  "
          f"W {world} as threads on one GPU, {args.per_gpu} tokens per rank, B{B} H{H} D{D} bf16  {args.tag}")
    print("| tree | mask | phase | attention ms | merges ms (n) | torch elementwise ms (n) |")
    print("|---|---|---|---|---|---|")
    ops = _OneLaunchAtATime()
    for name, mask in (("documents16", documents), ("causal", causal)):
        if name not in args.masks:
            continue
        layout = tcp.shard_layout(seq, world, mask=mask)
        spec = AttentionSpec.from_args(mask=mask)
        shards = [[tcp.shard(x, layout, rank=r) for x in (q, k, v, d_out)] for r in range(world)]

        def step(train):
            LoopbackWorld(world).run(lambda comm: rank_step(comm, spec, layout, shards[comm.rank], train, ops))

        for phase, train in (("fwd", False), ("fwd+bwd", True)):
            for _ in range(2):
                step(train)
            sums, counts = _profiled(lambda: step(train))
            print(f"| {args.tag} | {name} | {phase} | {sums.get('attention', 0):.2f} | "
                  f"{sums.get('merge', 0):.2f} ({counts.get('merge', 0)}) | "
                  f"{sums.get('torch elementwise', 0):.2f} ({counts.get('torch elementwise', 0)}) |", flush=True)


if __name__ == "__main__":
    main()
