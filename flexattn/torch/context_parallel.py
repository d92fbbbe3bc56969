"""Context parallelism over ``torch.distributed``: attention over a sequence sharded across
ranks, any mod, forward and backward (``flexattn.core.context_parallel`` holds the
schedules; this module gives them torch arrays, kernels and a process group).

    import torch.distributed as dist
    from flexattn.torch import context_parallel as cp

    layout = cp.shard_layout(S, dist.get_world_size(), mask=causal_fn)   # same on every rank
    q, k, v = (cp.shard(x, layout) for x in (q_full, k_full, v_full))     # this rank's tokens
    out = cp.flex_attention(q, k, v, score_mod=fn, mask=causal_fn, parallel=cp.ContextParallel(layout))
    out_full = cp.unshard(out, layout)                                     # if wanted whole

Mods and block masks are written over *global* positions, exactly as for one GPU; each
rank's shard pairs see their global positions. NCCL on GPUs (K/V travel on NCCL's stream
while the kernels run on the current one), gloo on CPU (the exact reference: the schedule
is testable without a GPU). Gradients reach q, k, v and the score mod's captured tensors
(summed over ranks, since every rank holds them).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel.style import ParallelStyle

from .. import reference
from ..bounded import keep_bounded
from ..blockmask.layout import as_block_mask
from ..core.context_parallel import (ContextParallelPlan, LoopbackWorld, ShardLayout, choose_layout, direct_backward,
                                     direct_forward, gathered_backward, gathered_forward, head_tail, imbalance,
                                     mask_weights, ring_backward, ring_forward, transfers)
from ..core.context_parallel.host_ops import merge_rows, written_into
from ..problem.spec import AttentionSpec, lse_dtype
from ..problem.validate import check_inputs
from ..core.kernel_path import backward_unsupported, kernel_unsupported, prepare_forward
from ..problem import bounds
from . import create_block_mask
from .devices import _backward_alloc, _forward_device, _like, _write_target, _written_empty
from .launches import _PreparedBackward, _backward_arrays, _buffer_grads, _grad_mask, _kernel_backward, _kernel_forward
from .ops import _records_grad, _score_tensors

SCHEDULES = ("ring", "direct", "all_gather")


@dataclass(frozen=True)
class ContextParallel:
    """How a call is sharded: the ``layout`` of tokens over ranks (``shard_layout``), the
    process ``group`` (None: the default group; a one-dimensional ``DeviceMesh``; or a
    communicator with the schedules' interface, e.g. a ``LoopbackWorld`` member: ranks as
    threads of one process), and the ``schedule`` — ``"direct"`` (the default: each
    step's K/V straight from its owner, only the chunks of it the mask attends, two steps
    ahead; dK/dV return to their owners one step behind on a second communicator) or
    ``"ring"`` (whole K/V shards passed rank to rank, overlapped with the kernels) or
    ``"all_gather"`` (every rank gathers all K/V first; fewer, larger launches). Memory
    per rank ∝ S / world for ring and direct (direct keeps its fetched K/V for the
    backward only where they are at most one shard: ``schedule.KEEP_FETCHED``). Direct is
    the default by measurement: 4x H100, 2026-11-27 10:25 UTC, one run, 64k tokens per
    GPU, forward + backward per-GPU throughput against one GPU's at 4 GPUs: causal 0.92
    (ring 0.88), documents16 0.70 (ring 0.59); forwards causal 0.95 / 0.95, documents16
    0.76 / 0.65; with 2 K/V heads within 4% of the best schedule in every row."""

    layout: ShardLayout
    group: object = None
    schedule: str = "direct"

    def __post_init__(self):
        if not isinstance(self.layout, ShardLayout):
            raise TypeError(f"layout must be a ShardLayout (from shard_layout), got {type(self.layout).__name__}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")


class ContextParallelStyle(ParallelStyle):
    """torch's parallel-style door: ``parallelize_module(attention, mesh,
    ContextParallelStyle(layout))`` makes every ``flexattn.torch.flex_attention`` call inside
    ``attention``'s forward run context-parallel over ``mesh`` (one-dimensional) with this
    ``layout`` and ``schedule`` — the role torch's ``_ContextParallel`` plays for its own
    flex_attention (torchtitan's inner-attention modules). The module receives this rank's
    shards (``shard``; a head-tail layout orders tokens exactly as torch's
    ``_HeadTailLoadBalancer``) and block masks built for the whole sequence, as torch's
    style does. Eager only (the forward is wrapped in Python)."""

    def __init__(self, layout: ShardLayout, schedule: str = "direct"):
        super().__init__()
        ContextParallel(layout, None, schedule)     # the same checks, before any module is touched
        self.layout, self.schedule = layout, schedule

    def _apply(self, module, device_mesh):
        from .attention import CONTEXT_PARALLEL

        parallel = ContextParallel(self.layout, device_mesh, self.schedule)
        attention = functools.partial(flex_attention, parallel=parallel)
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args, **kwargs):
            token = CONTEXT_PARALLEL.set(attention)
            try:
                return inner(*args, **kwargs)
            finally:
                CONTEXT_PARALLEL.reset(token)

        module.forward = forward
        return module


def shard_layout(seq_len: int, world: int | None = None, mask=None, block_mask=None, batch: int = 1,
                 heads: int = 1) -> ShardLayout:
    """The token layout for a mask (a function ``(b, h, q_idx, kv_idx) -> bool``, a
    ``MaskMod``, or a block mask's own), balanced so every rank attends about as many
    tiles: contiguous where even already, head-tail under causal, else chunks dealt by
    their work. Every rank must compute the same layout (it is deterministic)."""
    world = dist.get_world_size() if world is None else world
    if block_mask is not None:
        mask = as_block_mask(block_mask).mask_mod
    spec = AttentionSpec.from_args(mask=mask) if mask is not None else AttentionSpec()
    return choose_layout(seq_len, world, spec.mask, batch, heads)


def layout_report(layout: ShardLayout, mask, batch: int = 1, heads: int = 1) -> dict:
    """How well ``layout`` suits ``mask`` (a function or ``MaskMod`` over global positions):
    each rank's share of the attended tiles (``work``, summing to 1), ``imbalance`` (the
    busiest rank's work over the mean), and ``remote_chunks`` — the K/V chunks the ranks'
    queries attend on other ranks (what the direct schedule sends) — out of ``chunks`` ×
    (world − 1)."""
    spec = AttentionSpec.from_args(mask=mask)
    n = layout.num_chunks
    weights = mask_weights(spec.mask, batch, heads, layout.seq_len, n)
    work = np.bincount(np.asarray(layout.owners), weights=weights, minlength=layout.world)
    plan = ContextParallelPlan(spec, layout, 0, batch, heads)
    return {"work": work / work.sum(), "imbalance": imbalance(layout, weights),
            "remote_chunks": transfers(layout.owners, plan.verdicts != 0), "chunks": n}


def shard(x: torch.Tensor, layout: ShardLayout, rank: int | None = None, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s tokens of a whole-sequence tensor (its chunks, in local order)."""
    rank = dist.get_rank() if rank is None else rank
    return x.index_select(dim, torch.as_tensor(layout.positions(rank), device=x.device))


def unshard(x: torch.Tensor, layout: ShardLayout, group=None, dim: int = 2) -> torch.Tensor:
    """The whole sequence from every rank's shard (an all-gather, then global order)."""
    parts = [torch.empty_like(x) for _ in range(layout.world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    whole = torch.cat(parts, dim=dim)
    inverse = np.argsort(layout.order())
    return whole.index_select(dim, torch.as_tensor(inverse, device=x.device))


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, *, parallel: ContextParallel, mask=None, score=None):
    """``flexattn.torch.flex_attention`` on this rank's shards ([B, H, S / world, D], tokens
    as ``parallel.layout`` says) of a sequence sharded over ``parallel.group``: returns this
    rank's rows of the whole attention's output (and lse). Mods and ``block_mask`` (built
    for the whole sequence) see global positions."""
    if not isinstance(parallel, ContextParallel):
        raise TypeError(f"parallel must be a ContextParallel, got {type(parallel).__name__}")
    group = parallel.group
    if hasattr(group, "exchange"):     # a communicator of its own (core.context_parallel.LoopbackWorld's members)
        comm = group
    else:
        if hasattr(group, "get_group"):     # a one-dimensional DeviceMesh: its process group
            group = group.get_group()
        comm = _GroupComm(group, dist.get_rank(group), dist.get_world_size(group))
    rank, layout = comm.rank, parallel.layout
    try:
        spec, records = _checked(query, key, value, layout, comm.world,
                                 (score_mod, block_mask, scale, enable_gqa, mask, score))
        error = None
    except (TypeError, ValueError) as e:
        error, records = e, False
    # every rank raises together, none waits forever
    _agree(comm, parallel, (query, key, value), error, _backward_gpu(comm, query, records))
    plan = _plan(spec, layout, rank, query)
    buffers = _score_tensors(spec.score)
    run = _Run(plan, comm, TorchOps(), parallel.schedule,
               wanted=tuple(i for i, c in enumerate(spec.score.captures if spec.score is not None else ())
                            if isinstance(c, torch.Tensor) and c.requires_grad and c.is_floating_point()))
    out, lse = _ContextParallelAttention.apply(query, key, value, run, *buffers)
    return (out, lse) if return_lse else out


def _checked(query, key, value, layout, world, call) -> tuple:
    """This rank's checks of a call: (its spec, whether autograd records it), or a clear
    error."""
    if layout.world != world:
        raise ValueError(f"the layout is for {layout.world} ranks, the group has {world}")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4 or x.shape[2] != layout.local_len:
            raise ValueError(f"{name} must be this rank's shard [B, H, {layout.local_len}, D] of the"
                             f" {layout.seq_len}-token sequence, got shape {tuple(x.shape)}")
    score_mod, block_mask, scale, enable_gqa, mask, score = call
    spec = AttentionSpec.from_args(score_mod, as_block_mask(block_mask), scale, enable_gqa, mask, score)
    return spec, _check_shard(query, key, value, spec, layout)


_AGREED: set = set()   # (process group id, fingerprint, backward GPU) every rank has confirmed
# the same for in-process communicators, by the object: a freed member's id is reused by a
# new world's, whose ranks must all gather again (one rank skipping it left the others
# waiting forever)
_AGREED_IN_PROCESS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_AGREED_LOCK = threading.Lock()     # (its ranks are threads)


def _backward_gpu(comm, query, records: bool) -> int:
    """The GPU index whose autograd worker would run this rank's backward, where ranks are
    threads of this process (an in-process communicator such as ``LoopbackWorld``'s) and
    autograd records; else -1. torch runs every backward function of one GPU on a single
    worker thread: two rank-threads' backwards on one GPU would each wait there for the
    other's messages forever."""
    if isinstance(comm, _GroupComm) or not records or not query.is_cuda:
        return -1
    return query.device.index if query.device.index is not None else torch.cuda.current_device()


def _agree(comm, parallel, tensors, error, backward_gpu: int = -1) -> None:
    """Raise on every rank, before any message, if any rank's checks failed, the ranks
    disagree on the layout, schedule or shard shapes (which would otherwise leave ranks
    waiting for messages that never come), or rank-threads of this process would run
    their backwards on one GPU (``_backward_gpu``: a hang). One small all-gather the first
    time a group sees a call of this kind (a host sync); repeats cost a set lookup."""
    fingerprint = _fingerprint(parallel, tensors, error)
    if isinstance(comm, _GroupComm):
        agreed, key = _AGREED, (id(comm.group), fingerprint, backward_gpu)
    else:
        with _AGREED_LOCK:
            agreed = _AGREED_IN_PROCESS.setdefault(comm, set())
        key = (fingerprint, backward_gpu)
    if error is None and key in agreed:
        return
    device = torch.device("cpu")     # gloo and the loopback take host tensors; NCCL this rank's GPU
    if isinstance(comm, _GroupComm) and dist.get_backend(comm.group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor((*fingerprint, backward_gpu), dtype=torch.int64, device=device)
    gathered = [tuple(t.tolist()) for t in comm.all_gather(mine)]
    every, gpus = [f[:-1] for f in gathered], [f[-1] for f in gathered if f[-1] >= 0]
    failed = [r for r, f in enumerate(every) if f[-1]]
    if error is not None:
        raise error
    if failed:
        raise ValueError(f"context parallelism: rank(s) {failed} refused this call (their errors say why); no rank ran it")
    if len(gpus) != len(set(gpus)):
        raise ValueError("context parallelism: ranks that are threads of one process cannot record a backward on the"
                         " same GPU (torch runs every backward function of a GPU on one worker thread, where the ranks"
                         " would wait for each other's messages forever): run one process per GPU over"
                         " torch.distributed, give each rank-thread its own GPU, or call under torch.no_grad()")
    if any(f != every[0] for f in every):
        described = "; ".join(f"rank {r}: {_describe(f)}" for r, f in enumerate(every))
        raise ValueError("context parallelism: the ranks disagree on the call (every rank must pass the same layout,"
                         f" schedule and shard shapes): {described}")
    agreed.add(key)


def _fingerprint(parallel, tensors, error) -> tuple:
    """The integers every rank's call must share: the layout, the schedule, q/k/v shapes and
    dtype; the last says whether this rank's own checks failed."""
    layout = parallel.layout
    shapes = []
    for x in tensors:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) and x.dim() == 4 else (-1,) * 4
        shapes += [int(n) for n in shape]
    dtype = tensors[0].dtype if isinstance(tensors[0], torch.Tensor) else None
    return (layout.seq_len, layout.world, hash(layout.owners) & (2 ** 62 - 1), SCHEDULES.index(parallel.schedule),
            *shapes, _DTYPE_CODES.get(dtype, -1), int(error is not None))


_DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float64: 3}


def _describe(f) -> str:
    q, k, v = f[4:8], f[8:12], f[12:16]
    return (f"{f[0]} tokens over {f[1]} ranks (layout #{f[2] % 10 ** 6:06d}), schedule {SCHEDULES[f[3]]},"
            f" q {list(q)} k {list(k)} v {list(v)}")


def _check_shard(query, key, value, spec, layout) -> bool:
    """The whole call's checks, before any launch or message: shapes, dtypes, GQA, and on
    CUDA what the kernels support (forward, and backward where autograd records: q, k, v or
    a tensor the score mod captures requires grad). Returns whether autograd records."""
    shape = check_inputs(query, key, value, AttentionSpec(spec.score, None, None, spec.scale, spec.enable_gqa))
    records = _records_grad(query, key, value, *_score_tensors(spec.score))
    if query.is_cuda:
        reason = kernel_unsupported(query, shape) or (backward_unsupported(shape, query) if records else None)
        if reason:
            raise ValueError(f"{reason} (CPU tensors run the exact reference for anything else)")
    return records


_PLANS: dict = {}   # see _plan
_PLANS_CAPACITY = 8


def _plan(spec, layout, rank, query) -> ContextParallelPlan:
    """The call's plan, reused while nothing it was made from changed: the mods' structure,
    the mask's captured values (a tensor by identity and in-place version: its pair block
    masks follow its values), the score's captured tensors by identity (pairs read them at
    run time, so updates in place need no new plan), the block mask object, layout, rank,
    batch, heads and device. A training step's repeated call skips the pair analysis, the
    mods' rewrites and the pairs' block-mask builds (host time that would delay its first
    launch). Bounded: holds at most a few calls' mods and masks alive."""
    def values(mod, versions):
        if mod is None:
            return None
        return (mod.structure_key, tuple(
            (id(c), _version(c) if versions else None) if isinstance(c, torch.Tensor) else
            (id(c),) if isinstance(c, np.ndarray) else c for c in mod.captures))

    key = (values(spec.score, False), values(spec.element_mask, True), id(spec.block_mask), spec.scale,
           spec.enable_gqa, layout, rank, tuple(query.shape[:2]), query.device)
    hit = _PLANS.get(key)
    if hit is not None and hit.spec.block_mask is spec.block_mask:
        return hit
    plan = ContextParallelPlan(spec, layout, rank, query.shape[0], query.shape[1],
                               block_mask_builder=_device_block_masks(query))
    return keep_bounded(_PLANS, key, plan, _PLANS_CAPACITY)   # (holds the call's captures: their ids stay theirs)


def _version(t):
    try:
        return t._version
    except RuntimeError:    # an inference tensor has none: a key that never repeats
        return object()


def _device_block_masks(query):
    """A pair's block mask built on the query's GPU (None on CPU: the reference needs none)."""
    if not query.is_cuda:
        return None

    def build(mask, batch, heads, q_len, kv_len):
        deps = mask.depends_on
        return create_block_mask(mask, batch if "b" in deps else None, heads if "h" in deps else None,
                                 q_len, kv_len, device=query.device)
    return build


class _Run:
    """One call's plan, communicator, operations and schedule (what the autograd function
    carries from forward to backward)."""

    def __init__(self, plan, comm, ops, schedule, wanted):
        self.plan, self.comm, self.ops, self.schedule, self.wanted = plan, comm, ops, schedule, wanted

    def forward(self, q, k, v):
        """(out, lse, kept): ``kept`` what the backward reuses (the direct schedule's
        fetched K/V where it keeps them), else None."""
        if self.schedule == "all_gather":
            out, lse, _ = gathered_forward(self.plan, self.comm, self.ops, q, k, v)
            return out, lse, None
        if self.schedule == "direct":
            return direct_forward(self.plan, self.comm, self.ops, q, k, v)
        return (*ring_forward(self.plan, self.comm, self.ops, q, k, v), None)

    def backward(self, q, k, v, out, lse, d_out, d_lse, kept=None):
        args = (self.plan, self.comm, self.ops, q, k, v, out, lse, d_out, d_lse, self.wanted)
        if self.schedule == "direct":
            return direct_backward(*args, fetched=kept)
        return (gathered_backward if self.schedule == "all_gather" else ring_backward)(*args)


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, run, *buffers):
        q, k, v = (x.detach().contiguous() for x in (query, key, value))
        out, lse, kept = run.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse, *buffers)
        ctx.run, ctx.kept = run, kept     # kept: intermediate K/V (not inputs or outputs), held on ctx
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse, *buffers = ctx.saved_tensors
        run = ctx.run
        # every rank takes part in the backward's messages, also one whose rows got no gradient
        d_out = torch.zeros_like(out) if d_out is None else d_out.contiguous()
        dq, dk, dv, grads = run.backward(q, k, v, out, lse, d_out, None if d_lse is None else d_lse.contiguous(),
                                         ctx.kept)
        ctx.kept = None
        by_slot = dict(zip(run.wanted, grads))
        captures = run.plan.spec.score.captures if run.plan.spec.score is not None else ()
        slots = [i for i, c in enumerate(captures) if isinstance(c, torch.Tensor)]
        d_buffers = [None if i not in by_slot else by_slot[i].to(b.dtype).reshape(b.shape)
                     for i, b in zip(slots, buffers)]
        return (dq, dk, dv, None, *d_buffers)


