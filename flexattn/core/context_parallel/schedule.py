"""The context-parallel schedules, written once for every framework.

A rank holds its query shard and its K/V shard. *Ring*: the K/V shards travel around the
ranks (rank r sends to r + 1, receives from r − 1); at each step the rank computes its
pairs against the K/V in hand while the next shard is already on its way, and merges the
partial outputs by their log-sum-exp. *Direct*: the same steps, but at step s rank r
receives from rank r − s straight only the chunks of its K/V that its queries attend (a
window or documents leave most pairs of ranks empty: no message at all, and most chunks
unsent); dK/dV contributions go straight back to their owner as compactly, one step
behind, in the keys' dtype. Where no rank fetches more than a shard's worth
(``KEEP_FETCHED``), the forward keeps what it fetched and the backward sends only the
contributions. *All-gather*: every rank gathers all K/V first (one
collective; cheap when GQA makes K/V small), then runs each query chunk once against the
key range it may attend. The backwards reuse the forward's global ``out`` and ``lse``, so
every pair's gradients are exact parts of the whole's: dQ sums locally; dK/dV travel
around the ring behind the K/V (each rank adds its part and passes the sum on, which
overlaps the next step's compute) or reduce-scatter back to their owners; gradients of
captured tensors sum over pairs, then over ranks.

What a framework supplies (duck-typed, see ``flexattn.torch.context_parallel``):

``ops`` — arrays [B, H, S, D] with the sequence at dim 2:
  ``attention(q, k, v, spec, into) -> (out, lse)`` (``into``: None, or (out, lse) views
  written and returned, where ``writes_into(result)``: the launches' outputs already in that
  array's dtype); ``outputs(q, v) -> (out, lse)`` (uninitialized, the
  results' dtypes); ``attention_backward(q, k, v, out, lse,
  d_out, d_lse, spec, into) -> (dq, dk, dv, {id(capture): fp32 grad})`` (the captures of
  ``spec.score`` that want gradients; ``into``: None, or (dq, dk, dv) arrays, each None or
  a view the gradient is written into and returned as, where ``writes_into``);
  ``rows(x, start, stop)``
  (a view); ``cat(parts)`` (along the sequence); ``stats(q, v) -> (out accumulator, lse)``
  (fp32 zeros, −inf); ``merge(acc, lse, start, stop, out_j, lse_j) -> (acc, lse)``;
  ``assign(acc, lse, start, stop, out_j, lse_j) -> (acc, lse)`` (rows no launch wrote yet);
  ``merge_into(out, lse, start, stop, out_j, lse_j)`` (the result's rows merged with a
  partial in the work dtype, written in out's dtype); ``zeros(x) -> fp32 zeros``;
  ``work_empty(x)`` (fp32, uninitialized); ``add_rows(acc, start, stop, x) -> acc``;
  ``add_rows_into(out, start, stop, acc, x)`` (out's rows ← acc + x, in out's dtype);
  ``add(a, b)``; ``cast(x, like)``; ``empty(x)`` (uninitialized, x's dtype);
  ``assign_rows(out, start, stop, x)`` (copy, cast to out's dtype); ``zero_rows(out, start, stop)``.
``comm`` — ``rank``, ``world``; ``exchange(dst, arrays, src, like, channel) -> pending``
  (send ``arrays`` to ``dst`` and receive arrays like ``like`` from ``src``, either None;
  ``pending.wait() -> arrays`` or None; messages of one ``channel`` between two ranks match
  in the order they were posted, channels apart: "kv" and "grad"); optionally
  ``stage(dst, arrays, src, like, channel) -> staged``, ``staged.post() -> pending``: the
  exchange's arrays made ready on the current stream now, its transfers posted later (they
  then wait for that staging only, not for work queued in between); ``all_gather(x) -> [x of each rank]``;
  ``reduce_scatter(parts) -> sum over ranks of their parts[rank]``; ``all_reduce(x)``.
"""

from __future__ import annotations

import collections
import contextlib
import functools

from ..kernel_path import gpu_shared
from .plan import ContextParallelPlan


def _beside_transfers(schedule):
    """A schedule's launches run while its messages are in flight, NCCL's kernels taking
    SMs at any moment: plan them for a shared GPU (``kernel_path.gpu_shared``)."""
    @functools.wraps(schedule)
    def run(*args, **kwargs):
        with gpu_shared():
            return schedule(*args, **kwargs)
    return run


@_beside_transfers
def ring_forward(plan: ContextParallelPlan, comm, ops, q, k, v):
    """(out, lse) of the local queries against the whole sequence, K/V around the ring."""
    kv = (k, v)
    steps = plan.ring_steps()
    outputs = _RowOutputs(ops, q, v, [pair.q_rows for _, pairs in steps for pair in pairs])
    for s, (_, pairs) in enumerate(steps):
        pending = _shift(comm, kv) if s + 1 < len(steps) else None
        _forward_pairs(ops, pairs, q, *kv, outputs)
        if pending is not None:
            kv = tuple(pending.wait())
    return outputs.result()


