"""Context parallelism on the CPU: layouts, the ring and all-gather schedules shard by shard
against one exact call (ranks as threads), and torch.distributed over gloo with 2 and 4
processes against one process, forward and gradients (q, k, v and a trainable bias)."""

from __future__ import annotations

import contextlib
import itertools
import os

import numpy as np
import pytest

from flexattn import mods, reference
from flexattn.blockmask import create_block_mask
from flexattn.core import context_parallel as cp
from flexattn.core.context_parallel.host_ops import HostOps
from flexattn.problem.spec import AttentionSpec

from cp_schedules import run_ranks, run_schedule


# -- layouts -------------------------------------------------------------------------------------

def test_layouts_hold_every_token_once():
    for layout in (cp.contiguous(96, 3), cp.head_tail(96, 3), cp.balanced(96, 3, np.arange(12.0))):
        order = layout.order()
        assert sorted(order) == list(range(96))
        assert all(len(layout.positions(r)) == 32 for r in range(3))
    assert cp.head_tail(64, 4).owners == (0, 1, 2, 3, 3, 2, 1, 0)


def test_layout_errors_are_clear():
    with pytest.raises(ValueError, match="equal chunks"):
        cp.ShardLayout(100, 3, (0, 1, 2))
    with pytest.raises(ValueError, match="must own"):
        cp.ShardLayout(64, 2, (0, 0, 0, 1))
    with pytest.raises(ValueError, match="evenly"):
        cp.balanced(64, 3, np.ones(4))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_causal_layout_balances_the_attended_tiles(world):
    seq = 128 * 16 * world
    layout = cp.choose_layout(seq, world, mods.causal())
    weights = cp.mask_weights(mods.causal(), 1, 1, seq, layout.num_chunks)
    assert cp.imbalance(layout, weights) <= cp.layout.EVEN_ENOUGH
    # contiguous shards would give the last rank ~1.5x (2 ranks) to ~2x the mean
    flat = cp.mask_weights(mods.causal(), 1, 1, seq, world)
    assert cp.imbalance(cp.contiguous(seq, world), flat) > 1.4


def test_documents_of_uneven_lengths_are_balanced():
    seq, world = 8192, 4
    lengths = np.array([4000, 2000, 1192, 600, 400])
    doc = np.repeat(np.arange(len(lengths)), lengths)
    mask = mods.document(doc) & mods.causal()
    layout = cp.choose_layout(seq, world, mask)
    weights = cp.mask_weights(mask, 1, 1, seq, layout.num_chunks)
    assert cp.imbalance(layout, weights) <= cp.layout.EVEN_ENOUGH
    assert cp.choose_layout(seq, world, None) == cp.contiguous(seq, world)
    assert cp.choose_layout(seq, world, mods.sliding_window(256)) == cp.contiguous(seq, world)



def test_documents_keep_together_where_balance_allows():
    """``fewer_transfers`` after ``balanced``: 16 packed documents over 4 ranks — fewer K/V
    chunks attended from other ranks, the work still within TRANSFER_SLACK of even (or
    the balanced layout's own spread), every token once; the chosen layout is it."""
    seq, world = 16384, 4
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, seq // 128), 15, replace=False)) * 128
    doc = np.repeat(np.arange(16), np.diff(np.concatenate([[0], cuts, [seq]])))
    mask = mods.document(doc) & mods.causal()
    n = 8 * world
    weights = cp.mask_weights(mask, 1, 1, seq, n)
    attended = cp.layout._chunks_attended(mask, 1, 1, seq, n)
    start = cp.balanced(seq, world, weights)
    refined = cp.fewer_transfers(start, weights, attended)
    assert cp.transfers(refined.owners, attended) < cp.transfers(start.owners, attended)
    assert cp.imbalance(refined, weights) <= max(cp.layout.TRANSFER_SLACK, cp.imbalance(start, weights)) + 1e-12
    assert sorted(np.concatenate([refined.positions(r) for r in range(world)])) == list(range(seq))
    chosen = cp.choose_layout(seq, world, mask)     # balanced over 4 chunks per rank here, then refined
    m = chosen.num_chunks
    assert m == 4 * world
    w4 = cp.mask_weights(mask, 1, 1, seq, m)
    assert chosen == cp.fewer_transfers(cp.balanced(seq, world, w4), w4, cp.layout._chunks_attended(mask, 1, 1, seq, m))


def test_layout_report():
    """``layout_report``: work shares summing to 1, the imbalance, and the remote chunks the
    direct schedule would send — head-tail under causal: even work, every rank attending
    chunks of every other."""
    from flexattn.torch import context_parallel as tcp

    report = tcp.layout_report(cp.head_tail(1024, 2), lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    assert abs(report["work"].sum() - 1) < 1e-12 and report["imbalance"] < 1.01
    # rank 0 (chunks 0, 3) attends rank 1's chunks 1 and 2; rank 1 (chunks 1, 2) attends chunk 0 only
    assert (report["remote_chunks"], report["chunks"]) == (3, 4)

# -- the schedules, ranks as threads -----------------------------------------------------------------

B, H, HK, S, D = 2, 4, 2, 256, 16


def _problem(seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, S, D))
    k = rng.standard_normal((B, HK, S, D))
    v = rng.standard_normal((B, HK, S, D))
    d_out = rng.standard_normal((B, H, S, D))
    return rng, q, k, v, d_out