class TorchOps:
    """The schedules' array operations on torch tensors: the kernels on CUDA (current
    stream), the float64 reference on CPU; merges and sums in float32 (float64 for
    float64 inputs)."""

    @staticmethod
    def writes_into(result) -> bool:
        """Launches write into views of ``result`` (on CUDA, the kernels themselves): their
        outputs come in the inputs' dtype, as the result's."""
        return True

    def attention(self, q, k, v, spec, into=None):
        if q.is_cuda:
            return _pair_forward(spec, q, k, v, into)
        out, lse = reference.forward(q, k, v, spec)
        return written_into(into, (_like(out, q), _like(lse, q, getattr(torch, lse_dtype(q)))))

    def outputs(self, q, v):
        b, h, s = q.shape[:3]
        return (_written_empty(b, h, s, v.shape[-1], dtype=q.dtype, device=q.device),
                _written_empty(b, h, s, dtype=getattr(torch, lse_dtype(q)), device=q.device))

    def attention_backward(self, q, k, v, out, lse, d_out, d_lse, spec, into=None):
        captures = spec.score.captures if spec.score is not None else ()
        if q.is_cuda:
            buffers = _score_tensors(spec.score)
            dq, dk, dv, grads = _pair_backward(spec, q, k, v, out, lse, d_out, d_lse, buffers, into)
            by_id = {id(b): g.float() for b, g in zip(buffers, grads) if b.requires_grad}
            return dq, dk, dv, by_id
        g = reference.backward(q, k, v, d_out, d_lse, spec, out=out, lse=lse)
        by_id = {id(c): _like(d, c, self._work(q)) for c, d in zip(captures, g.d_captures)
                 if d is not None and isinstance(c, torch.Tensor) and c.requires_grad}
        return (*written_into(into, (_like(g.dq, q), _like(g.dk, k), _like(g.dv, v))), by_id)

    @staticmethod
    def _work(x):
        return torch.float64 if x.dtype == torch.float64 else torch.float32

    def rows(self, x, start, stop):
        return x[:, :, start:stop]

    def cat(self, parts):
        return _cat_rows(parts)

    def contiguous(self, x):
        return _contiguous(x)

    def aside(self, like):
        """A context whose work runs on the high-priority side stream that posts the staged
        transfers, after the current stream's work so far, so the sends' copies run beside
        the step's launches instead of before them (their transfers are posted from that
        stream, so they follow the copies). Only with FLEXATTN_CP_STAGE_ASIDE=1, for A/B
        runs: not yet measured. The buffers made there are read only on that stream and by
        NCCL, and released once the current stream has waited for the transfers."""
        if not like.is_cuda or os.environ.get("FLEXATTN_CP_STAGE_ASIDE") != "1":
            return contextlib.nullcontext()
        return _on_side_stream(like.device)

    def stats(self, q, v):
        b, h, s = q.shape[:3]
        acc = torch.zeros(b, h, s, v.shape[-1], dtype=self._work(q), device=q.device)
        lse = torch.full((b, h, s), -torch.inf, dtype=getattr(torch, lse_dtype(q)), device=q.device)
        return acc, lse

    def merge(self, acc, lse, start, stop, out_j, lse_j):
        if acc.device.type == "cpu":
            merge_rows(acc[:, :, start:stop].numpy(), lse[:, :, start:stop].numpy(),
                       out_j.to(acc.dtype).numpy(), lse_j.to(lse.dtype).numpy())
            return acc, lse
        merge = _merge_kernel if _kernel_merges(acc, out_j, lse_j) else _merge_rows
        merge(acc[:, :, start:stop], lse[:, :, start:stop], out_j, lse_j)
        return acc, lse

    def assign(self, acc, lse, start, stop, out_j, lse_j):
        if _kernel_merges(acc, out_j, lse_j):
            # the merge kernel copies the rows lse holds at -inf (all of these) and leaves
            # the rows out_j did not attend as they are (zeros / -inf already)
            _merge_kernel(acc[:, :, start:stop], lse[:, :, start:stop], out_j, lse_j)
            return acc, lse
        acc[:, :, start:stop].copy_(out_j)
        lse[:, :, start:stop].copy_(lse_j)
        return acc, lse

    def merge_into(self, out, lse, start, stop, out_j, lse_j):
        rows, lse_rows = out[:, :, start:stop], lse[:, :, start:stop]
        if _kernel_merges(rows, out_j, lse_j) and lse.dtype == torch.float32:
            _merge_kernel(rows, lse_rows, out_j, lse_j)      # straight into the 16-bit rows
            return
        acc = rows.to(self._work(out))
        self.merge(acc, lse_rows, 0, stop - start, out_j, lse_j)
        rows.copy_(acc)

    def zeros(self, x):
        return torch.zeros(x.shape, dtype=self._work(x), device=x.device)

    def work_empty(self, x):
        return torch.empty(x.shape, dtype=self._work(x), device=x.device)

    def add_rows(self, acc, start, stop, x):
        acc[:, :, start:stop] += x
        return acc

    def add(self, a, b):
        return a.add_(b)

    def empty(self, x):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    def assign_rows(self, out, start, stop, x):
        _copy(out[:, :, start:stop], x)

    def add_rows_into(self, out, start, stop, acc, x):
        rows = out[:, :, start:stop]
        # the second of two contributions onto the first in the result: in place, per head
        other = x if _same_view(acc, rows) else acc if _same_view(x, rows) else None
        if other is not None and _add_per_head_(rows, other):
            return
        # one elementwise kernel: summed in acc's (work) dtype, cast as written
        torch.add(acc, x, out=rows)

    def zero_rows(self, out, start, stop):
        out[:, :, start:stop].zero_()

    def cast(self, x, like):
        return x.to(like.dtype)


