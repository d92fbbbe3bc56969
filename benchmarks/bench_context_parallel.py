"""Context parallelism across GPUs (issue 26): weak scaling and torch's context parallelism,
side by side in one run on one mesh.

For each world size W (one process per GPU, NCCL) the sequence is ``--per-gpu`` tokens per
GPU (S = W x per-gpu), B1 H16 D128 bf16, under a causal mask and a 16-document causal mask
(packed documents of random lengths). Rows: ours through ``flexattn.torch.context_parallel``
(the ring, direct and all-gather schedules; "direct aside": the direct one with its sends' copies on
the side stream, FLEXATTN_CP_STAGE_ASIDE=1, an A/B; "direct unprepared": every pair's forward and
backward launch through the full door path, FLEXATTN_CP_PREPARED=0, an A/B), torch's ``context_parallel`` with SDPA (causal; its
ring, "alltoall" rotation) and torch's context-parallel flex_attention (compiled, its
``_ContextParallel`` FLEX style with head-tail load balancing) where this torch has them.
Times: the slowest rank's median of ``--iters`` CUDA-event timings (forward; forward +
backward); each rank's median is printed too, with (``--trace``) its profiled step's GPU span,
kernel, NCCL and idle time: which rank sets the step's time, and why. TFLOP/s per GPU count the attended pairs exactly: 4·B·H·pairs·D (forward),
x3.5 forward + backward, divided by W. W = 1 is one GPU's single call (the weak-scaling
reference).

    python3 benchmarks/bench_context_parallel.py --worlds 1 2 4 [--per-gpu 65536] [--iters 5] [--kv-heads 2]
        [--masks causal] [--impls ring direct] [--trace DIR]
    (DIR: one profiled step per row: NCCL's time and overlap, idle time, the costliest kernels)
"""

import argparse
import datetime
import json
import os
import re
import socket
import sys
import traceback

import numpy as np
import torch

B, H, D = 1, 16, 128


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _documents(seq, count=16, seed=0):
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, seq // 128), count - 1, replace=False)) * 128
    lengths = np.diff(np.concatenate([[0], cuts, [seq]]))
    return lengths


def _pairs(mask, seq, lengths):
    if mask == "causal":
        return seq * (seq + 1) / 2
    return float(sum(n * (n + 1) / 2 for n in lengths))