@_beside_transfers
def ring_backward(plan: ContextParallelPlan, comm, ops, q, k, v, out, lse, d_out, d_lse, wanted=()):
    """(dq, dk, dv, [fp32 gradient of each ``wanted`` capture of the score mod (indices into
    its captures), summed over every rank]) for the local shards."""
    dq = ops.zeros(q)
    captures: dict = {}
    kv = (k, v)
    passing = None     # the dK/dV sums on their way to this rank from rank − 1
    steps = plan.ring_steps()
    for s, (_, pairs) in enumerate(steps):
        pending = _shift(comm, kv) if s + 1 < len(steps) else None
        kh, vh = kv
        dk, dv = ops.zeros(kh), ops.zeros(vh)
        dq, dk, dv = _backward_pairs(ops, pairs, (q, kh, vh, out, lse, d_out, d_lse), dq, dk, dv, captures)
        if passing is not None:
            before_k, before_v = passing.wait()
            dk, dv = ops.add(dk, before_k), ops.add(dv, before_v)
        passing = _shift(comm, (dk, dv))     # to rank + 1: after the last step, the owner
        if pending is not None:
            kv = tuple(pending.wait())
    dk, dv = passing.wait()
    return (ops.cast(dq, q), ops.cast(dk, k), ops.cast(dv, v), _all_reduced(plan, comm, ops, captures, wanted))


def _shift(comm, arrays):
    """The ring's message: ``arrays`` to rank + 1, the same from rank − 1."""
    world, rank = comm.world, comm.rank
    return comm.exchange((rank + 1) % world, arrays, (rank - 1) % world, arrays, "kv")


@_beside_transfers
def direct_forward(plan: ContextParallelPlan, comm, ops, q, k, v):
    """(out, lse, fetched) of the local queries, each step's K/V straight from its owner,
    only where this rank's queries attend it; the next ``FETCH_AHEAD`` steps' messages are
    on their way while this step computes. ``fetched``: where the plan keeps them
    (``keeps_fetched``: every rank's fetched chunks fit one more shard), the K/V of each
    step for ``direct_backward`` — all posted at once, since they are held anyway — else
    None (the backward fetches again)."""
    keep = keeps_fetched(plan)
    fetched = {} if keep else None
    ahead = plan.layout.world - 1 if keep else FETCH_AHEAD
    outputs = _RowOutputs(ops, q, v, [pair.q_rows for _, pairs in plan.direct_steps() for pair in pairs])
    for s, _, pairs, kv in _fetched_steps(plan, comm, ops, k, v, ahead=ahead):
        if keep and s > 0:
            fetched[s] = kv
        _forward_pairs(ops, pairs, q, *kv, outputs)
    return (*outputs.result(), fetched)


@_beside_transfers
def direct_backward(plan: ContextParallelPlan, comm, ops, q, k, v, out, lse, d_out, d_lse, wanted=(),
                    fetched=None):
    """The direct schedule's backward: on the forward's ``fetched`` K/V where it kept them,
    else K/V fetched again as in the forward. At step s a rank computes its contributions
    to the keys of rank − s it holds and sends them straight back on the "grad" channel,
    while rank + s sends it the contributions to its own keys (each pair of ranks
    exchanges at most one such message per step and direction, as compact as the fetch);
    the exchange runs while the next step computes. Contributions travel in the keys'
    dtype (each rounded once, as the result is; summed in fp32 by the owner): half the
    bytes of fp32 for 16-bit inputs."""
    world, rank, c = comm.world, comm.rank, plan.layout.chunk
    steps_planned = plan.direct_steps()
    # Every contribution's rows are known ahead (the pairs, the returns' chunks): rows
    # that one contribution covers take it as it comes (_RowSums).
    dq = _RowSums(ops, q, [pair.q_rows for _, pairs in steps_planned for pair in pairs])
    returned = [(lo * c, hi * c) for t in range(1, world) for lo, hi in _runs(plan.sent_chunks((rank + t) % world, rank))]
    own_spans = [pair.kv_rows for pair in steps_planned[0][1]] + returned
    own_dk, own_dv = _RowSums(ops, k, own_spans), _RowSums(ops, v, own_spans)
    captures: dict = {}
    # Contributions posted for and not yet added: (pending message, its chunks). Adding one
    # makes the compute stream wait for its message, which waits on the sender's step: where
    # K/V are fetched again, each is added after the next step's launches (one message held);
    # on the forward's kept K/V, all after the last step — this rank's own keys, the largest
    # under documents — so no step waits on another rank's (4x H200, documents16 W 4: rank 2
    # waited 5.2 ms after its third step for the second step's message). Those messages are
    # then held together: dK/dV-sized rows for every chunk of this rank's the others fetched.
    arrivals = []
    steps = (_fetched_steps(plan, comm, ops, k, v, every=True) if fetched is None
             else _kept_steps(plan, k, v, fetched))
    for s, src, pairs, kv in steps:
        outgoing = None
        if kv is not None:
            kh, vh = kv
            if s == 0:
                dk, dv = own_dk, own_dv
            elif _one_launch_over(pairs, kh.shape[2]):
                dk = dv = None     # that launch's dK/dV are the message as they come
            else:
                spans = [pair.kv_rows for pair in pairs]
                dk, dv = _RowSums(ops, kh, spans), _RowSums(ops, vh, spans)
            dq, dk, dv = _backward_pairs(ops, pairs, (q, kh, vh, out, lse, d_out, d_lse), dq, dk, dv, captures)
            if s > 0:
                outgoing = ((dk.result(), dv.result()) if isinstance(dk, _RowSums)
                            else (ops.cast(dk, k), ops.cast(dv, v)))
        if fetched is None:
            for arriving in arrivals:
                _received_into(ops, arriving, own_dk, own_dv, c)
            arrivals = []
        if s > 0:
            dst = (rank + s) % world
            chunks = plan.sent_chunks(dst, rank)     # what dst fetched from this rank: its contributions' rows
            like = tuple(ops.rows(x, 0, len(chunks) * c) for x in (k, v)) if chunks else None
            arrivals.append((comm.exchange(src if outgoing is not None else None, outgoing, dst if chunks else None,
                                           like, "grad"), chunks))
    for arriving in arrivals:
        _received_into(ops, arriving, own_dk, own_dv, c)
    return dq.result(), own_dk.result(), own_dv.result(), _all_reduced(plan, comm, ops, captures, wanted)