def _specs(rng):
    bias = rng.standard_normal(2 * S + 1)
    doc = np.repeat(np.arange(5), [100, 20, 60, 40, 36])

    def relative(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx - kv_idx + S]

    def documents(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    return {
        "causal": AttentionSpec.from_args(mask=mods.causal(), enable_gqa=True),
        "window": AttentionSpec.from_args(mask=mods.sliding_window(40), enable_gqa=True),
        "documents": AttentionSpec.from_args(mask=documents, enable_gqa=True),
        "alibi": AttentionSpec.from_args(score=mods.alibi(H), mask=mods.causal(), enable_gqa=True),
        "bias": AttentionSpec.from_args(score_mod=relative, enable_gqa=True),
        "block_mask": AttentionSpec.from_args(
            block_mask=create_block_mask(documents, None, None, S, S, BLOCK_SIZE=32), enable_gqa=True),
    }


def _float_captures(spec):
    if spec.score is None:
        return []
    return [i for i, c in enumerate(spec.score.captures) if isinstance(c, np.ndarray) and c.dtype.kind == "f"]


def _sharded_run(spec, layout, schedule, q, k, v, d_out):
    ops = HostOps()
    wanted = _float_captures(spec)

    def rank(comm):
        plan = cp.ContextParallelPlan(spec, layout, comm.rank, B, H)
        pos = layout.positions(comm.rank)
        ql, kl, vl, dl = q[:, :, pos], k[:, :, pos], v[:, :, pos], d_out[:, :, pos]
        out, lse, grads = run_schedule(schedule, plan, comm, ops, ql, kl, vl, dl, wanted)
        launches = sum(len(pairs) for _, pairs in plan.ring_steps())
        return pos, out, lse, grads, launches

    return cp.LoopbackWorld(layout.world).run(rank)


_LAYOUTS = {
    "contiguous4": lambda: cp.contiguous(S, 4),
    "head_tail2": lambda: cp.head_tail(S, 2),
    "head_tail4": lambda: cp.head_tail(S, 4),
    "shuffled2": lambda: cp.ShardLayout(S, 2, (1, 0, 0, 1)),
    "many2": lambda: cp.ShardLayout(S, 2, (0, 1, 1, 0, 1, 0, 0, 1)),   # steps fused over position tables
    "documents_kept2": lambda: _documents_kept(2),   # fewer_transfers: compact direct fetches
    "joined2": lambda: cp.ShardLayout(S, 2, (0, 0, 1, 0, 1, 1, 1, 0)),   # partly attended pairs joined
}


def _documents_kept(world):
    """The test documents' balanced layout over 4 chunks per rank, then ``fewer_transfers``."""
    mask = mods.document(np.repeat(np.arange(5), [100, 20, 60, 40, 36])) & mods.causal()
    n = 4 * world
    weights = cp.mask_weights(mask, 1, 1, S, n)
    return cp.fewer_transfers(cp.balanced(S, world, weights), weights, cp.layout._chunks_attended(mask, 1, 1, S, n))


@pytest.mark.parametrize("name", ["causal", "window", "documents", "alibi", "bias", "block_mask"])
@pytest.mark.parametrize("schedule", ["ring", "direct", "all_gather"])
@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_schedules_match_one_call(name, schedule, layout):
    rng, q, k, v, d_out = _problem(len(name) * 7 + len(layout))
    spec = _specs(rng)[name]
    layout = _LAYOUTS[layout]()
    out, lse = reference.forward(q, k, v, spec)
    grads = reference.backward(q, k, v, d_out, None, spec)
    whole = {n: np.zeros_like(x) for n, x in (("out", out), ("lse", lse), ("dq", q), ("dk", k), ("dv", v))}
    results = _sharded_run(spec, layout, schedule, q, k, v, d_out)
    for pos, o, l, (dq, dk, dv, d_caps), _ in results:
        for n, x in (("out", o), ("lse", l), ("dq", dq), ("dk", dk), ("dv", dv)):
            whole[n][:, :, pos] = x
    for n, ref in (("out", out), ("lse", lse), ("dq", grads.dq), ("dk", grads.dk), ("dv", grads.dv)):
        np.testing.assert_allclose(whole[n], ref, rtol=1e-10, atol=1e-10, err_msg=n)
    ref_caps = [grads.d_captures[i] for i in _float_captures(spec)]
    for *_, (_, _, _, d_caps), _ in results:
        assert len(d_caps) == len(ref_caps)
        for got, ref in zip(d_caps, ref_caps):
            np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10)



@pytest.mark.parametrize("schedule", ["ring", "direct", "all_gather"])
def test_schedules_plan_their_launches_for_a_shared_gpu(schedule):
    """Every launch of every schedule, forward and backward, is planned inside
    ``kernel_path.gpu_shared()`` (one CTA per tile: NCCL's kernels take SMs at any time)."""
    from flexattn.core import kernel_path

    seen = []

    class Watching(HostOps):
        def attention(self, *args):
            seen.append(kernel_path._GPU_SHARED.get())
            return super().attention(*args)

        def attention_backward(self, *args):
            seen.append(kernel_path._GPU_SHARED.get())
            return super().attention_backward(*args)

    rng, q, k, v, d_out = _problem(2)
    spec, layout = _specs(rng)["causal"], cp.head_tail(S, 2)

    def rank(comm):
        plan = cp.ContextParallelPlan(spec, layout, comm.rank, B, H)
        pos = layout.positions(comm.rank)
        run_schedule(schedule, plan, comm, Watching(), q[:, :, pos], k[:, :, pos], v[:, :, pos], d_out[:, :, pos], [])

    cp.LoopbackWorld(2).run(rank)
    assert seen and all(seen)
    assert kernel_path._GPU_SHARED.get() is False

def test_pairs_the_mask_excludes_are_skipped():
    rng, *_ = _problem(0)
    specs = _specs(rng)
    layout = cp.contiguous(S, 4)
    # causal, contiguous: rank r computes the r + 1 pairs at or below the diagonal
    counts = [sum(len(p) for _, p in cp.ContextParallelPlan(specs["causal"], layout, r, B, H).ring_steps())
              for r in range(4)]
    assert counts == [1, 2, 3, 4]
    # a 40-token window over 64-token shards: the diagonal and the one below it
    counts = [sum(len(p) for _, p in cp.ContextParallelPlan(specs["window"], layout, r, B, H).ring_steps())
              for r in range(4)]
    assert counts == [1, 2, 2, 2]
    # pairs entirely below the causal diagonal run without a mask (the dense kernel)
    plan = cp.ContextParallelPlan(specs["causal"], layout, 3, B, H)
    masks = [pair.spec.mask for _, pairs in plan.ring_steps() for pair in pairs]
    assert sum(m is None for m in masks) == 3
    assert mods.structure.is_causal([m for m in masks if m is not None][0])


class _Recording:
    """A loopback member that records each message it sends: (channel, from, to, rows)."""

    def __init__(self, member, sent: list):
        self.member, self.rank, self.world, self.sent = member, member.rank, member.world, sent

    def exchange(self, dst, arrays, src, like, channel="kv"):
        if dst is not None:
            self.sent.append((channel, self.rank, dst, arrays[0].shape[2]))
        return self.member.exchange(dst, arrays, src, like, channel)

    def __getattr__(self, name):
        return getattr(self.member, name)


