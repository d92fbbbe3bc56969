"""One rank's forward and backward through a context-parallel schedule by name (the CPU and
GPU tests of flexattn.core.context_parallel share it)."""

from flexattn.core import context_parallel as cp


def run_schedule(schedule, plan, comm, ops, q, k, v, d_out, wanted):
    """(out, lse, (dq, dk, dv, capture grads)) of this rank's shards under ``schedule``
    ("ring", "direct" or "all_gather")."""
    if schedule == "ring":
        out, lse = cp.ring_forward(plan, comm, ops, q, k, v)
        return out, lse, cp.ring_backward(plan, comm, ops, q, k, v, out, lse, d_out, None, wanted)
    if schedule == "direct":
        out, lse = cp.direct_forward(plan, comm, ops, q, k, v)
        return out, lse, cp.direct_backward(plan, comm, ops, q, k, v, out, lse, d_out, None, wanted)
    out, lse, gathered = cp.gathered_forward(plan, comm, ops, q, k, v)
    return out, lse, cp.gathered_backward(plan, comm, ops, q, k, v, out, lse, d_out, None, wanted, gathered)