def _received_into(ops, arriving, dk, dv, chunk: int):
    """``dk``/``dv`` plus the contributions ``arriving`` brings (if it brings any): a
    pending message of the given chunks of this rank's keys, laid end to end."""
    got = None if arriving is None else arriving[0].wait()
    if got is None:
        return dk, dv
    at = 0
    for lo, hi in _runs(arriving[1]):
        n = (hi - lo) * chunk
        dk = _add_into(ops, dk, lo * chunk, hi * chunk, ops.rows(got[0], at, at + n))
        dv = _add_into(ops, dv, lo * chunk, hi * chunk, ops.rows(got[1], at, at + n))
        at += n
    return dk, dv


def _runs(chunks) -> list:
    """Ascending chunk indices as [(lo, hi)] runs of consecutive ones."""
    runs = []
    for i in chunks:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _chunk_rows(ops, x, chunks, chunk: int, total: int):
    """The rows of these local chunks of ``x`` laid end to end (``x`` itself when they are
    all ``total`` of them)."""
    if len(chunks) == total:
        return x
    parts = [ops.rows(x, lo * chunk, hi * chunk) for lo, hi in _runs(chunks)]
    return parts[0] if len(parts) == 1 else ops.cat(parts)


# Steps whose K/V fetch is in flight at once in the direct schedule: a step of few attended
# pairs (documents on other ranks) computes in less time than its fetch takes, so one fetch
# ahead left the GPU waiting (4x H100, 2026-11-27, documents16 at W 4: 12.5 ms of kernels in
# a 17.5 ms step of the forward). Each step ahead holds one more K/V shard.
FETCH_AHEAD = 2

# The direct forward keeps the K/V it fetched for the backward (which then sends only the
# dK/dV contributions: a third of its messages, half with 16-bit contributions) where no
# rank fetches more than this many shards' worth: documents or windows, whose ranks attend
# a few of the others' chunks; not causal, whose last rank attends every other shard (that
# memory would grow with the whole sequence, as an all-gather's).
KEEP_FETCHED = 1.0


def keeps_fetched(plan) -> bool:
    """Whether the direct schedule's forward keeps its fetched K/V for the backward: every
    rank's fetched chunks fit ``KEEP_FETCHED`` local shards (the same answer on every rank)."""
    return plan.most_fetched() <= KEEP_FETCHED


def _fetched_steps(plan, comm, ops, k, v, every: bool = False, ahead: int = FETCH_AHEAD):
    """(step, source rank, pairs, its K/V) of each step of the direct schedule: step 0 on
    this rank's own K/V, later ones on the chunks of it fetched from their owner that this
    rank attends (``plan.direct_steps``; ``ahead`` steps' fetches in flight while this
    step computes: staged before its launches, posted once the consumer resumes). Steps
    whose keys the mask leaves unattended receive nothing: passed over, or with ``every``
    yielded with K/V None. Consume it to the end: the last posts follow the last step."""
    # Each step's new fetches are staged (their sends' copies queued) before the step's
    # launches and posted after them: posting costs host time (~0.3 ms per exchange on 4x
    # H200), which before the step's launches left the GPU idle (documents16 W 4: the first
    # forward kernel began 2 ms into the step, after three posts).
    staged = [_stage_kv(plan, comm, ops, s, k, v) for s in range(1, 1 + ahead)]
    posted = collections.deque()
    for s, (src, pairs) in enumerate(plan.direct_steps()):
        kv = (k, v)
        if s > 0:
            got = posted.popleft().wait()
            staged.append(_stage_kv(plan, comm, ops, s + ahead, k, v))
            kv = None if got is None else tuple(got)
        if kv is not None or every:
            yield s, src, pairs, kv
        posted.extend(x.post() for x in staged)
        staged = []