# Row slices of [B, H, S, D] (a run of rows in every head) are strided, and torch copies
# strided tensors one element per thread step: viewed as WIDE elements (the same bytes, 4
# bf16 to an int64), they copy in a quarter of the steps. See bench_row_copies.py.
WIDE = torch.int64


_PAIR_LAUNCHES: dict = {}    # see _pair_forward
_PAIR_LAUNCHES_CAPACITY = 256   # entries per table (_PAIR_LAUNCHES, _PAIR_BACKWARDS)


def _full_path_only(q) -> bool:
    """Whether a pair's launch must take the full door path, not a prepared one: the debug
    mode (``bounds``) checks every call; another device than the current; and
    FLEXATTN_CP_PREPARED=0 (for A/B runs in one process)."""
    return (bounds.enabled() or q.device.index != torch.cuda.current_device()
            or os.environ.get("FLEXATTN_CP_PREPARED") == "0")


def _remember(table: dict, key, spec, *value) -> None:
    """``table[key] = (weak reference to spec, *value)``: the entry leaves with its spec
    (the plan's lifetime bounds what a prepared launch holds); the oldest entry gives way
    at capacity."""
    keep_bounded(table, key, (weakref.ref(spec, lambda _, key=key: table.pop(key, None)), *value),
                 _PAIR_LAUNCHES_CAPACITY)