def _time(fn, iters, dist, budget_ms=200.0):
    """(the slowest rank's median ms, every rank's median ms in rank order). At least
    ``iters`` timed calls, more for short steps (about ``budget_ms`` of them, at most 50;
    every rank runs the slowest rank's count): a one-GPU reference of 3-11 ms read 596-661
    TFLOP/s across one session's runs at 3 calls (4x H200, 2026-11-28)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    guess = torch.tensor([start.elapsed_time(end)], device="cuda")
    dist.all_reduce(guess, op=dist.ReduceOp.MAX)
    iters = max(iters, min(50, int(budget_ms / max(guess.item(), 1e-3))))
    times = []
    for _ in range(iters):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    mine = torch.tensor([float(np.median(times))], device="cuda")
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    per_rank = [t.item() for t in every]
    return max(per_rank), per_rank


def _worker(rank, world, port, args, queue):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if args.fuse_above is not None:     # an A/B of the plan's fused steps (plan.FUSE_ABOVE)
        from flexattn.core.context_parallel import plan as cp_plan
        cp_plan.FUSE_ABOVE = args.fuse_above
    rows = []
    try:
        seq = args.per_gpu * world
        lengths = _documents(seq)
        doc = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32),
                                      torch.as_tensor(lengths)).cuda()

        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        def documents(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        g = torch.Generator(device="cuda").manual_seed(0)
        q, d_out = (torch.randn(B, H, seq, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        k, v = (torch.randn(B, args.kv_heads, seq, D, device="cuda", dtype=torch.bfloat16, generator=g)
                for _ in range(2))
        for mask_name, mask in (("causal", causal), ("documents16", documents)):
            if args.masks and mask_name not in args.masks:
                continue
            flops = 4 * B * H * _pairs(mask_name, seq, lengths) * D
            for impl, run in _implementations(mask_name, mask, q, k, v, d_out, world, rank, dist, args):
                if args.impls and world > 1 and not any(word in impl for word in args.impls):
                    continue
                if isinstance(run, Exception):
                    rows.append(dict(world=world, seq=seq, mask=mask_name, impl=impl, phase="setup", ms=None,
                                     error=f"{type(run).__name__}: {str(run)[:160]}"))
                    continue
                for phase, train in (("fwd", False), ("fwd+bwd", True)):
                    try:
                        ms, rank_ms = _time(lambda: run(train), args.iters, dist)
                        per_gpu = flops * (3.5 if train else 1.0) / world / (ms * 1e-3) / 1e12
                        rows.append(dict(world=world, seq=seq, mask=mask_name, impl=impl, phase=phase, ms=ms,
                                         tflops_per_gpu=per_gpu, rank_ms=rank_ms,
                                         peak_gib=torch.cuda.max_memory_allocated() / 2**30))
                        if args.host_profile and impl.startswith("flexattn"):
                            _host_profile(lambda: run(train), args.host_profile, rank,
                                          _trace_name(mask_name, impl, phase, world, rank))
                        if args.trace:
                            mine = _overlap(lambda: run(train), args.trace if rank in args.trace_ranks
                                            else None, _trace_name(mask_name, impl, phase, world, rank))
                            rows[-1].update(mine)     # (rank 0's figures; every rank's below)
                            every = [None] * world
                            dist.all_gather_object(every, {k: v for k, v in mine.items() if k != "top_kernels"})
                            rows[-1]["ranks"] = every
                    except Exception as e:   # noqa: BLE001 - a baseline this torch lacks: reported as n/a
                        rows.append(dict(world=world, seq=seq, mask=mask_name, impl=impl, phase=phase, ms=None,
                                         error=f"{type(e).__name__}: {str(e)[:160]}"))
                        if rank == 0:
                            traceback.print_exc()
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
    finally:
        if rank == 0:
            queue.put(rows)
        dist.destroy_process_group()


def _host_profile(step, folder, rank, name, calls=20) -> None:
    """cProfile of ``calls`` steps on every rank (each synchronized, as ``_time`` times
    them); rank 0's top entries by internal and by cumulative time into ``folder``: where a
    step's host time before its first launch goes (its ``lead_ms`` in the traces)."""
    from common import cprofile_calls, cprofile_lines

    torch.cuda.synchronize()
    profiler, _ = cprofile_calls(step, calls, between=torch.cuda.synchronize)
    if rank != 0:
        return
    os.makedirs(folder, exist_ok=True)
    text = "\n".join(cprofile_lines(profiler, ("tottime", "cumulative"), 45))
    # one file for every row (the device tool returns at most 8 files)
    with open(os.path.join(folder, "host_profile.txt"), "a") as f:
        f.write(f"\n######## {name}: {calls} steps\n{text}\n")


def _trace_name(mask_name, impl, phase, world, rank) -> str:
    """A trace file's name of letters, digits, '-' and '_' only (the device tool returns no
    file whose name has '+' or parentheses)."""
    name = f"{mask_name}_{impl}_{phase.replace('+', '')}_w{world}_r{rank}".replace(" ", "-")
    return re.sub(r"[^A-Za-z0-9_-]", "", name)