def _kept_steps(plan, k, v, fetched: dict):
    """``_fetched_steps(every=True)`` on the K/V the forward kept (``direct_forward``), the
    other ranks' steps first: their dK/dV contributions travel while this rank's own keys
    (the largest step under documents) compute, instead of after the last step. Every rank
    takes the steps in the same order, so the messages still pair up."""
    steps = plan.direct_steps()
    for s in (*range(1, len(steps)), 0):
        src, pairs = steps[s]
        yield s, src, pairs, (k, v) if s == 0 else fetched.get(s)


def _stage_kv(plan, comm, ops, s: int, k, v):
    """Step ``s``'s K/V messages, staged (``.post() -> pending``; past the last step, one
    that posts nothing and whose pending is None): the chunks of this rank's K/V that
    rank + s attends, to it; the chunks of rank − s's this rank attends, from it."""
    world, rank = comm.world, comm.rank
    if s >= world:
        return _Nothing()
    c = plan.layout.chunk
    total = plan.layout.local_len // c
    dst, src = (rank + s) % world, (rank - s) % world
    send, receive = plan.sent_chunks(dst, rank), plan.sent_chunks(rank, src)
    stage = getattr(comm, "stage", None)
    outgoing = None
    if send:
        # A staged exchange posts its transfers from the stream its sends were made on, so
        # their copies may run beside the step's launches (``ops.aside``); a plain exchange
        # hands them over at once, so they are made in line.
        with ops.aside(k) if stage is not None else contextlib.nullcontext():
            outgoing = tuple(ops.contiguous(_chunk_rows(ops, x, send, c, total)) for x in (k, v))
    like = tuple(ops.rows(x, 0, len(receive) * c) for x in (k, v)) if receive else None
    args = (dst if send else None, outgoing, src if receive else None, like, "kv")
    return stage(*args) if stage is not None else _PostLater(comm, args)


class _Nothing:
    """A staged exchange past the last step: posts nothing, and its pending is None."""

    def post(self):
        return None


class _PostLater:
    """A staged exchange for a communicator without ``stage``: posted as a plain exchange."""

    def __init__(self, comm, args):
        self.comm, self.args = comm, args

    def post(self):
        return self.comm.exchange(*self.args)


@_beside_transfers
def gathered_forward(plan: ContextParallelPlan, comm, ops, q, k, v):
    """(out, lse) of the local queries with every rank's K/V gathered first; also returns
    the gathered K/V in global order for the backward."""
    k_all, v_all = _global_order(plan, ops, comm.all_gather(k)), _global_order(plan, ops, comm.all_gather(v))
    pairs = plan.gathered_pairs()
    outputs = _RowOutputs(ops, q, v, [pair.q_rows for pair in pairs])
    _forward_pairs(ops, pairs, q, k_all, v_all, outputs)
    return (*outputs.result(), (k_all, v_all))


@_beside_transfers
def gathered_backward(plan: ContextParallelPlan, comm, ops, q, k, v, out, lse, d_out, d_lse, wanted=(),
                      gathered=None):
    """The all-gather schedule's backward: dK/dV of the whole sequence reduce-scattered to
    their owners."""
    if gathered is None:
        gathered = (_global_order(plan, ops, comm.all_gather(k)), _global_order(plan, ops, comm.all_gather(v)))
    k_all, v_all = gathered
    pairs = plan.gathered_pairs()
    # (each local query chunk runs once: its dQ rows take their one contribution as it
    # comes; dK/dV sum over the ranks in fp32, so they keep the work dtype)
    dq, dk, dv = _RowSums(ops, q, [pair.q_rows for pair in pairs]), ops.zeros(k_all), ops.zeros(v_all)
    captures: dict = {}
    dq, dk, dv = _backward_pairs(ops, pairs, (q, k_all, v_all, out, lse, d_out, d_lse), dq, dk, dv, captures)
    dk = comm.reduce_scatter(_rank_order(plan, ops, dk))
    dv = comm.reduce_scatter(_rank_order(plan, ops, dv))
    return dq.result(), ops.cast(dk, k), ops.cast(dv, v), _all_reduced(plan, comm, ops, captures, wanted)