def _pair_forward(spec, q, k, v, into):
    """A chunk pair's forward launch (out, lse). A plan's pairs keep their specs while the
    plan is cached (``_plan``), so a training step repeats each pair's launch: from its
    second call on, the pair launches as the one-GPU door repeats a call
    (``kernel_path.PreparedForward``: no checks, no planning, no list building). On 2x H200
    the full path took ~0.25 ms of host time per launch under cProfile, the step's first
    launch included, while the GPU waited (documents16 W 2's forward, 2026-11-29). Keyed by
    the spec object's id and everything the checks read of the tensors; an entry leaves
    with its spec (a weak reference: the plan's lifetime bounds what the launch holds).
    The debug mode (``bounds``) takes the full path, as the door's repeats do; so does
    every launch with FLEXATTN_CP_PREPARED=0 (for A/B runs in one process)."""
    if into is None or _full_path_only(q):
        return _kernel_forward(spec, check_inputs(q, k, v, spec), q, k, v, into=into)
    key = (id(spec), q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
           q.device.index, into[0].stride(), into[1].stride())
    slot = _PAIR_LAUNCHES.get(key)
    if slot is not None and slot[0]() is spec and slot[2] is not None:
        shape, prepared = slot[1], slot[2]
        out = _write_target("out", into[0], (shape.batch, shape.q_heads, shape.q_len, shape.v_head_dim), q.dtype,
                            q.device)
        lse = _write_target("lse", into[1], (shape.batch, shape.q_heads, shape.q_len), torch.float32, q.device)
        if prepared.launch(q, k, v, out, lse) is not False:
            return out, lse
    shape = check_inputs(q, k, v, spec)
    result = _kernel_forward(spec, shape, q, k, v, into=into)
    if slot is None:
        _remember(_PAIR_LAUNCHES, key, spec, shape, prepare_forward(q, shape, spec, _forward_device(q.device)))
    return result