def _overlap(step, folder, name) -> dict:
    """One profiled step: the GPU time NCCL's kernels and the other kernels take, and how
    much of NCCL's ran while another kernel ran (union of intervals, ms); ``lead_ms``: the
    GPU idle from the step's start (a marker kernel queued just before it) to its first
    work, i.e. the host's time before its first launch; the trace goes to
    ``folder`` (chrome format; None: not kept) for a closer look."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    marker = torch.zeros(1, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        marker.zero_()      # the step's start on the GPU's clock: its first kernel's lead is host time
        step()
        torch.cuda.synchronize()
    if folder is not None:
        os.makedirs(folder, exist_ok=True)
        prof.export_chrome_trace(os.path.join(folder, name + ".json"))
    gpu = sorted((e for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start),
                 key=lambda e: e.time_range.start)
    # lead: from the marker's end to the step's first GPU work (the host's time before it)
    lead = (gpu[1].time_range.start - gpu[0].time_range.end) if len(gpu) > 1 else 0.0
    gpu = gpu[1:]
    nccl, other = [], []
    for e in gpu:
        (nccl if "nccl" in e.name.lower() else other).append((e.time_range.start, e.time_range.end))

    def union(spans):
        spans, total = sorted(spans), 0.0
        merged = []
        for a, b in spans:
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        for a, b in merged:
            total += b - a
        return merged, total

    n_spans, n_total = union(nccl)
    o_spans, o_total = union(other)
    both = sum(max(0.0, min(b, d) - max(a, c)) for a, b in n_spans for c, d in o_spans)
    everything = nccl + other
    span = (max(b for _, b in everything) - min(a for a, _ in everything)) if everything else 0.0
    by_name: dict = {}
    for e in gpu:
        n, t = by_name.get(e.name[:48], (0, 0.0))
        by_name[e.name[:48]] = (n + 1, t + (e.time_range.end - e.time_range.start) / 1e3)
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:6]
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in gpu]
    return dict(nccl_ms=n_total / 1e3, kernels_ms=o_total / 1e3, nccl_overlapped_ms=both / 1e3,
                gpu_span_ms=span / 1e3, idle_ms=(span - union(everything)[1]) / 1e3, lead_ms=lead / 1e3,
                top_kernels=[f"{name} x{n}: {t:.2f} ms" for name, (n, t) in top],
                waits=_compute_waits(kernels))


def _compute_waits(kernels, at_least_us: float = 100.0, most: int = 4) -> list:
    """The longest stretches (≥ ``at_least_us``) in which no kernel but NCCL's ran, as
    "at +T ms: L ms, after <kernel>, before <kernel>" (T from the step's first kernel): a
    rank's compute waiting on a transfer, or on its host. ``kernels``: (start µs, end µs,
    name) of every GPU activity. Never raises (a diagnostic)."""
    try:
        compute = sorted((a, b, n) for a, b, n in kernels if "nccl" not in n.lower())
        if not compute:
            return []
        t0 = min(a for a, _, _ in kernels)
        gaps, end, last = [], compute[0][1], compute[0][2]
        for a, b, n in compute[1:]:
            if a - end >= at_least_us:
                gaps.append((a - end, end, last, n))
            if b > end:
                end, last = b, n
        gaps.sort(reverse=True)
        return [f"at +{(start - t0) / 1e3:.1f} ms: {length / 1e3:.2f} ms, after {before[:40]}, before {after[:40]}"
                for length, start, before, after in gaps[:most]]
    except Exception as e:   # noqa: BLE001 - a diagnostic never costs the measurement
        return [f"(waits not computed: {type(e).__name__}: {e})"]


def _implementations(mask_name, mask, q, k, v, d_out, world, rank, dist, args):
    """(name, run(train)) of every implementation of this mask at this world size."""
    import flexattn.torch as fa
    from flexattn.torch import context_parallel as tcp

    seq = q.shape[2]
    gqa = k.shape[1] != q.shape[1]
    if world == 1:   # one GPU's call as a torch user makes it: the block mask built once
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        block_mask = fa.create_block_mask(mask, None, None, seq, seq, device="cuda")

        def one(train):
            if not train:
                with torch.no_grad():
                    return fa.flex_attention(*leaves, block_mask=block_mask, enable_gqa=gqa)
            out = fa.flex_attention(*leaves, block_mask=block_mask, enable_gqa=gqa)
            torch.autograd.grad(out, leaves, d_out)
        yield "flexattn (1 GPU)", one
        return
    layout = tcp.shard_layout(seq, world, mask=mask)
    shards = [tcp.shard(x, layout).detach().requires_grad_(True) for x in (q, k, v)]
    d_local = tcp.shard(d_out, layout)
    for schedule in ("ring", "direct", "all_gather"):
        parallel = tcp.ContextParallel(layout, schedule=schedule)

        def ours(train, parallel=parallel):
            if not train:
                with torch.no_grad():
                    return tcp.flex_attention(*shards, mask=mask, parallel=parallel, enable_gqa=gqa)
            out = tcp.flex_attention(*shards, mask=mask, parallel=parallel, enable_gqa=gqa)
            torch.autograd.grad(out, shards, d_local)
        yield f"flexattn {schedule}", ours
        if schedule == "direct":   # an A/B of the sends' copies beside the launches (TorchOps.aside)
            yield "flexattn direct aside", _with_env("FLEXATTN_CP_STAGE_ASIDE", "1", ours)
            # an A/B of the pairs' prepared launches (torch/context_parallel._pair_forward)
            yield "flexattn direct unprepared", _with_env("FLEXATTN_CP_PREPARED", "0", ours)
    baselines = [("torch cp flex", lambda: _torch_flex(mask, q, k, v, d_out, world))]
    if mask_name == "causal":
        baselines.insert(0, ("torch cp sdpa (ring)", lambda: _torch_sdpa(q, k, v, d_out, world)))
    for name, make in baselines:
        try:
            yield name, make()
        except Exception as e:   # noqa: BLE001 - a baseline this torch cannot set up here: n/a with why
            yield name, e


def _with_env(name, value, run):
    """``run`` with the environment variable ``name`` set to ``value`` during each call."""
    def wrapped(train):
        before = os.environ.get(name)
        os.environ[name] = value
        try:
            return run(train)
        finally:
            if before is None:
                del os.environ[name]
            else:
                os.environ[name] = before
    return wrapped


def _torch_sdpa(q, k, v, d_out, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cuda", (world,))
    set_rotate_method("alltoall")

    def run(train):
        qq, kk, vv = (x.detach().clone() for x in (q, k, v))
        dd = d_out.clone()
        with context_parallel(mesh, buffers=[qq, kk, vv, dd], buffer_seq_dims=[2, 2, 2, 2]):
            # (the buffers are sharded in place, and restored on exit: the leaves are views of them)
            leaves = [x.detach().requires_grad_(train) for x in (qq, kk, vv)]
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
                out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True,
                                                                       enable_gqa=k.shape[1] != q.shape[1])
                if train:
                    torch.autograd.grad(out, leaves, dd)
    return run


def _torch_flex(mask, q, k, v, d_out, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import (_context_parallel_shard, _ContextParallel,
                                                                  _HeadTailLoadBalancer)
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mesh = init_device_mesh("cuda", (world,))
    seq = q.shape[2]
    compiled = torch.compile(flex_attention)

    class Attention(torch.nn.Module):
        def forward(self, q, k, v, block_mask):
            return compiled(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])

    attention = parallelize_module(Attention(), mesh, _ContextParallel(
        seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))
    block_mask = create_block_mask(mask, None, None, seq, seq, device="cuda", _compile=True)
    balancer = _HeadTailLoadBalancer(seq, world, torch.device("cuda"))
    shards = _context_parallel_shard(mesh, [q, k, v, d_out], (2, 2, 2, 2), load_balancer=balancer)
    local_mask = _context_parallel_shard(mesh, [block_mask], (2,), load_balancer=balancer)[0]
    ql, kl, vl, dl = shards

    def run(train):
        qq, kk, vv = (x.detach().requires_grad_(train) for x in (ql, kl, vl))
        out = attention(qq, kk, vv, local_mask)
        if train:
            torch.autograd.grad(out, (qq, kk, vv), dl)
    return run


def _by_rank(rows) -> list:
    """One line per multi-rank row: each rank's median step time and (``--trace``) its
    profiled step's GPU span, kernel, NCCL and idle time — which rank sets the step's
    time, and whether its GPU was busy or waiting."""
    lines = []
    for r in rows:
        if r.get("world", 1) < 2 or r.get("ms") is None or not r.get("rank_ms"):
            continue
        parts = []
        for i, t in enumerate(r["rank_ms"]):
            o = r["ranks"][i] if r.get("ranks") else None
            parts.append(f"r{i} {t:.2f} ms" + (f" (lead {o.get('lead_ms', 0.0):.2f}, span {o['gpu_span_ms']:.1f},"
                                               f" kernels {o['kernels_ms']:.1f}, NCCL"
                                               f" {o['nccl_ms']:.1f} / {o['nccl_overlapped_ms']:.1f} overlapped,"
                                               f" idle {o['idle_ms']:.1f})" if o else ""))
        lines.append(f"W{r['world']} {r['mask']} {r['impl']} {r['phase']} by rank: " + "; ".join(parts))
        for i, o in enumerate(r.get("ranks") or []):
            if o and o.get("waits"):
                lines.append(f"  r{i} compute waits: " + "; ".join(o["waits"]))
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", nargs="*", type=int, default=[1, 2])
    ap.add_argument("--per-gpu", type=int, default=65536)
    ap.add_argument("--kv-heads", type=int, default=H, help="K/V heads (GQA: fewer than the 16 query heads)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--fuse-above", type=int, default=None,
                    help="run a step of more chunk-pair launches than this as one fused launch (plan.FUSE_ABOVE)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--masks", nargs="*", default=None, help="causal documents16 (default both)")
    ap.add_argument("--impls", nargs="*", default=None,
                    help="words an implementation's name must contain (the one-GPU reference always runs)")
    ap.add_argument("--host-profile", default=None,
                    help="folder: cProfile of 20 steps of our implementations (rank 0's, as text, all rows in"
                         " host_profile.txt)")
    ap.add_argument("--trace", default=None, help="folder: profile one step per row (NCCL/kernel overlap)")
    ap.add_argument("--trace-ranks", nargs="*", type=int, default=None,
                    help="keep these ranks' trace files only (default: every rank's; the overlap figures are rank 0's)")
    args = ap.parse_args()
    if args.trace_ranks is None:
        args.trace_ranks = list(range(max(args.worlds)))
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    rows = []
    for world in args.worlds:
        if world > torch.cuda.device_count():
            print(f"world {world}: only {torch.cuda.device_count()} GPUs", flush=True)
            continue
        queue = ctx.Queue()
        port = _port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        got = queue.get(timeout=3000)
        for r in got:
            print(json.dumps(r), flush=True)
        rows += got
        for p in procs:
            p.join()
        print(f"world {world} done", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    base = {(r["mask"], r["phase"]): r["tflops_per_gpu"] for r in rows if r["world"] == 1 and r.get("ms")}
    print(f"\n{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC  {torch.cuda.get_device_name()}  per GPU "
          f"{args.per_gpu} tokens, B{B} H{H} Hkv{args.kv_heads} D{D} bf16"
          + ("" if args.fuse_above is None else f", FUSE_ABOVE {args.fuse_above}"))
    print("| W | S | mask | impl | phase | ms | TFLOP/s per GPU | vs 1 GPU | peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("ms") is None:
            print(f"| {r['world']} | {r['seq']} | {r['mask']} | {r['impl']} | {r['phase']} | n/a ({r['error']}) |")
            continue
        ref = base.get((r["mask"], r["phase"]))
        scale = f"{r['tflops_per_gpu'] / ref:.2f}" if ref else "—"
        overlap = (f" (NCCL {r['nccl_ms']:.1f} ms, {r['nccl_overlapped_ms']:.1f} overlapped; kernels"
                   f" {r['kernels_ms']:.1f}; GPU span {r['gpu_span_ms']:.1f}, idle {r['idle_ms']:.1f})"
                   if "nccl_ms" in r else "")
        print(f"| {r['world']} | {r['seq']} | {r['mask']} | {r['impl']} | {r['phase']} | {r['ms']:.2f} | "
              f"{r['tflops_per_gpu']:.1f} | {scale} | {r['peak_gib']:.1f} |{overlap}")
    for line in _by_rank(rows):
        print(line)
    for r in rows:
        if r.get("top_kernels"):
            print(f"W{r['world']} {r['mask']} {r['impl']} {r['phase']}: " + "; ".join(r["top_kernels"]))


if __name__ == "__main__":
    main()