def _forward_pairs(ops, pairs, q, k, v, outputs):
    """Each pair's launch on the K/V in hand, its output combined into ``outputs`` (a
    ``_RowOutputs``), or written into the rows it lends."""
    for pair in pairs:
        (q0, q1), (k0, k1) = pair.q_rows, pair.kv_rows
        into = outputs.lend(q0, q1)
        out_j, lse_j = ops.attention(ops.rows(q, q0, q1), ops.rows(k, k0, k1), ops.rows(v, k0, k1), pair.spec,
                                     into)
        outputs.add(q0, q1, out_j, lse_j, lent=into is not None)


def _backward_pairs(ops, pairs, arrays, dq, dk, dv, captures):
    """Each pair's backward launch (``arrays``: q, the K/V in hand, out, lse, d_out,
    d_lse), its gradients added into ``dq`` / ``dk`` / ``dv`` and ``captures`` — or, where
    a ``_RowSums`` lends the launch its result's rows (one contribution covers them all),
    written there by the launch itself."""
    q, k, v, out, lse, d_out, d_lse = arrays
    for pair in pairs:
        (q0, q1), (k0, k1) = pair.q_rows, pair.kv_rows
        spans = ((dq, q0, q1), (dk, k0, k1), (dv, k0, k1))
        into = tuple(s.lend(a, b) if isinstance(s, _RowSums) else None for s, a, b in spans)
        dq_j, dk_j, dv_j, cap_j = ops.attention_backward(
            ops.rows(q, q0, q1), ops.rows(k, k0, k1), ops.rows(v, k0, k1), ops.rows(out, q0, q1),
            ops.rows(lse, q0, q1), ops.rows(d_out, q0, q1), None if d_lse is None else ops.rows(d_lse, q0, q1),
            pair.spec, into if any(x is not None for x in into) else None)
        dq = _add_into(ops, dq, q0, q1, dq_j, into[0] is not None)
        if dk is None:      # one launch over every key (``_one_launch_over``): its own dK/dV
            dk, dv = dk_j, dv_j
        else:
            dk = _add_into(ops, dk, k0, k1, dk_j, into[1] is not None)
            dv = _add_into(ops, dv, k0, k1, dv_j, into[2] is not None)
        _add_captures(ops, captures, cap_j)
    return dq, dk, dv


def _add_into(ops, sums, start, stop, x, lent: bool = False):
    """``x`` added into rows start:stop of ``sums`` (an array in the work dtype, or a
    ``_RowSums``; ``lent``: x was written into the rows it lent); returns ``sums``."""
    if isinstance(sums, _RowSums):
        if lent:
            sums.written_in_place(start, stop)
        else:
            sums.add(start, stop, x)
        return sums
    return ops.add_rows(sums, start, stop, x)