_PAIR_BACKWARDS: dict = {}   # see _pair_backward


def _pair_backward(spec, q, k, v, out, lse, d_out, d_lse, buffers, into):
    """A chunk pair's backward launch -> (dq, dk, dv, gradient per score buffer), as
    ``_pair_forward`` is its forward's: from a plan's second step on, the pair launches
    through a ``core.backward_path.PreparedBackward`` (no checks, no planning, the block
    lists already on the GPU), held per pair spec, device, shapes and strides, the
    deterministic setting and which buffers take gradients; weakly, as the forward's. The
    debug mode, FLEXATTN_CP_PREPARED=0 and another device than the current take the full
    path (``_kernel_backward``)."""
    grad_mask = _grad_mask(buffers)
    # lse is the merge over every chunk's keys, not this pair's own (merged_lse)
    if _full_path_only(q):
        return _kernel_backward(spec, check_inputs(q, k, v, spec), q, k, v, out, lse, d_out, d_lse, buffers,
                                grad_mask, into, merged_lse=True)
    deterministic = torch.are_deterministic_algorithms_enabled()
    key = (id(spec), q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
           q.device.index, d_lse is None, deterministic, grad_mask,
           tuple(None if t is None else t.stride() for t in (into or (None, None, None))))
    slot = _PAIR_BACKWARDS.get(key)
    if slot is not None and slot[0]() is spec and slot[1] is not None:
        prepared = slot[1]
        arrays = _backward_arrays(q, k, v, out, lse, d_out, d_lse, into)
        capture_grads = prepared.kernels.launch(arrays, _backward_alloc(q.device))
        return arrays.dq, arrays.dk, arrays.dv, _buffer_grads(prepared.tensor_slots, capture_grads, buffers)
    shape = check_inputs(q, k, v, spec)
    result = _kernel_backward(spec, shape, q, k, v, out, lse, d_out, d_lse, buffers, grad_mask, into, merged_lse=True)
    if slot is None:
        _remember(_PAIR_BACKWARDS, key, spec,
                  _PreparedBackward.make(spec, shape, q, deterministic, grad_mask, merged_lse=True))
    return result


