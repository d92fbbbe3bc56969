"""What the CPU and GPU tests of context parallelism share: one rank's forward and backward
through a schedule by name, and ranks as spawned processes."""

import socket

from flexattn.core import context_parallel as cp


def run_schedule(schedule, plan, comm, ops, q, k, v, d_out, wanted):
    """(out, lse, (dq, dk, dv, capture grads)) of this rank's shards under ``schedule``
    ("ring", "direct" or "all_gather")."""
    if schedule == "ring":
        out, lse = cp.ring_forward(plan, comm, ops, q, k, v)
        return out, lse, cp.ring_backward(plan, comm, ops, q, k, v, out, lse, d_out, None, wanted)
    if schedule == "direct":
        out, lse, fetched = cp.direct_forward(plan, comm, ops, q, k, v)
        return out, lse, cp.direct_backward(plan, comm, ops, q, k, v, out, lse, d_out, None, wanted, fetched)
    out, lse, gathered = cp.gathered_forward(plan, comm, ops, q, k, v)
    return out, lse, cp.gathered_backward(plan, comm, ops, q, k, v, out, lse, d_out, None, wanted, gathered)


def run_ranks(worker, world: int, args: tuple, timeout: float) -> dict:
    """``worker(rank, world, port, *args, results)`` in ``world`` spawned processes (one
    free localhost port for their process group); each puts ``(rank, result)`` on
    ``results``. Returns {rank: result} once every process has exited cleanly."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, *args, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got