@pytest.mark.parametrize("keep", [True, False])
def test_the_direct_schedule_sends_only_what_the_mask_attends(keep, monkeypatch):
    """A window over contiguous shards: rank r's keys go to rank r + 1 only, once if the
    forward keeps them for the backward (``KEEP_FETCHED``: a shard's worth here), else
    once per pass; dK/dV go back once, in the keys' dtype; the gradients are the one call's."""
    from flexattn.core.context_parallel import schedule

    monkeypatch.setattr(schedule, "KEEP_FETCHED", 1.0 if keep else 0.0)
    rng, q, k, v, d_out = _problem(3)
    spec = _specs(rng)["window"]          # 40 tokens over 64-token shards: only the next rank's keys
    layout = cp.contiguous(S, 4)
    world = cp.LoopbackWorld(4)
    sent = []

    def rank(member):
        comm = _Recording(member, sent)
        plan = cp.ContextParallelPlan(spec, layout, comm.rank, B, H)
        assert schedule.keeps_fetched(plan) == keep
        pos = layout.positions(comm.rank)
        out, lse, fetched = cp.direct_forward(plan, comm, HostOps(), q[:, :, pos], k[:, :, pos], v[:, :, pos])
        assert (fetched is not None) == keep
        return cp.direct_backward(plan, comm, HostOps(), q[:, :, pos], k[:, :, pos], v[:, :, pos], out, lse,
                                  d_out[:, :, pos], None, fetched=fetched)[:3]

    grads = world.run(rank)
    passes = 1 if keep else 2
    assert sorted(m[:3] for m in sent if m[0] == "kv") == sorted([("kv", r, r + 1) for r in range(3)] * passes)
    assert sorted(m[:3] for m in sent if m[0] == "grad") == sorted(("grad", r + 1, r) for r in range(3))
    want = reference.backward(q, k, v, d_out, None, spec)
    for i, name in enumerate(("dq", "dk", "dv")):
        whole = np.empty_like(q if i == 0 else k)
        for r in range(4):
            whole[:, :, layout.positions(r)] = grads[r][i]
        np.testing.assert_allclose(whole, getattr(want, name), atol=1e-10, err_msg=name)


def test_row_sums_take_single_contributions_as_they_come():
    """The direct backward's gradient sums (``schedule._RowSums``): rows one contribution
    covers take it as it comes (no accumulator add), rows several cover are summed in the
    work dtype and cast once, rows none covers are zeros — bit for bit what a float32
    accumulator, its adds and a final cast give for 16-bit contributions. A contribution
    the plan did not count is an error, not a silent overwrite."""
    import torch

    from flexattn.core.context_parallel.schedule import _RowSums
    from flexattn.torch.context_parallel import TorchOps

    class Counting(TorchOps):
        def __init__(self):
            self.adds = self.assigns = self.adds_into = 0

        def add_rows_into(self, out, start, stop, acc, x):
            self.adds_into += 1
            super().add_rows_into(out, start, stop, acc, x)

        def add_rows(self, acc, start, stop, x):
            self.adds += 1
            return super().add_rows(acc, start, stop, x)

        def assign_rows(self, out, start, stop, x):
            self.assigns += 1
            super().assign_rows(out, start, stop, x)

    g = torch.Generator().manual_seed(0)
    like = torch.zeros(1, 2, 100, 8, dtype=torch.bfloat16)
    spans = [(0, 40), (20, 60), (20, 30), (70, 90)]          # rows 60:70 and 90:100: nobody's
    parts = [torch.randn(1, 2, b - a, 8, generator=g).to(torch.bfloat16) for a, b in spans]
    ops = Counting()
    sums = _RowSums(ops, like, spans)
    for (a, b), x in zip(spans, parts):
        sums.add(a, b, x)
    got = sums.result()
    acc = torch.zeros(like.shape, dtype=torch.float32)
    for (a, b), x in zip(spans, parts):
        acc[:, :, a:b] += x
    assert got.dtype == torch.bfloat16 and torch.equal(got, acc.to(torch.bfloat16))
    # rows 0:20, 40:60 and 70:90 copied as they came; of 20:30 (three contributions) the
    # first copied into the fp32 sums, the second added, the last added with the sums
    # straight into the result; of 30:40 (two) the first held as it came and the second
    # added to it straight into the result: no separate cast
    assert (ops.adds, ops.assigns, ops.adds_into) == (1, 4, 2) and sums.count[(20, 30)] == 3
    # a shared row whose last contribution never came gets the sum of those that did
    part = _RowSums(Counting(), like, [(0, 10), (5, 10)])
    part.add(0, 10, parts[0][:, :, :10])
    assert torch.equal(part.result()[:, :, :10], parts[0][:, :, :10])
    part.add(5, 10, parts[0][:, :, :5])          # the last one, late: written into the result
    with pytest.raises(RuntimeError, match="more contributions"):
        part.add(5, 10, parts[0][:, :, :5])
    # the fp32 sums hold only the rows of three contributions, 20:30
    assert list(sums.sums) == [(20, 30)] and tuple(sums.sums[(20, 30)].shape) == (1, 2, 10, 8)
    one = _RowSums(Counting(), like, [(0, 100)])
    one.add(0, 100, parts[0].new_ones(1, 2, 100, 8))
    assert one.sums == {} and torch.equal(one.result(), torch.ones_like(like))
    with pytest.raises(RuntimeError, match="did not count"):
        one.add(0, 100, parts[0].new_ones(1, 2, 100, 8))
    # a counted contribution that never came leaves zeros, not garbage
    empty = _RowSums(HostOps(), np.zeros((1, 1, 8, 2), np.float32), [(0, 8)])
    assert np.array_equal(empty.result(), np.zeros((1, 1, 8, 2), np.float32))
    # the shared rows' sums are not filled (HostOps poisons them with NaN): rows whose
    # contributions partly came get those, rows none of whose contributions came get zeros
    shared = _RowSums(HostOps(), np.zeros((1, 1, 10, 2), np.float32), [(0, 10), (5, 10), (5, 8)])
    shared.add(5, 8, np.full((1, 1, 3, 2), 2.0, np.float32))
    want = np.zeros((1, 1, 10, 2), np.float32)
    want[:, :, 5:8] = 2.0
    assert np.array_equal(shared.result(), want)