def _wide(x):
    """``x`` viewed as ``WIDE`` elements where its layout allows (last dim contiguous, its
    bytes and every other stride and the offset in whole wide elements), else None."""
    ratio = WIDE.itemsize // x.element_size()
    if ratio <= 1 or x.dim() == 0 or x.stride(-1) != 1 or x.shape[-1] % ratio or x.storage_offset() % ratio:
        return None
    if any(s % ratio for s in x.stride()[:-1]):
        return None
    return x.view(WIDE)


def _copy(dst, src) -> None:
    """dst ← src (dst's dtype), through wide views where both take one and dtypes match."""
    if dst.dtype == src.dtype and dst.shape == src.shape:
        wd, ws = _wide(dst), _wide(src)
        if wd is not None and ws is not None:
            wd.copy_(ws)
            return
    dst.copy_(src)


def _contiguous(x):
    """``x.contiguous()``, its copy made through a wide view where one applies."""
    if x.is_contiguous():
        return x
    w = _wide(x)
    return x.contiguous() if w is None else w.contiguous().view(x.dtype)


def _cat_rows(parts):
    """``torch.cat(parts, dim=2)``, through wide views where every part takes one."""
    wides = [_wide(p) for p in parts]
    if len({p.dtype for p in parts}) == 1 and all(w is not None for w in wides):
        return torch.cat(wides, dim=2).view(parts[0].dtype)
    return torch.cat(parts, dim=2)