class _RowSegments:
    """The local rows cut at the ends of every contribution a result will get (``spans``,
    known ahead: the plan's pairs, the returns' chunks), with how many contributions cover
    each segment; segments one contribution covers are ``taken`` once it came, the others
    count their arrivals (``arrive``).

    Segments of exactly two contributions are combined without a work-dtype buffer: one
    contribution sits in the result — lent to its launch (``anchor``: the longest span over
    the segment, whose launch then writes the most rows in place) — or is ``held`` as it
    came (a view, no copy); the other is then combined with it straight into the result."""

    def __init__(self, n: int, spans):
        spans = [tuple(s) for s in spans]
        bounds = sorted({0, n, *(a for a, _ in spans), *(b for _, b in spans)})
        self.segments = [(a, b) for a, b in zip(bounds, bounds[1:]) if a < b]
        self.count = {seg: sum(a <= seg[0] and seg[1] <= b for a, b in spans) for seg in self.segments}
        self.taken = set()
        self.arrived = {seg: 0 for seg in self.segments if self.count[seg] > 1}
        self.anchor = {seg: max((s for s in spans if s[0] <= seg[0] and seg[1] <= s[1]), key=lambda s: s[1] - s[0])
                       for seg in self.segments if self.count[seg] == 2}
        self.in_out: set = set()     # two-contribution segments whose first is in the result
        self.held: dict = {}         # ... whose first is held: seg -> that contribution's rows

    def covered(self, start, stop) -> list:
        return [seg for seg in self.segments if start <= seg[0] and seg[1] <= stop]

    def lendable(self, ops, result, start, stop) -> bool:
        """Whether the contribution to rows start:stop may be written into ``result``'s
        rows: the ops allow it (``writes_into``) and it overwrites nothing the result holds
        (a row's only contribution, or the first of two), nor takes the rows of two
        contributions from the other's longer launch."""
        writes = getattr(ops, "writes_into", None)
        covered = self.covered(start, stop)
        if writes is None or not writes(result) or not covered:
            return False
        for seg in covered:
            n = self.count[seg]
            if n == 1 and seg in self.taken:
                return False
            if n == 2 and (seg in self.in_out or (self.arrived[seg] == 0 and self.anchor[seg] != (start, stop))):
                return False
        return True

    def take(self, start, stop) -> list:
        """[(kind, a, b)] runs of the rows start:stop, "single" (this contribution's alone,
        now taken) or "shared"."""
        covered = self.covered(start, stop)
        for seg in covered:
            if self.count[seg] == 1:
                if seg in self.taken:
                    raise RuntimeError(f"context parallelism: rows {seg} got a second contribution the plan did not"
                                       " count (internal error)")
                self.taken.add(seg)
        return _kind_runs(("single" if self.count[seg] == 1 else "shared", seg) for seg in covered)

    def arrive(self, seg) -> str:
        """Counts a contribution to shared segment ``seg``: "first", "last" (the count the
        plan gave it reached), or "more"."""
        self.arrived[seg] += 1
        n = self.arrived[seg]
        if n > self.count[seg]:
            raise RuntimeError(f"context parallelism: rows {seg} got more contributions than the plan counted"
                               " (internal error)")
        return "last" if n == self.count[seg] else "first" if n == 1 else "more"

    def combine_steps(self, runs, view, lent: bool) -> list:
        """The shared rows of ``runs`` (``take``'s) that a contribution reaches, as [(step,
        a, b, extra)]: "summed" rows of three or more contributions (``extra``: each
        segment's arrival role), "into" the second of two whose first is in the result,
        "held" the second of two whose first was held (one segment; ``extra``: those held
        rows). A first of two makes no step: it is recorded as in the result (``lent``) or
        held (``view(a, b)``: the contribution's rows a:b, no copy)."""
        steps, roles = [], {}
        for kind, a, b in runs:
            if kind != "shared":
                continue
            for seg in self.covered(a, b):
                role = roles[seg] = self.arrive(seg)
                if self.count[seg] > 2:
                    steps.append(("summed", seg))
                elif role == "first":
                    if lent:
                        self.in_out.add(seg)
                    else:
                        self.held[seg] = view(*seg)
                else:
                    steps.append(("into" if seg in self.in_out else ("held", seg), seg))
        combined = []
        for step, a, b in _kind_runs(steps):
            if step == "summed":
                combined.append(("summed", a, b, roles))
            elif step == "into":
                combined.append(("into", a, b, None))
            else:
                combined.append(("held", a, b, self.held.pop((a, b))))
        return combined

    def shared_runs(self, least: int = 2) -> list:
        """[(a, b)] the runs of rows ``least`` or more contributions share."""
        return [(a, b) for kind, a, b in _kind_runs(("shared" if self.count[seg] >= least else "", seg)
                                                   for seg in self.segments) if kind == "shared"]

    @staticmethod
    def run_of(runs, a, b):
        """The key (lo, hi) of ``runs`` (keyed by ``shared_runs``) holding rows a:b."""
        return next((lo, hi) for lo, hi in runs if lo <= a and b <= hi)

    def untouched_runs(self) -> list:
        """[(a, b)] the runs of rows no contribution reached: none covers them, the one
        counted never came, or neither of two came."""
        return [(a, b) for kind, a, b in _kind_runs(
            ("none" if (seg not in self.taken if self.count[seg] <= 1 else
                        self.count[seg] == 2 and self.arrived[seg] == 0) else "", seg)
            for seg in self.segments) if kind == "none"]