def test_row_sums_add_two_contributions_in_one_pass():
    """Rows of two contributions (``_RowSums``): the longer launch is lent the result's
    rows whichever comes first, the other contribution is held as it came (or, coming
    second, not lent) and added to it in one pass straight into the result — no fp32
    sums, copies or casts — bit for bit an fp32 accumulator's sum, in either order, lent
    or not."""
    import torch

    from flexattn.core.context_parallel.schedule import _RowSums
    from flexattn.torch.context_parallel import TorchOps

    class Counting(TorchOps):
        def __init__(self, lend):
            self.lend, self.calls = lend, []

        def writes_into(self, result):
            return self.lend

        def add_rows_into(self, out, start, stop, acc, x):
            self.calls.append(("add_into", start, stop))
            super().add_rows_into(out, start, stop, acc, x)

        def assign_rows(self, out, start, stop, x):
            self.calls.append(("assign", start, stop))
            super().assign_rows(out, start, stop, x)

    g = torch.Generator().manual_seed(1)
    like = torch.zeros(1, 3, 64, 8, dtype=torch.bfloat16)
    long, short = (0, 64), (16, 40)
    parts = {s: torch.randn(1, 3, s[1] - s[0], 8, generator=g).to(torch.bfloat16) for s in (long, short)}
    want = torch.zeros(like.shape)
    for (a, b), x in parts.items():
        want[:, :, a:b] += x.float()
    want = want.to(torch.bfloat16)
    for order in ((long, short), (short, long)):
        for lend in (True, False):
            ops = Counting(lend)
            sums = _RowSums(ops, like, list(order))
            lent = []
            for a, b in order:
                into = sums.lend(a, b)
                if into is None:
                    sums.add(a, b, parts[(a, b)])
                else:
                    lent.append((a, b))
                    into.copy_(parts[(a, b)])          # the launch writing its rows
                    sums.written_in_place(a, b)
            assert torch.equal(sums.result(), want), (order, lend)
            assert sums.sums == {} and lent == ([long] if lend else [])
            singles = [] if lend else [("assign", 0, 16), ("assign", 40, 64)]
            assert sorted(ops.calls) == sorted([("add_into", 16, 40), *singles]), (order, lend, ops.calls)
    # the first of two never followed: the result holds it; the late second still adds
    ops = Counting(False)
    sums = _RowSums(ops, like, [long, short])
    sums.add(*short, parts[short])
    assert torch.equal(sums.result()[:, :, 16:40], parts[short])
    sums.add(*long, parts[long])
    assert torch.equal(sums.result(), want)


def test_torch_adds_onto_the_result_rows_per_head():
    """``TorchOps.add_rows_into`` where one operand is the result's own rows (the second of
    two contributions onto the first): an in-place multi-tensor add over the heads'
    contiguous row runs — the bits of ``torch.add`` in fp32, rows outside untouched; a
    layout whose heads do not split so (a [B, S, H, D] view) takes ``torch.add``."""
    import torch

    from flexattn.torch import context_parallel as tcp

    g = torch.Generator().manual_seed(2)
    ops = tcp.TorchOps()
    for layout in ("bhsd", "bshd"):
        base = torch.randn(2, 3, 50, 8, generator=g).to(torch.bfloat16)
        out = base if layout == "bhsd" else base.transpose(1, 2).contiguous().transpose(1, 2)
        x = torch.randn(2, 3, 20, 8, generator=g).to(torch.bfloat16)
        want = base.clone()
        want[:, :, 10:30] = (base[:, :, 10:30].float() + x.float()).to(torch.bfloat16)
        for order in (0, 1):
            got = out.clone() if layout == "bhsd" else out.transpose(1, 2).clone().transpose(1, 2)
            rows = got[:, :, 10:30]
            assert (tcp._heads(rows) is not None) == (layout == "bhsd")
            ops.add_rows_into(got, 10, 30, *((rows, x) if order == 0 else (x, rows)))
            assert torch.equal(got, want), (layout, order)


def test_row_outputs_merge_only_shared_rows():
    """``schedule._RowOutputs``: rows one launch covers take its output as it comes (lent:
    written by the launch itself), rows two cover are merged by LSE straight into the
    result, rows three or more cover in float64 accumulators written once, rows none
    covers are 0 / -inf — the same numbers as merging every launch into full
    accumulators."""
    from flexattn.core.context_parallel.host_ops import merge_rows
    from flexattn.core.context_parallel.schedule import _RowOutputs

    rng = np.random.default_rng(3)
    q, v = np.zeros((1, 2, 100, 4)), np.zeros((1, 2, 100, 3))
    spans = [(0, 45), (20, 60), (20, 30), (70, 90)]            # rows 60:70 and 90:100: nobody's
    launches = [(rng.standard_normal((1, 2, b - a, 3)), rng.standard_normal((1, 2, b - a))) for a, b in spans]
    # each order: the lends expected (rows 30:45 are two launches': the longer one over
    # them, 0:45, is lent; the other is merged into it, or held until it came)
    orders = {(0, 1, 2, 3): [True, False, True, True], (3, 2, 1, 0): [True, True, False, True]}
    for (order, lends), lend in itertools.product(orders.items(), (True, False)):
        spans_now, launches_now = [spans[i] for i in order], [launches[i] for i in order]
        ops = HostOps() if lend else type("Copying", (HostOps,), {"writes_into": staticmethod(lambda r: False)})()
        outputs = _RowOutputs(ops, q, v, spans_now)
        assert sorted(outputs.shared) == [(20, 30)]          # accumulators for rows of three launches alone
        lent = []
        for (a, b), (o, l) in zip(spans_now, launches_now):
            into = outputs.lend(a, b)
            lent.append(into is not None)
            if into is not None:
                into[0][...], into[1][...] = o, l
                o, l = into
            outputs.add(a, b, o, l, lent=into is not None)
        out, lse = outputs.result()
        acc, want_lse = np.zeros((1, 2, 100, 3)), np.full((1, 2, 100), -np.inf)
        for (a, b), (o, l) in zip(spans, launches):
            merge_rows(acc[:, :, a:b], want_lse[:, :, a:b], o, l)
        np.testing.assert_allclose(out, acc, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-12)
        assert np.all(out[:, :, 60:70] == 0) and np.all(lse[:, :, 90:100] == -np.inf)
        assert lent == (lends if lend else [False] * 4), (order, lend)