def _same_view(a, b) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride())


def _heads(x):
    """[B, H, n, D] as B·H contiguous [n, D] views (None where it does not split so)."""
    b, h, n, d = x.shape
    if x.stride(-1) != 1 or (n > 1 and x.stride(-2) != d):
        return None
    try:
        return x.view(b * h, n, d).unbind(0)
    except RuntimeError:     # batch and heads not one stride apart
        return None


def _add_per_head_(rows, other) -> bool:
    """``rows`` += ``other`` (same dtype and shape) as one multi-tensor add over the heads'
    row runs, each contiguous — torch's add of a strided 16-bit view takes its
    non-vectorized path (2.6x a contiguous add's time on an H200; bench_row_copies.py);
    summed in the op-math dtype and rounded once, the same bits. False where it does not
    apply (nothing done)."""
    if other.dtype != rows.dtype or other.shape != rows.shape:
        return False
    mine, theirs = _heads(rows), _heads(other)
    if mine is None or theirs is None:
        return False
    torch._foreach_add_(list(mine), list(theirs))
    return True


def _kernel_merges(acc, out_j, lse_j) -> bool:
    """The merge kernel takes it: a 16-bit partial into an fp32 accumulator or into rows of
    the partial's own dtype, fp32 LSEs, on CUDA."""
    return (acc.is_cuda and out_j.dtype in (torch.bfloat16, torch.float16)
            and acc.dtype in (torch.float32, out_j.dtype) and lse_j.dtype == torch.float32)


def _merge_kernel(acc, lse, out_j, lse_j) -> None:
    """The merge on the GPU in one pass over the attended rows only
    (``kernels.merge.partial``), on the current stream."""
    from ..core.merge import merge_partial_into

    merge_partial_into(acc, lse, out_j, lse_j, torch.cuda.current_stream(acc.device).cuda_stream)


def _merge_rows(acc, lse, out_j, lse_j) -> None:
    """In place on views: the log-sum-exp merge of a partial attention (see
    ``core.context_parallel.host_ops.merge_rows``); rows empty on both sides stay 0/−inf."""
    lse_j = lse_j.to(lse.dtype)
    new = torch.logaddexp(lse, lse_j)
    live = torch.isfinite(new)
    safe = torch.where(live, new, torch.zeros_like(new))
    w0 = torch.where(live, torch.exp(lse - safe), torch.zeros_like(new))
    w1 = torch.where(live, torch.exp(lse_j - safe), torch.zeros_like(new))
    # Two passes over the rows (acc scaled, then out_j * w1 added in the same read), not
    # four: out_j is read in its own dtype, no fp32 copy (4x H100 2026-11-27: 1.9 ms a
    # merge of 64k rows H16 D128 before).
    acc.mul_(w0.unsqueeze(-1).to(acc.dtype)).addcmul_(out_j, w1.unsqueeze(-1).to(acc.dtype))
    lse.copy_(new)


class _Pending:
    __slots__ = ("requests", "received", "sent")

    def __init__(self, requests, received, sent=None):
        # sent: the send buffers, held until the transfers are waited on
        self.requests, self.received, self.sent = requests, received, sent

    def wait(self):
        for r in self.requests:
            r.wait()
        self.sent = None
        return self.received