class _RowSums:
    """A gradient summed over launches and messages, each adding into a row range of one
    array known ahead (``_RowSegments``), in the array's dtype with as few passes as each
    row's count of contributions allows:

    - one contribution: taken as it comes, straight into the result — written there by the
      launch itself where the ops allow (``lend``, ``writes_into``), else copied;
    - two: one in the result or held as it came, the other added to it straight into the
      result (``add_rows_into``: one pass, 6 bytes per element for 16-bit gradients);
    - three or more: summed in work-dtype sums kept for those rows only, the first copied
      in, the last added with the sums straight into the result;
    - none: zeros.

    These are the numbers a work-dtype accumulator, its adds in arrival order and one final
    cast give, bit for bit (no contribution is rounded before its add). Why: documents kept
    on their ranks leave most rows one contribution and the rest mostly two (4x H200,
    documents16 W 4 fwd+bwd: fills, adds and casts took 4.6 ms of a 56.8 ms step, 3.25 with
    sums for shared rows; 2x H200, W 2: two-contribution rows copied into fp32 sums and
    added back, 1.7 ms of a 26.9 ms step)."""

    def __init__(self, ops, like, spans):
        self.ops = ops
        self.rows = _RowSegments(like.shape[2], spans)
        self.count = self.rows.count
        self.out = ops.empty(like)
        # work-dtype sums for the runs of rows three or more contributions share, unfilled:
        # each row's first contribution is copied in (`_add_summed`), and rows none reached
        # are zeroed in the result instead (`result`)
        self.sums = {(a, b): ops.work_empty(ops.rows(like, a, b)) for a, b in self.rows.shared_runs(least=3)}

    def lend(self, start, stop):
        """Rows start:stop of the result (a view) for the launch that contributes them
        (else None, ``_RowSegments.lendable``): the launch writes them itself, and
        ``written_in_place`` then takes them from there."""
        if not self.rows.lendable(self.ops, self.out, start, stop):
            return None
        return self.ops.rows(self.out, start, stop)

    def written_in_place(self, start, stop):
        """The launch wrote its contribution into the rows ``lend`` gave it."""
        self._shared(start, self.rows.take(start, stop), self.ops.rows(self.out, start, stop), lent=True)

    def add(self, start, stop, x):
        """Contribution ``x`` to rows start:stop (one of the spans)."""
        ops = self.ops
        runs = self.rows.take(start, stop)
        for kind, a, b in runs:
            if kind == "single":
                ops.assign_rows(self.out, a, b, ops.rows(x, a - start, b - start))
        self._shared(start, runs, x, lent=False)

    def _shared(self, start, runs, x, lent: bool):
        ops = self.ops

        def view(s, e):
            return ops.rows(x, s - start, e - start)

        for step, a, b, extra in self.rows.combine_steps(runs, view, lent):
            piece = view(a, b)
            if step == "summed":
                self._add_summed(a, b, piece, extra)
            elif step == "into":        # (never lent: ``lendable``)
                ops.add_rows_into(self.out, a, b, ops.rows(self.out, a, b), piece)
            else:
                ops.add_rows_into(self.out, a, b, extra, piece)

    def _add_summed(self, a, b, part, roles):
        """``part`` (rows a:b, within one run of rows three or more contributions share)
        into the sums: copied where it is a row's first contribution, added with the sums
        into the result where it is the last (those rows are then done), else added."""
        ops = self.ops
        lo, hi = self.rows.run_of(self.sums, a, b)
        for role, s, e in _kind_runs((roles[seg], seg) for seg in self.rows.covered(a, b)):
            piece = ops.rows(part, s - a, e - a)
            if role == "first":
                ops.assign_rows(self.sums[(lo, hi)], s - lo, e - lo, piece)
            elif role == "last":
                ops.add_rows_into(self.out, s, e, ops.rows(self.sums[(lo, hi)], s - lo, e - lo), piece)
            else:
                self.sums[(lo, hi)] = ops.add_rows(self.sums[(lo, hi)], s - lo, e - lo, piece)

    def result(self):
        """The sums in the array's dtype (rows no contribution reached: zeros)."""
        ops, rows = self.ops, self.rows
        for seg, view in rows.held.items():     # the second of two never came
            ops.assign_rows(self.out, *seg, view)
        # rows of three or more whose last contribution never came: the sums of those that
        # did, or zeros where none did (their sums were never written)
        pending = _kind_runs(("none" if n == 0 else "pending" if n < self.count[seg] else "", seg)
                             for seg, n in rows.arrived.items() if self.count[seg] > 2)
        for kind, a, b in pending:
            if kind == "pending":
                lo, hi = rows.run_of(self.sums, a, b)
                ops.assign_rows(self.out, a, b, ops.rows(self.sums[(lo, hi)], a - lo, b - lo))
            elif kind == "none":
                ops.zero_rows(self.out, a, b)
        for a, b in rows.untouched_runs():
            ops.zero_rows(self.out, a, b)
        return self.out