def test_launches_write_their_rows_in_place():
    """Forward and backward launches get the result's rows as their outputs
    (``_RowOutputs.lend``, ``_RowSums.lend``; ops with ``writes_into``): rows no other
    launch shares are never copied, shared ones are merged or summed from there — the
    same bits as copying each launch's output in (bf16 through TorchOps on CPU, documents
    kept on their ranks by the direct schedule)."""
    import torch

    from flexattn.torch.context_parallel import TorchOps

    class Counting(TorchOps):
        def __init__(self, lend):
            self.writes_into = lambda result: lend
            self.lent = self.copies = self.buffers = 0

        def work_empty(self, x):
            self.buffers += 1
            return super().work_empty(x)

        def stats(self, q, v):
            self.buffers += 1
            return super().stats(q, v)

        def attention(self, *args):
            self.lent += int(len(args) > 4 and args[4] is not None)
            return super().attention(*args)

        def attention_backward(self, *args):
            into = args[8] if len(args) > 8 else None
            self.lent += sum(x is not None for x in into or ())
            return super().attention_backward(*args)

        def assign_rows(self, out, start, stop, x):
            self.copies += 1
            super().assign_rows(out, start, stop, x)

    rng, q, k, v, d_out = _problem(5)
    spec = _specs(rng)["documents"]
    layout = _documents_kept(2)
    q, k, v, d_out = (torch.as_tensor(x).to(torch.bfloat16) for x in (q, k, v, d_out))
    got = {}
    for lend in (True, False):
        ops = Counting(lend)

        def rank(comm):
            plan = cp.ContextParallelPlan(spec, layout, comm.rank, B, H)
            pos = torch.as_tensor(layout.positions(comm.rank))
            shards = [x[:, :, pos] for x in (q, k, v, d_out)]
            out, lse, grads = run_schedule("direct", plan, comm, ops, *shards, [])
            return out, lse, *grads[:3]

        got[lend] = (cp.LoopbackWorld(layout.world).run(rank), ops.lent, ops.copies, ops.buffers)
    (lent_grads, lent, copies, buffers), (copied_grads, none_lent, all_copies, _) = got[True], got[False]
    assert none_lent == 0 and lent > 0 and copies < all_copies
    # at W 2 no row has more than two contributions: each shared one is combined straight
    # into the result (the longer launch lent, the other added or merged onto it), so
    # nothing is copied and no fp32 buffer is made
    assert (copies, buffers) == (0, 0)
    for a, b in zip(lent_grads, copied_grads):       # each rank's out, lse, dq, dk, dv
        for x, y in zip(a, b):
            assert torch.equal(x, y)
        assert a[0].dtype == a[2].dtype == torch.bfloat16