class _Staged:
    """An exchange whose send buffers (contiguous copies) and receive buffers were made at
    staging — on the current stream, or the sends on the side stream (``TorchOps.aside``);
    ``post`` posts its transfers from that side stream, after the staging only, so the
    host time of posting can follow launches queued in between without the transfers
    waiting for them."""

    def __init__(self, comm, dst, sends, src, received, channel):
        self.comm, self.dst, self.sends, self.src, self.received = comm, dst, sends, src, received
        self.channel = channel
        tensors = (sends or []) + (received or [])
        self.ready = None
        if tensors and tensors[0].is_cuda:
            self.device = tensors[0].device
            self.ready = torch.cuda.Event()
            self.ready.record()

    def post(self):
        ops = self.comm.p2p_ops(self.dst, self.sends, self.src, self.received, self.channel)
        if not ops:
            return _Pending([], self.received)
        if self.ready is None:
            return _Pending(dist.batch_isend_irecv(ops), self.received, self.sends)
        side = _side_stream(self.device)
        side.wait_event(self.ready)
        with torch.cuda.stream(side):
            requests = dist.batch_isend_irecv(ops)
        return _Pending(requests, self.received, self.sends)


def _buffers(dst, arrays, src, like) -> tuple:
    """(send buffers or None, receive buffers or None) of one exchange: the arrays made
    contiguous, fresh arrays like ``like``."""
    sends = [_contiguous(a) for a in arrays] if dst is not None else None
    received = [torch.empty_like(a) for a in like] if src is not None else None
    return sends, received


_SIDE_STREAMS: dict = {}


def _side_stream(device) -> "torch.cuda.Stream":
    """One stream per device from which staged transfers are posted (NCCL orders its
    transfers after the posting stream's work: the staging event, and the sends' copies
    where ``TorchOps.aside`` put them there). High priority: those copies' CTAs take SMs
    as the attention launch's free, not after its last."""
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device, priority=-1)
    return stream


@contextlib.contextmanager
def _on_side_stream(device):
    side, current = _side_stream(device), torch.cuda.current_stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        yield


class _GroupComm:
    """The schedules' communicator over a ``torch.distributed`` group. An exchange's sends
    and receives are posted as one batch on its channel's own communicator
    (``_channel_group``; NCCL: on its high-priority stream, ordered after the current
    stream's work at posting; ``wait`` makes the current stream wait for them)."""

    def __init__(self, group, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world

    def exchange(self, dst, arrays, src, like, channel="kv"):
        sends, received = _buffers(dst, arrays, src, like)
        ops = self.p2p_ops(dst, sends, src, received, channel)
        return _Pending(dist.batch_isend_irecv(ops) if ops else [], received)

    def p2p_ops(self, dst, sends, src, received, channel) -> list:
        """The point-to-point ops of one exchange on its channel's communicator."""
        group = _channel_group(self.group, channel)
        ops = []
        if dst is not None:
            ops += [dist.P2POp(dist.isend, a, _global_rank(self.group, dst), group) for a in sends]
        if src is not None:
            ops += [dist.P2POp(dist.irecv, r, _global_rank(self.group, src), group) for r in received]
        return ops

    def stage(self, dst, arrays, src, like, channel="kv"):
        """``exchange``'s arrays made ready now (``_Staged``), its transfers posted by
        ``.post()``."""
        sends, received = _buffers(dst, arrays, src, like)
        return _Staged(self, dst, sends, src, received, channel)

    def all_gather(self, x) -> list:
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts

    def reduce_scatter(self, parts):
        if dist.get_backend(self.group) == "nccl":
            out = torch.empty_like(parts[self.rank])
            dist.reduce_scatter(out, [p.contiguous() for p in parts], group=self.group)
            return out
        whole = torch.stack([p.contiguous() for p in parts])     # gloo has no reduce-scatter
        dist.all_reduce(whole, group=self.group)
        return whole[self.rank]

    def all_reduce(self, x):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=self.group)
        return x


_CHANNEL_GROUPS: dict = {}


def _channel_group(group, channel: str):
    """The communicator of one message channel over ``group``'s ranks, made once per
    channel (a collective among those ranks only: each makes it at the same exchange).
    Channels apart never match each other's messages (the direct schedule's dK/dV returns
    beside its K/V fetches). Under NCCL its stream runs at high priority: a transfer's
    kernel gets the next free SMs instead of waiting behind every CTA of the attention
    launch queued after it (4x H100, 2026-11-27: the ring's next shift started only as
    the step's launch ended, ~2.5 ms idle per step at W 4)."""
    key = (None if group is None else id(group), channel)
    made = _CHANNEL_GROUPS.get(key)
    if made is None:
        ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
        options = None
        if dist.get_backend(group) == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = True
        made = _CHANNEL_GROUPS[key] = (group, dist.new_group(ranks=ranks, pg_options=options,
                                                             use_local_synchronization=True))
    return made[1]


def _global_rank(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


__all__ = ["ContextParallel", "ContextParallelStyle", "LoopbackWorld", "SCHEDULES", "TorchOps", "flex_attention",
           "head_tail", "layout_report", "shard", "shard_layout", "unshard"]