class _RowOutputs:
    """The local queries' (out, lse) over launches whose query rows are known ahead
    (``spans``, ``_RowSegments``). Rows one launch covers take its output as it comes —
    written by the launch itself into the result where the ops allow (``lend``,
    ``writes_into``), else copied — with no fp32 accumulator, fill or final cast: the same
    numbers, one 16-bit output cast up and back being itself. Rows two launches cover: one
    output in the result (lent) or held as it came, the other merged with it by LSE
    straight into the result (``ops.merge_into``: computed in the work dtype, rounded once;
    2x H200, documents16 W 2: an fp32 copy, a merge and a cast back took 0.45 ms of a 7.6 ms
    forward). Rows three or more cover are merged in the work dtype (accumulators for those
    rows only; the first launch copied in, the others merged) and cast once at the end;
    rows no launch covers are 0 / −inf."""

    def __init__(self, ops, q, v, spans):
        self.ops, self.q, self.v = ops, q, v
        self.rows = _RowSegments(q.shape[2], spans)
        self.out, self.lse = ops.outputs(q, v)
        # rows three or more launches share: (a, b) -> [acc, lse, _Written] for rows a:b
        self.shared = {(a, b): [*ops.stats(ops.rows(q, a, b), v), _Written()]
                       for a, b in self.rows.shared_runs(least=3)}

    def lend(self, start, stop):
        """(out, lse) rows start:stop of the result (views) for the launch over them, or
        None: the launch writes them itself; ``add`` then merges the rows it shares with
        other launches from there."""
        if not self.rows.lendable(self.ops, self.out, start, stop):
            return None
        return self.ops.rows(self.out, start, stop), self.ops.rows(self.lse, start, stop)

    def add(self, start, stop, out_j, lse_j, lent: bool = False):
        """Launch output (``out_j``, ``lse_j``) for rows start:stop (the rows it was lent,
        if ``lent``)."""
        ops = self.ops
        runs = self.rows.take(start, stop)
        for kind, a, b in runs:
            if kind == "single" and not lent:
                ops.assign_rows(self.out, a, b, ops.rows(out_j, a - start, b - start))
                ops.assign_rows(self.lse, a, b, ops.rows(lse_j, a - start, b - start))

        def view(s, e):
            return ops.rows(out_j, s - start, e - start), ops.rows(lse_j, s - start, e - start)

        for step, a, b, extra in self.rows.combine_steps(runs, view, lent):
            part_o, part_l = view(a, b)
            if step == "summed":
                lo, hi = self.rows.run_of(self.shared, a, b)
                entry = self.shared[(lo, hi)]
                acc, lse, written = entry
                entry[0], entry[1] = written.combine(ops, acc, lse, a - lo, b - lo, part_o, part_l)
            elif step == "into":         # the first in the result: merge this one into it (never lent)
                ops.merge_into(self.out, self.lse, a, b, part_o, part_l)
            else:                        # the first held: this one in the result (lent) or put there
                if not lent:
                    ops.assign_rows(self.out, a, b, part_o)
                    ops.assign_rows(self.lse, a, b, part_l)
                ops.merge_into(self.out, self.lse, a, b, *extra)

    def result(self) -> tuple:
        """(out in the inputs' dtype, lse)."""
        ops = self.ops
        for (a, b), (acc, lse, _) in self.shared.items():
            ops.assign_rows(self.out, a, b, acc)
            ops.assign_rows(self.lse, a, b, lse)
        for (a, b), (held_o, held_l) in self.rows.held.items():     # the second of two never came
            ops.assign_rows(self.out, a, b, held_o)
            ops.assign_rows(self.lse, a, b, held_l)
        for a, b in self.rows.untouched_runs():     # 0 / -inf
            acc, lse = ops.stats(ops.rows(self.q, a, b), self.v)
            ops.assign_rows(self.out, a, b, acc)
            ops.assign_rows(self.lse, a, b, lse)
        return self.out, self.lse


def _kind_runs(kinded) -> list:
    """[(kind, a, b)]: adjacent (kind, (a, b)) segments of one kind joined, so each run is
    one array operation."""
    runs = []
    for kind, (a, b) in kinded:
        if runs and runs[-1][0] == kind and runs[-1][2] == a:
            runs[-1] = (kind, runs[-1][1], b)
        else:
            runs.append((kind, a, b))
    return runs


def _one_launch_over(pairs, kv_len: int) -> bool:
    """The step is one launch over all ``kv_len`` keys in hand."""
    return len(pairs) == 1 and pairs[0].kv_rows == (0, kv_len)


class _Written:
    """Which local query rows a launch has written: the first launch over rows is copied
    in (``ops.assign``), later ones merged by LSE — one fp32 read-modify-write of the
    output fewer per row."""

    def __init__(self):
        self.ranges = []

    def combine(self, ops, acc, lse, q0, q1, out_j, lse_j):
        if any(a < q1 and q0 < b for a, b in self.ranges):
            return ops.merge(acc, lse, q0, q1, out_j, lse_j)
        self.ranges.append((q0, q1))
        return ops.assign(acc, lse, q0, q1, out_j, lse_j)


def _global_order(plan, ops, shards):
    """The ranks' shards (a list in rank order) as one array in global sequence order."""
    layout, c = plan.layout, plan.layout.chunk
    where = {}
    for r in range(layout.world):
        for i, g in enumerate(layout.local_chunks(r)):
            where[g] = (r, i)
    if all(where[g] == (g, 0) for g in range(layout.num_chunks)):
        return ops.cat(list(shards))
    return ops.cat([ops.rows(shards[r], i * c, (i + 1) * c) for r, i in (where[g] for g in range(layout.num_chunks))])


def _rank_order(plan, ops, x) -> list:
    """An array in global order cut into each rank's shard (its chunks concatenated)."""
    layout, c = plan.layout, plan.layout.chunk
    return [ops.cat([ops.rows(x, g * c, (g + 1) * c) for g in layout.local_chunks(r)]) for r in range(layout.world)]


def _add_captures(ops, captures: dict, grads: dict) -> None:
    for key, grad in grads.items():
        if grad is not None:
            captures[key] = grad if key not in captures else ops.add(captures[key], grad)


def _all_reduced(plan, comm, ops, captures: dict, wanted) -> list:
    """Each wanted capture's gradient summed over ranks (every rank holds the tensor; one
    all-reduce per capture, in capture order on every rank, zeros where a rank's pairs
    never read it)."""
    originals = plan.spec.score.captures if plan.spec.score is not None else ()
    grads = []
    for i in wanted:
        grad = captures.get(id(originals[i]))
        grads.append(comm.all_reduce(ops.zeros(originals[i]) if grad is None else grad))
    return grads