def test_the_direct_schedule_sends_only_the_chunks_attended():
    """Documents of 64 tokens, causal, over chunks of 32 dealt (0, 1, 0, 1, 1, 0, 0, 1):
    rank 1's queries attend rank 0's chunks 0, 2 and 6 (not 5: its document starts at
    160), so rank 0 sends those three laid end to end (two runs), and rank 0 fetches only
    chunk 4 of rank 1's; the dK/dV contributions return just as compact. Each message's
    rows are checked against the dense mask, and the result against one exact call."""
    rng, q, k, v, d_out = _problem(5)
    doc = np.repeat(np.arange(4), 64)

    def documents(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    spec = AttentionSpec.from_args(mask=documents, enable_gqa=True)
    layout = cp.ShardLayout(S, 2, (0, 1, 0, 1, 1, 0, 0, 1))
    dense = (doc[:, None] == doc[None, :]) & (np.arange(S)[:, None] >= np.arange(S)[None, :])
    sent = []

    def rank(member):
        comm = _Recording(member, sent)
        plan = cp.ContextParallelPlan(spec, layout, comm.rank, B, H)
        pos = layout.positions(comm.rank)
        out, lse, grads = run_schedule("direct", plan, comm, HostOps(), q[:, :, pos], k[:, :, pos], v[:, :, pos],
                                       d_out[:, :, pos], [])
        return pos, out, grads, plan.sent_chunks(1 - comm.rank, comm.rank)

    results = cp.LoopbackWorld(2).run(rank)
    c = layout.chunk
    for src in (0, 1):
        chunks = layout.local_chunks(src)
        attended = [i for i, g in enumerate(chunks)
                    if dense[np.ix_(layout.positions(1 - src), np.arange(g * c, (g + 1) * c))].any()]
        assert results[src][3] == tuple(attended)
        for channel, frm, to in (("kv", src, 1 - src), ("grad", 1 - src, src)):
            rows = [n for ch, a, b, n in sent if (ch, a, b) == (channel, frm, to)]
            # once each: the forward keeps the K/V it fetched (3 chunks of a 4-chunk shard at most)
            assert rows == [len(attended) * c], (channel, frm, to, rows)
    assert results[0][3] == (0, 1, 3) and results[1][3] == (2,)
    out_ref, _ = reference.forward(q, k, v, spec)
    grads_ref = reference.backward(q, k, v, d_out, None, spec)
    for pos, out, (dq, dk, dv, _), _ in results:
        np.testing.assert_allclose(out, out_ref[:, :, pos], atol=1e-10)
        for got, want in ((dq, grads_ref.dq), (dk, grads_ref.dk), (dv, grads_ref.dv)):
            np.testing.assert_allclose(got, want[:, :, pos], atol=1e-10)


@pytest.mark.parametrize("name,layout_of", [("causal", lambda: cp.head_tail(S, 4)),
                                             ("window", lambda: cp.contiguous(S, 4))])
def test_direct_fetches_are_staged_before_a_step_and_posted_after_its_launches(name, layout_of):
    """The direct schedule stages each step's new fetches (sends made ready on the stream)
    before the step's launches and posts them after: the host time of posting follows the
    launches, and the transfers wait for the staging only. Every step's fetch is posted
    before it is waited on, in the same order on every rank (the result is the one call's)."""
    rng, q, k, v, d_out = _problem(6)
    spec = _specs(rng)[name]
    layout = layout_of()
    logs = {r: [] for r in range(layout.world)}

    class Staging(_Recording):
        def stage(self, dst, arrays, src, like, channel="kv"):
            log = logs[self.rank]
            log.append(("stage", len(log)))
            comm = self

            class Staged:
                def post(self):
                    log.append(("post", len(log)))
                    return comm.exchange(dst, arrays, src, like, channel)
            return Staged()

    class Launches(HostOps):
        def __init__(self, rank):
            self.log, self.inside = logs[rank], False

        def attention(self, *args, **kwargs):
            self.log.append(("launch", len(self.log)))
            return super().attention(*args, **kwargs)

        def contiguous(self, x):
            self.log.append(("copy aside" if self.inside else "copy", len(self.log)))
            return super().contiguous(x)

        @contextlib.contextmanager
        def aside(self, like):
            self.inside = True
            yield
            self.inside = False

    def rank(member, comm_type):
        comm = comm_type(member, [])
        plan = cp.ContextParallelPlan(spec, layout, comm.rank, B, H)
        pos = layout.positions(comm.rank)
        out, lse, _ = cp.direct_forward(plan, comm, Launches(comm.rank), q[:, :, pos], k[:, :, pos], v[:, :, pos])
        return pos, out

    out_ref, _ = reference.forward(q, k, v, spec)
    results = cp.LoopbackWorld(layout.world).run(lambda member: rank(member, Staging))
    for pos, out in results:
        np.testing.assert_allclose(out, out_ref[:, :, pos], atol=1e-10)
    for r, log in logs.items():
        kinds = [kind for kind, _ in log]
        first_launch, first_post = kinds.index("launch"), kinds.index("post")
        assert "stage" in kinds[:first_launch], (r, kinds)       # step 0's fetches staged first
        assert first_launch < first_post, (r, kinds)             # posted after step 0's launches
        assert kinds.count("stage") == kinds.count("post"), (r, kinds)
        # the sends are made inside ops.aside (torch: beside the launches), each before its stage
        assert "copy" not in kinds, (r, kinds)
        assert all(kinds[i + 2] == "stage" for i, kind in enumerate(kinds) if kind == "copy aside" and (
            i == 0 or kinds[i - 1] != "copy aside")), (r, kinds)
    assert any("copy aside" in [kind for kind, _ in log] for log in logs.values())
    # a plain exchange hands its arrays over at once: they are made in line
    logs.update({r: [] for r in logs})
    results = cp.LoopbackWorld(layout.world).run(lambda member: rank(member, _Recording))
    for pos, out in results:
        np.testing.assert_allclose(out, out_ref[:, :, pos], atol=1e-10)
    kinds = [kind for log in logs.values() for kind, _ in log]
    assert "copy aside" not in kinds and "copy" in kinds


def test_the_direct_forward_keeps_at_most_a_shard_of_fetched_keys():
    """``plan.most_fetched`` in local shards, and so what the direct forward keeps: causal
    head-tail's last chunk attends every other shard (3 at W 4: fetched again in the
    backward), a window over contiguous shards one shard's worth (kept); a mask every rank
    answers from its own keys fetches nothing."""
    from flexattn.core.context_parallel import schedule

    rng, *_ = _problem(0)
    specs = _specs(rng)
    cases = [("causal", cp.head_tail(S, 4), 3.0, False), ("window", cp.contiguous(S, 4), 1.0, True),
             ("causal", cp.contiguous(S, 2), 1.0, True)]
    for name, layout, most, kept in cases:
        plans = [cp.ContextParallelPlan(specs[name], layout, r, B, H) for r in range(layout.world)]
        assert [p.most_fetched() for p in plans] == [most] * layout.world, name
        assert all(schedule.keeps_fetched(p) == kept for p in plans), name
    local = AttentionSpec.from_args(mask=mods.document(np.repeat(np.arange(4), S // 4)), enable_gqa=True)
    assert cp.ContextParallelPlan(local, cp.contiguous(S, 4), 0, B, H).most_fetched() == 0.0


def test_steps_of_many_chunk_pairs_fuse_into_one_launch():
    rng, *_ = _problem(0)
    specs = _specs(rng)
    layout = _LAYOUTS["many2"]()
    for name in ("causal", "documents", "bias"):
        plan = cp.ContextParallelPlan(specs[name], layout, 0, B, H)
        steps = plan.ring_steps()
        assert all(len(pairs) <= cp.plan.FUSE_ABOVE for _, pairs in steps), name
        c, mine = layout.chunk, layout.local_chunks(0)
        fused = 0
        for src, pairs in steps:
            theirs = layout.local_chunks(src)
            live = plan.verdicts[np.ix_(mine, theirs)] != 0
            if len(pairs) != 1 or live.sum() <= cp.plan.FUSE_ABOVE:
                continue
            # one launch over exactly the span of chunks the step attends
            rows, cols = np.flatnonzero(live.any(axis=1)), np.flatnonzero(live.any(axis=0))
            assert pairs[0].q_rows == (rows[0] * c, (rows[-1] + 1) * c), name
            assert pairs[0].kv_rows == (cols[0] * c, (cols[-1] + 1) * c), name
            fused += 1
        assert fused, name
    # a user's block mask is sliced per pair instead
    plan = cp.ContextParallelPlan(specs["block_mask"], layout, 0, B, H)
    assert max(len(pairs) for _, pairs in plan.ring_steps()) > 1


def test_launches_cover_each_attended_chunk_pair_once():
    """Every step's launches (rectangles of chunk pairs, joined where positions continue)
    cover exactly the chunk pairs the mask attends, each once; a partly attended rectangle
    spans chunks whose global positions continue (its mask runs at the rectangle's offsets),
    and on "joined2" the documents and the window each get one that joins two pairs."""
    rng, *_ = _problem(0)
    specs = _specs(rng)
    for layout_name in ("joined2", "documents_kept2", "shuffled2", "head_tail4"):
        layout = _LAYOUTS[layout_name]()
        c = layout.chunk
        for name in ("causal", "window", "documents", "bias", "block_mask"):
            joined = 0
            for r in range(layout.world):
                plan = cp.ContextParallelPlan(specs[name], layout, r, B, H)
                mine = layout.local_chunks(r)
                for s, (src, pairs) in enumerate(plan.direct_steps()):
                    theirs = ([*layout.local_chunks(src)] if s == 0 else
                              [layout.local_chunks(src)[i] for i in plan.sent_chunks(r, src)])
                    if plan._fused_step(mine, theirs, len(plan._blocks(mine, theirs, 1))) is not None:
                        continue    # one launch over position tables (test_steps_of_many_chunk_pairs_fuse...)
                    covered = np.zeros((len(mine), len(theirs)), dtype=int)
                    for pair in pairs:
                        (q0, q1), (k0, k1) = (tuple(x // c for x in rows) for rows in (pair.q_rows, pair.kv_rows))
                        covered[q0:q1, k0:k1] += 1
                        masked = pair.spec.mask is not None or pair.spec.block_mask is not None
                        if masked and (q1 - q0) * (k1 - k0) > 1:
                            assert all(theirs[i + 1] == theirs[i] + 1 for i in range(k0, k1 - 1)), (name, layout_name)
                            assert all(mine[i + 1] == mine[i] + 1 for i in range(q0, q1 - 1)), (name, layout_name)
                            joined += layout_name == "joined2"
                    live = plan.verdicts[np.ix_(mine, theirs)] != 0
                    np.testing.assert_array_equal(covered, live.astype(int), err_msg=f"{name} {layout_name} r{r} s{s}")
            if layout_name == "joined2" and name in ("documents", "window"):
                assert joined >= 1, name


def test_shifted_mods_share_one_structure():
    from flexattn.mods.positions import offset_positions

    window = mods.sliding_window(100)
    a, b = offset_positions(window, 512, 0), offset_positions(window, 1024, 256)
    assert a.structure_key == b.structure_key
    assert mods.structure.is_causal(offset_positions(mods.causal(), 4096, 4096))


# -- torch.distributed over gloo ------------------------------------------------------------------

torch = pytest.importorskip("torch")


def _gloo_worker(rank, world, port, tensors, results):
    import torch.distributed as dist

    from flexattn.torch import context_parallel as tcp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        q, k, v, d_out, bias, doc = tensors
        seq = q.shape[2]
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world,))
        out = {}
        for case, schedule in _GLOO_CASES:
            score_mod, mask, trained = _gloo_mods(case, bias, doc, seq)
            masking = _masking(mask)
            layout = tcp.shard_layout(seq, world, **masking)
            ql, kl, vl = (tcp.shard(x, layout).requires_grad_(True) for x in (q, k, v))
            group = mesh if case == "alibi" else None     # a DeviceMesh serves as the group too
            o, lse = tcp.flex_attention(ql, kl, vl, score_mod=score_mod, enable_gqa=True, return_lse=True,
                                        parallel=tcp.ContextParallel(layout, group, schedule=schedule), **masking)
            ((o * tcp.shard(d_out, layout)).sum() + 0.5 * lse.sum()).backward()   # d_lse too
            whole = [tcp.unshard(x, layout) for x in (o.detach(), ql.grad, kl.grad, vl.grad)]
            whole.append(tcp.unshard(lse.detach(), layout))
            grads = [trained.grad.numpy()] if trained is not None else []
            out[(case, schedule)] = [x.numpy() for x in whole] + grads
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


_GLOO_CASES = [("causal", "ring"), ("documents", "ring"), ("window", "all_gather"), ("alibi", "ring"),
               ("bias", "ring"), ("bias", "all_gather"), ("documents", "direct"), ("window", "direct"),
               ("bias", "direct"), ("block_mask", "ring"), ("block_mask", "direct")]


def _masking(mask) -> dict:
    """The keyword a mask goes by: a block mask (built for the whole sequence) or a function."""
    return {"block_mask": mask} if hasattr(mask, "BLOCK_SIZE") else {"mask": mask}


def _gloo_mods(case, bias, doc, seq):
    """(score_mod, mask, the trained tensor) as torch users write them; a fresh leaf per call."""
    if case == "causal":
        return None, lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None
    if case == "documents":
        return None, lambda b, h, q_idx, kv_idx: (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx), None
    if case == "block_mask":     # torch's way: create_block_mask once for the whole sequence
        import flexattn.torch as fa

        def same_document(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
        return None, fa.create_block_mask(same_document, None, None, seq, seq, BLOCK_SIZE=32), None
    if case == "window":
        return None, lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() <= 48, None
    if case == "alibi":
        return mods.alibi(H), lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None
    trained = bias.clone().requires_grad_(True)

    def relative(score, b, h, q_idx, kv_idx):
        return score + trained[q_idx - kv_idx + seq]
    return relative, lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, trained


def _gloo_inputs(seed: int, seq: int):
    """q, k, v, d_out and a relative-position bias table, float64, from torch's seed ``seed``."""
    torch.manual_seed(seed)
    q = torch.randn(B, H, seq, D, dtype=torch.float64)
    k = torch.randn(B, HK, seq, D, dtype=torch.float64)
    v = torch.randn(B, HK, seq, D, dtype=torch.float64)
    d_out = torch.randn(B, H, seq, D, dtype=torch.float64)
    return q, k, v, d_out, torch.randn(2 * seq + 1, dtype=torch.float64)


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_processes_match_one_process(world):
    import flexattn.torch as fa

    seq = 256
    q, k, v, d_out, bias = _gloo_inputs(world, seq)
    doc = torch.repeat_interleave(torch.arange(4), torch.tensor([100, 50, 70, 36]))
    got = run_ranks(_gloo_worker, world, ((q, k, v, d_out, bias, doc),), timeout=600)
    for case, schedule in _GLOO_CASES:
        score_mod, mask, trained = _gloo_mods(case, bias, doc, seq)
        qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
        o, lse = fa.flex_attention(qq, kk, vv, score_mod=score_mod, enable_gqa=True, return_lse=True, **_masking(mask))
        ((o * d_out).sum() + 0.5 * lse.sum()).backward()
        expected = [o.detach(), qq.grad, kk.grad, vv.grad, lse.detach()] + ([trained.grad] if trained is not None else [])
        for rank in range(world):   # every rank holds the whole result after unshard, and the bias gradient
            for name, a, b in zip(("out", "dq", "dk", "dv", "lse", "d_bias"), got[rank][(case, schedule)], expected):
                np.testing.assert_allclose(a, b.numpy(), rtol=1e-9, atol=1e-9, err_msg=f"{case} {schedule} {name}")


def test_torch_call_errors_before_any_message():
    """Bad calls raise on every rank before any attention message: a rank's own error
    there, and on the others that it refused; ranks that disagree on the layout all say
    so (instead of waiting for messages that never come)."""
    from flexattn.torch import context_parallel as tcp

    layout = cp.head_tail(64, 2)
    q = torch.randn(1, 2, 32, 16)
    with pytest.raises(TypeError, match="ContextParallel"):
        tcp.flex_attention(q, q, q, parallel=layout)
    with pytest.raises(ValueError, match="schedule"):
        tcp.ContextParallel(layout, schedule="tree")

    def on_each_rank(call):
        def rank(member):
            try:
                call(member)
            except (TypeError, ValueError) as e:
                return e
            return None
        return cp.LoopbackWorld(2).run(rank)

    errors = on_each_rank(lambda m: tcp.flex_attention(q[:, :, :16] if m.rank == 0 else q, q, q,
                                                       parallel=tcp.ContextParallel(layout, m)))
    assert "shard" in str(errors[0]) and "rank(s) [0] refused" in str(errors[1])
    errors = on_each_rank(lambda m: tcp.flex_attention(q, q, q, parallel=tcp.ContextParallel(cp.head_tail(96, 3), m)))
    assert all("3 ranks, the group has 2" in str(e) for e in errors)
    errors = on_each_rank(lambda m: tcp.flex_attention(
        q, q, q, parallel=tcp.ContextParallel(layout if m.rank == 0 else cp.contiguous(64, 2), m)))
    assert all(e is not None and "disagree" in str(e) for e in errors), errors
    assert on_each_rank(lambda m: tcp.flex_attention(q, q, q, parallel=tcp.ContextParallel(layout, m))) == [None, None]
    # rank-threads recording a backward on one GPU would hang in torch's one autograd
    # worker of that GPU: every rank refuses (the GPU index as _backward_gpu finds it on
    # CUDA tensors); on two GPUs, or without a recorded backward, they run
    real = tcp._backward_gpu
    leaf = q.clone().requires_grad_(True)
    try:
        for gpus, refused in (((0, 0), True), ((0, 1), False), ((-1, -1), False)):
            tcp._backward_gpu = lambda comm, query, records, gpus=gpus: gpus[comm.rank] if records else -1
            errors = on_each_rank(lambda m: tcp.flex_attention(leaf, q, q, parallel=tcp.ContextParallel(layout, m)))
            assert all((e is not None and "one worker thread" in str(e)) == refused for e in errors), (gpus, errors)
        tcp._backward_gpu = lambda comm, query, records: 0 if records else -1

        def without_grad(m):     # (grad mode is per thread: each rank's)
            with torch.no_grad():
                tcp.flex_attention(leaf, q, q, parallel=tcp.ContextParallel(layout, m))
        assert on_each_rank(without_grad) == [None, None]
    finally:
        tcp._backward_gpu = real


def test_the_backward_is_checked_where_only_a_score_capture_records(monkeypatch):
    """The door's checks before any message ask whether the backward kernels take the call
    wherever autograd records it: q, k or v requiring grad, or a tensor the score mod
    captures (a trainable bias on frozen inputs) — not only q, k, v. (CUDA-looking CPU
    tensors, the kernels' verdicts stubbed: the checks are what is tested.)"""
    from flexattn.torch import context_parallel as tcp

    class CudaLooking(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    monkeypatch.setattr(tcp, "kernel_unsupported", lambda query, shape: None)
    monkeypatch.setattr(tcp, "backward_unsupported", lambda shape, query: "no backward here")
    layout = cp.head_tail(64, 2)
    q = torch.randn(1, 2, 32, 16).as_subclass(CudaLooking)
    bias = torch.zeros(2, requires_grad=True)
    spec = AttentionSpec.from_args(score=mods.score_mod(lambda s, b, h, qi, ki: s + bias[h]))
    with pytest.raises(ValueError, match="no backward here"):
        tcp._check_shard(q, q, q, spec, layout)
    tcp._check_shard(q, q, q, AttentionSpec.from_args(), layout)          # nothing records
    with torch.no_grad():
        tcp._check_shard(q, q, q, spec, layout)                            # grad mode off
    with pytest.raises(ValueError, match="no backward here"):
        tcp._check_shard(q.detach().requires_grad_(True), q, q, AttentionSpec.from_args(), layout)


def test_call_agreement_is_kept_per_communicator_object():
    """The door's agreement before any message (``_agree``: one small all-gather, then a
    cache) is remembered per in-process communicator object: every rank of a new world
    gathers again, whatever ids freed members had (keyed by id, one rank of a new world
    once skipped the gather while the other waited for it forever); a repeated call on the
    same members does not gather."""
    import gc

    from flexattn.torch import context_parallel as tcp

    layout = cp.head_tail(64, 2)
    q = torch.randn(1, 2, 32, 16)
    gathers = []

    def run(world):
        def rank(member):
            real = member.all_gather

            def counted(x):
                gathers.append(member.rank)
                return real(x)
            member.all_gather = counted
            with torch.no_grad():
                for _ in range(2):      # the second call: agreed already
                    tcp.flex_attention(q, q, q, parallel=tcp.ContextParallel(layout, member))
        world.run(rank)

    for _ in range(4):      # fresh worlds, their members freed in between
        gathers.clear()
        run(cp.LoopbackWorld(2))
        gc.collect()
        assert sorted(gathers) == [0, 1], gathers


def _style_worker(rank, world, port, tensors, results):
    """torchtitan's way: torch's head-tail sharding, an inner-attention module made
    context-parallel by ``parallelize_module`` with our style, a whole-sequence block mask
    and a torch-style score_mod over a trainable bias."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import _context_parallel_shard, _HeadTailLoadBalancer
    from torch.distributed.tensor.parallel import parallelize_module

    import flexattn.torch as fa
    import flexattn.torch.attention as fa_attention
    from flexattn.torch import context_parallel as tcp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        q, k, v, d_out, bias = tensors
        seq = q.shape[2]
        mesh = init_device_mesh("cpu", (world,))

        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        layout = tcp.head_tail(seq, world)     # torch's balancer's order (shard_layout's choice at longer lengths)
        balancer = _HeadTailLoadBalancer(seq, world, torch.device("cpu"))
        shards = _context_parallel_shard(mesh, [q, k, v, d_out], (2, 2, 2, 2), load_balancer=balancer)
        same_order = all(torch.equal(s, tcp.shard(x, layout)) for s, x in zip(shards, (q, k, v, d_out)))
        trained = bias.clone().requires_grad_(True)

        class InnerAttention(torch.nn.Module):
            def forward(self, q, k, v, block_mask=None):
                return fa.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + trained[qi - ki + seq],
                                         block_mask=block_mask, enable_gqa=True)

        attention = parallelize_module(InnerAttention(), mesh, tcp.ContextParallelStyle(layout))
        block_mask = fa.create_block_mask(causal, None, None, seq, seq, BLOCK_SIZE=32)
        leaves = [x.detach().requires_grad_(True) for x in shards[:3]]
        out = attention(*leaves, block_mask=block_mask)
        (out * shards[3]).sum().backward()
        outside = fa_attention.CONTEXT_PARALLEL.get()    # the style's scope ends with the forward
        whole = [tcp.unshard(x, layout).numpy() for x in (out.detach(), *(x.grad for x in leaves))]
        results.put((rank, (same_order, outside, whole, trained.grad.numpy())))
    finally:
        dist.destroy_process_group()


def test_the_parallel_style_runs_an_inner_attention_module():
    """``parallelize_module(module, mesh, ContextParallelStyle(layout))`` on 2 gloo ranks, the
    inputs sharded by torch's own head-tail balancer (the same token order as ours): the
    module's output and gradients (q, k, v, the trainable bias) against one process's call."""
    import flexattn.torch as fa

    seq = 256
    q, k, v, d_out, bias = _gloo_inputs(7, seq)
    got = run_ranks(_style_worker, 2, ((q, k, v, d_out, bias),), timeout=300)
    trained = bias.clone().requires_grad_(True)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = fa.flex_attention(*leaves, score_mod=lambda s, b, h, qi, ki: s + trained[qi - ki + seq],
                            mask=lambda b, h, qi, ki: qi >= ki, enable_gqa=True)
    (out * d_out).sum().backward()
    want = [out.detach().numpy(), *(x.grad.numpy() for x in leaves)]
    for rank in (0, 1):
        same_order, outside, whole, d_bias = got[rank]
        assert same_order and outside is None
        for g, w in zip(whole, want):
            np.testing.assert_allclose(g, w, atol=1e-10)
        np.testing.assert_allclose(d_bias, trained.grad.numpy(), atol=1e-9)
