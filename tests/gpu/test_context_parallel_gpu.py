"""GPU: context parallelism on the kernels.

One GPU: the whole ring (and all-gather) schedule run shard by shard in one process, ranks
as threads (``LoopbackWorld``), every pair on the forward and backward kernels, against one
``flexattn.torch.flex_attention`` call and the float64 reference: the sharded result's error
stays within the one call's bounds (test_autograd_gpu.py's tolerances). Several GPUs: the
public door over NCCL, one process per GPU, autograd to q, k, v and a trainable bias,
against one GPU's call. Skipped without CUDA (the NCCL part without 2 GPUs).
"""

import os
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")

import flexattn.torch as fa  # noqa: E402
from flexattn import mods, reference  # noqa: E402
from flexattn.core import AttentionSpec  # noqa: E402
from flexattn.core import context_parallel as cp  # noqa: E402
from flexattn.torch import context_parallel as tcp  # noqa: E402
from cp_schedules import run_ranks, run_schedule  # noqa: E402

TOL = (4e-2, 1.5e-2)   # bf16: max error / largest reference value, and relative norm error


def _close(what, got, want, tol=None):
    tol = tol or TOL
    got = got.detach().double().cpu().numpy().reshape(np.shape(want))
    assert not np.isnan(got).any(), f"{what}: NaN elements"
    ref = max(np.abs(want).max(), 1e-6)
    err = np.abs(got - want).max()
    rel = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-12)
    assert err <= tol[0] * ref and rel <= tol[1], f"{what}: max err {err:.3g} (ref {ref:.3g}), rel {rel:.3g}"


class _SerialKernels(tcp.TorchOps):
    """The kernels one rank-thread at a time (compiles and launches from one thread at a
    time); messages between ranks still interleave freely."""

    lock = threading.Lock()

    def attention(self, *args):
        with self.lock:
            return super().attention(*args)

    def attention_backward(self, *args):
        with self.lock:
            return super().attention_backward(*args)


B, H, HK, D = 1, 4, 2, 128


def _rank_setup(spec, layout, comm, arrays):
    """A loopback rank's plan (block masks built one rank-thread at a time, as
    ``_SerialKernels`` launches) and its rows of each of ``arrays`` -> (plan, positions,
    rows)."""
    build = tcp._device_block_masks(arrays[0])

    def serial_build(*args):
        with _SerialKernels.lock:
            return build(*args)

    plan = cp.ContextParallelPlan(spec, layout, comm.rank, B, H, block_mask_builder=serial_build)
    pos = torch.as_tensor(layout.positions(comm.rank), device="cuda")
    return plan, pos, [x.index_select(2, pos).contiguous() for x in arrays]


def _cases(seq, device):
    g = torch.Generator().manual_seed(seq)
    bias = (torch.randn(2 * seq + 1, generator=g, dtype=torch.float64) * 0.5)
    lengths = torch.tensor([seq // 2 + 128, seq // 4 - 256, seq // 4 + 128])
    doc = torch.repeat_interleave(torch.arange(3), lengths).to(torch.int32)

    def relative(score, b, h, q_idx, kv_idx):
        return score + bias_t[q_idx - kv_idx + seq]

    bias_t = bias.to(device=device, dtype=torch.float32).requires_grad_(True)
    doc_t = doc.to(device)

    def documents(b, h, q_idx, kv_idx):
        return (doc_t[q_idx] == doc_t[kv_idx]) & (q_idx >= kv_idx)

    return {
        "causal": (AttentionSpec.from_args(mask=mods.causal(), enable_gqa=True), None),
        "window": (AttentionSpec.from_args(mask=mods.sliding_window(300), enable_gqa=True), None),
        "documents": (AttentionSpec.from_args(mask=documents, enable_gqa=True), None),
        "alibi": (AttentionSpec.from_args(score=mods.alibi(H), mask=mods.causal(), enable_gqa=True), None),
        "bias": (AttentionSpec.from_args(score_mod=relative, mask=mods.causal(), enable_gqa=True), bias_t),
    }


@pytest.mark.parametrize("case", ["causal", "window", "documents", "alibi", "bias"])
@pytest.mark.parametrize("world,schedule,chunks", [(2, "ring", None), (4, "ring", None), (4, "all_gather", None),
                                                   (2, "ring", 8), (4, "direct", None),
                                                   (2, "direct", (0, 0, 1, 0, 1, 1, 1, 0))])
def test_schedule_shard_by_shard_matches_one_call(case, world, schedule, chunks):
    _shard_by_shard(case, world, schedule, chunks, torch.bfloat16, TOL)


@pytest.mark.parametrize("case", ["causal", "documents", "bias"])
@pytest.mark.parametrize("world,schedule,chunks", [(2, "ring", 8), (4, "direct", None)])
def test_float32_schedule_shard_by_shard(case, world, schedule, chunks):
    """float32 (torch's default "highest": 3xTF32 forward, the float32 backward kernel,
    bwd/tf32_sync.py) through the ring's fused steps and the direct schedule's kept K/V:
    each pair's backward in float32, dK / dV returned in float32. Written in session 23,
    not yet run on a GPU."""
    _shard_by_shard(case, world, schedule, chunks, torch.float32, (1e-4, 2e-5))


def _shard_by_shard(case, world, schedule, chunks, dtype, tol):
    seq = 2048
    torch.manual_seed(world)
    q = torch.randn(B, H, seq, D, device="cuda", dtype=dtype)
    k = torch.randn(B, HK, seq, D, device="cuda", dtype=dtype)
    v = torch.randn(B, HK, seq, D, device="cuda", dtype=dtype)
    d_out = torch.randn(B, H, seq, D, device="cuda", dtype=dtype)
    spec, trained = _cases(seq, "cuda")[case]
    layout = cp.choose_layout(seq, world, spec.mask, B, H)
    if isinstance(chunks, tuple):   # these owners: documents' and the window's partly attended pairs join
        layout = cp.ShardLayout(seq, world, chunks)
    elif chunks:   # chunks dealt alternately: ring steps fused into one launch over position tables
        layout = cp.ShardLayout(seq, world, tuple((i + i // world) % world for i in range(chunks * world)))
    wanted = [i for i, c in enumerate(spec.score.captures if spec.score is not None else ()) if c is trained]
    ops = _SerialKernels()

    def rank(comm):
        plan, pos, (ql, kl, vl, dl) = _rank_setup(spec, layout, comm, (q, k, v, d_out))
        out, lse, grads = run_schedule(schedule, plan, comm, ops, ql, kl, vl, dl, wanted)
        torch.cuda.synchronize()
        return pos, out, lse, grads

    results = cp.LoopbackWorld(world).run(rank)
    whole = {n: torch.zeros_like(x, dtype=torch.float32) for n, x in (("out", d_out), ("dq", q), ("dk", k), ("dv", v))}
    whole["lse"] = torch.zeros(B, H, seq, device="cuda")
    for pos, out, lse, (dq, dk, dv, d_caps) in results:
        for n, x in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
            whole[n][:, :, pos] = x.float()
    host = [x.double().cpu().numpy() for x in (q, k, v, d_out)]
    ref_spec = spec if trained is None else AttentionSpec.from_args(
        score=spec.score.with_captures(tuple(c.detach().double().cpu().numpy() if c is trained else c
                                             for c in spec.score.captures)), mask=spec.mask, enable_gqa=True)
    ref_out, ref_lse = reference.forward(*host[:3], ref_spec)
    ref = reference.backward(*host, None, ref_spec)
    for n, want in (("out", ref_out), ("dq", ref.dq), ("dk", ref.dk), ("dv", ref.dv)):
        _close(f"{case} {n}", whole[n], want, tol)
    lse_err = np.abs(whole["lse"].double().cpu().numpy() - ref_lse).max()
    assert lse_err < (2e-2 if dtype == torch.bfloat16 else 1e-4), f"lse error {lse_err}"
    if trained is not None:
        want = ref.d_captures[wanted[0]]
        for *_, (_, _, _, d_caps) in results:
            _close(f"{case} d_bias", d_caps[0], want, tol)
    # the same data through one call of the public door: the sharded error is no worse than ~2x its error
    one = fa.flex_attention(q, k, v, score_mod=spec.score, mask=spec.mask, enable_gqa=True)
    one_err = (one.detach().double().cpu().numpy() - ref_out)
    sharded_err = whole["out"].double().cpu().numpy() - ref_out
    assert np.abs(sharded_err).max() <= 2 * np.abs(one_err).max() + 2e-3


def test_the_public_door_runs_threads_of_one_process():
    """``flexattn.torch.context_parallel.flex_attention`` with a loopback group, forward."""
    seq, world = 2048, 2
    q = torch.randn(B, H, seq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, HK, seq, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, HK, seq, D, device="cuda", dtype=torch.bfloat16)
    causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx  # noqa: E731 - as torch users write it
    layout = tcp.shard_layout(seq, world, mask=causal)

    def rank(comm):
        ql, kl, vl = (tcp.shard(x, layout, comm.rank) for x in (q, k, v))
        with torch.no_grad():
            return tcp.flex_attention(ql, kl, vl, mask=causal, enable_gqa=True,
                                      parallel=tcp.ContextParallel(layout, comm))

    for mask in (causal, None):   # compile the pairs' kernels (diagonal: causal; below it: dense) in one thread
        fa.flex_attention(q[:, :, :256], k[:, :, :256], v[:, :, :256], mask=mask, enable_gqa=True)
    outs = cp.LoopbackWorld(world).run(rank)
    torch.cuda.synchronize()
    whole = torch.empty_like(q)
    for r, o in enumerate(outs):
        whole[:, :, torch.as_tensor(layout.positions(r), device="cuda")] = o
    one = fa.flex_attention(q, k, v, mask=causal, enable_gqa=True)
    assert (whole.float() - one.float()).abs().max().item() < 2e-2


def test_repeated_calls_launch_prepared_pairs():
    """A repeated call's pairs launch prepared (``tcp._pair_forward``: no checks, planning or
    lists): three calls of the public door per rank-thread, the second on the prepared
    launches, the third after the score's captured bias changed in place (a prepared launch
    reads its tensor captures at launch), each against one GPU's call."""
    seq, world = 2048, 2
    torch.manual_seed(3)
    q = torch.randn(B, H, seq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, HK, seq, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, HK, seq, D, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(H, device="cuda")
    doc = (torch.arange(seq, device="cuda") * 3 // seq).to(torch.int32)

    def documents(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    def score(s, b, h, q_idx, kv_idx):
        return s + bias[h]

    layout = tcp.shard_layout(seq, world, mask=documents)

    def calls(comm):
        ql, kl, vl = (tcp.shard(x, layout, comm.rank) for x in (q, k, v))
        parallel = tcp.ContextParallel(layout, comm)
        outs = []
        for step in range(3):
            if step == 2:
                comm_barrier.wait()
                if comm.rank == 0:
                    bias.mul_(-2.0).add_(0.5)
                comm_barrier.wait()
            with torch.no_grad():
                outs.append(tcp.flex_attention(ql, kl, vl, score_mod=score, mask=documents, enable_gqa=True,
                                               parallel=parallel))
            torch.cuda.synchronize()
        return outs

    comm_barrier = threading.Barrier(world)
    for mask in (documents, None):   # compile the pairs' kernels in one thread (as the door test does)
        fa.flex_attention(q[:, :, :256], k[:, :, :256], v[:, :, :256], score_mod=score, mask=mask, enable_gqa=True)
    tcp._PAIR_LAUNCHES.clear()
    before = bias.clone()
    per_rank = cp.LoopbackWorld(world).run(calls)
    assert any(slot[2] is not None for slot in list(tcp._PAIR_LAUNCHES.values())), "no pair launch was prepared"
    after = bias.clone()
    for step, value in ((0, before), (1, before), (2, after)):
        bias.copy_(value)
        one = fa.flex_attention(q, k, v, score_mod=score, mask=documents, enable_gqa=True)
        whole = torch.empty_like(q)
        for r, outs in enumerate(per_rank):
            whole[:, :, torch.as_tensor(layout.positions(r), device="cuda")] = outs[step]
        err = (whole.float() - one.float()).abs().max().item()
        assert err < 2e-2, f"call {step}: max difference to one GPU {err}"
    assert (per_rank[0][1] == per_rank[0][0]).all(), "the prepared launch changed the result"


def test_repeated_steps_launch_prepared_pair_backwards(monkeypatch):
    """From a plan's second step on, every pair's backward launches prepared
    (``tcp._pair_backward``: no checks, planning or list uploads): the full path
    (``_kernel_backward``) runs in the first step only. dK / dV are bitwise the first
    step's (one CTA per kv tile, the pairs summed in a fixed order), dQ and the trained
    bias's gradient within their atomics' order; the fourth step, after the bias changed
    in place (a prepared launch reads its captures at launch), against the float64
    reference."""
    seq, world = 2048, 2
    torch.manual_seed(9)
    q = torch.randn(B, H, seq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, HK, seq, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    d_out = torch.randn(B, H, seq, D, device="cuda", dtype=torch.bfloat16)
    spec, trained = _cases(seq, "cuda")["bias"]
    wanted = [i for i, c in enumerate(spec.score.captures) if c is trained]
    layout = cp.choose_layout(seq, world, spec.mask, B, H)
    ops = _SerialKernels()
    full_path = []
    kernel_backward = tcp._kernel_backward

    def counted(*args, **kw):
        full_path.append(1)
        return kernel_backward(*args, **kw)

    monkeypatch.setattr(tcp, "_kernel_backward", counted)
    monkeypatch.delenv("FLEXATTN_CP_PREPARED", raising=False)
    tcp._PAIR_BACKWARDS.clear()
    steps, barrier = 4, threading.Barrier(world)

    def rank(comm):
        plan, pos, (ql, kl, vl, dl) = _rank_setup(spec, layout, comm, (q, k, v, d_out))
        results = []
        for step in range(steps):
            if step == steps - 1:
                barrier.wait()
                if comm.rank == 0:
                    with torch.no_grad():
                        trained.mul_(-1.5)
                barrier.wait()
            _, _, grads = run_schedule("direct", plan, comm, ops, ql, kl, vl, dl, wanted)
            torch.cuda.synchronize()
            barrier.wait()                        # both ranks' launches of the step done
            results.append((len(full_path), grads))
            barrier.wait()
        # (entries leave with their plan's specs: looked at while the plan lives)
        prepared = any(slot[1] is not None for slot in list(tcp._PAIR_BACKWARDS.values()))
        return pos, results, prepared

    per_rank = cp.LoopbackWorld(world).run(rank)
    first_step = per_rank[0][1][0][0]
    assert first_step > 0 and len(full_path) == first_step, (first_step, len(full_path))
    assert all(prepared for *_, prepared in per_rank), "no pair backward was prepared"
    for _, results, _ in per_rank:
        (_, (dq0, dk0, dv0, caps0)) = results[0]
        for _, (dq, dk, dv, caps) in results[1:steps - 1]:
            assert torch.equal(dk, dk0) and torch.equal(dv, dv0), "a prepared step changed dK / dV"
            assert (dq.float() - dq0.float()).abs().max() <= 1e-2 * dq0.float().abs().max()
            assert (caps[0] - caps0[0]).abs().max() <= 1e-3 * caps0[0].abs().max()
    whole = {n: torch.zeros_like(x, dtype=torch.float32) for n, x in (("dq", q), ("dk", k), ("dv", v))}
    for pos, results, _ in per_rank:
        dq, dk, dv, _ = results[-1][1]
        for n, x in (("dq", dq), ("dk", dk), ("dv", dv)):
            whole[n][:, :, pos] = x.float()
    host = [x.double().cpu().numpy() for x in (q, k, v, d_out)]
    ref_spec = AttentionSpec.from_args(
        score=spec.score.with_captures(tuple(c.detach().double().cpu().numpy() if c is trained else c
                                             for c in spec.score.captures)), mask=spec.mask, enable_gqa=True)
    ref = reference.backward(*host, None, ref_spec)
    for n, want in (("dq", ref.dq), ("dk", ref.dk), ("dv", ref.dv)):
        _close(f"step {steps - 1} {n}", whole[n], want)
    for _, results, _ in per_rank:
        _close(f"step {steps - 1} d_bias", results[-1][1][3][0], ref.d_captures[wanted[0]])


# -- NCCL, one process per GPU ------------------------------------------------------------------

_NCCL_CASES = [("causal", "ring"), ("documents", "ring"), ("causal", "all_gather"), ("bias", "ring"),
               ("documents", "direct"), ("window", "direct")]


def _nccl_worker(rank, world, port, inputs, results):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        q, k, v, d_out = (x.to(f"cuda:{rank}") for x in inputs)
        seq = q.shape[2]
        got = {}
        for case, schedule in _NCCL_CASES:
            spec, trained = _cases(seq, f"cuda:{rank}")[case]
            layout = tcp.shard_layout(seq, world, mask=spec.mask)
            ql, kl, vl = (tcp.shard(x, layout).requires_grad_(True) for x in (q, k, v))
            out = tcp.flex_attention(ql, kl, vl, score=spec.score, mask=spec.mask, enable_gqa=True,
                                     parallel=tcp.ContextParallel(layout, schedule=schedule))
            (out.float() * tcp.shard(d_out, layout).float()).sum().backward()
            whole = [tcp.unshard(x, layout).float().cpu().numpy() for x in (out.detach(), ql.grad, kl.grad, vl.grad)]
            if trained is not None:
                whole.append(trained.grad.cpu().numpy())
            got[(case, schedule)] = whole
        got[("style", "direct")] = _style_step(rank, world, q, k, v, d_out)
        results.put((rank, got))
    finally:
        dist.destroy_process_group()


def _style_step(rank, world, q, k, v, d_out):
    """torch's parallel-style door on a CUDA DeviceMesh: a module whose forward calls
    ``flexattn.torch.flex_attention`` the torch way (a lambda causal mask through
    ``create_block_mask``, ``block_mask=``), sharded in torch's head-tail order."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    seq = q.shape[2]
    mesh = init_device_mesh("cuda", (world,))
    layout = tcp.head_tail(seq, world)

    class InnerAttention(torch.nn.Module):
        def forward(self, q, k, v, block_mask=None):
            return fa.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)

    attention = parallelize_module(InnerAttention(), mesh, tcp.ContextParallelStyle(layout))
    block_mask = fa.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, seq, seq,
                                      device=f"cuda:{rank}")
    leaves = [tcp.shard(x, layout).requires_grad_(True) for x in (q, k, v)]
    out = attention(*leaves, block_mask=block_mask)
    (out.float() * tcp.shard(d_out, layout).float()).sum().backward()
    return [tcp.unshard(x, layout).float().cpu().numpy() for x in (out.detach(), *(x.grad for x in leaves))]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs or more")
@pytest.mark.parametrize("aside", [False, True], ids=["copies_in_line", "copies_aside"])
def test_nccl_ranks_match_one_gpu(aside, monkeypatch):
    """aside: the direct schedule's sends copied on the high-priority side stream
    (FLEXATTN_CP_STAGE_ASIDE=1, ``TorchOps.aside``; the spawned ranks inherit it)."""
    monkeypatch.setenv("FLEXATTN_CP_STAGE_ASIDE", "1" if aside else "0")
    world = min(torch.cuda.device_count(), 4)
    seq = 4096
    torch.manual_seed(7)
    inputs = [torch.randn(B, H, seq, D, dtype=torch.bfloat16), torch.randn(B, HK, seq, D, dtype=torch.bfloat16),
              torch.randn(B, HK, seq, D, dtype=torch.bfloat16), torch.randn(B, H, seq, D, dtype=torch.bfloat16)]
    got = run_ranks(_nccl_worker, world, (inputs,), timeout=540)
    q, k, v, d_out = (x.cuda() for x in inputs)
    for case, schedule in _NCCL_CASES + [("style", "direct")]:
        spec, trained = _cases(seq, "cuda")["causal" if case == "style" else case]
        qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
        out = fa.flex_attention(qq, kk, vv, score=spec.score, mask=spec.mask, enable_gqa=True)
        (out.float() * d_out.float()).sum().backward()
        expected = [out.detach(), qq.grad, kk.grad, vv.grad] + ([trained.grad] if trained is not None else [])
        for rank in range(world):
            for name, a, b in zip(("out", "dq", "dk", "dv", "d_bias"), got[rank][(case, schedule)], expected):
                b = b.float().cpu().numpy()
                scale = max(np.abs(b).max(), 1e-6)
                err = np.abs(a - b).max()
                assert err <= 3e-2 * scale, f"{case} {schedule} rank {rank} {name}: {err:.3g} (ref {scale:.3g})"


@pytest.mark.parametrize("dtype,dv,own", [(torch.bfloat16, 128, False), (torch.float16, 64, False),
                                          (torch.bfloat16, 80, False), (torch.bfloat16, 256, False),
                                          (torch.bfloat16, 128, True), (torch.float16, 80, True)])
def test_merge_kernel_matches_the_elementwise_merge(dtype, dv, own):
    """The GPU merge of a partial (``kernels.merge.partial``) on strided row views against
    the torch elementwise merge in float64: rows unattended on either side, on both, and
    attended on both; the rows outside the view untouched. ``own``: the accumulator is the
    result's own 16-bit rows (the second of two partials merged straight into it)."""
    from flexattn.torch.context_parallel import _merge_kernel

    g = torch.Generator(device="cuda").manual_seed(dv)
    b, h, s, start, stop = 2, 3, 700, 129, 611
    acc = torch.randn(b, h, s, dv, device="cuda", generator=g)
    if own:
        acc = acc.to(dtype)
    lse = torch.randn(b, h, s, device="cuda", generator=g) * 4
    out = torch.randn(b, h, stop - start, dv, device="cuda", generator=g).to(dtype)
    lse_j = torch.randn(b, h, stop - start, device="cuda", generator=g) * 4
    lse[:, :, start:start + 50] = -torch.inf           # first visit: a copy
    acc[:, :, start:start + 50] = 0
    lse_j[:, :, 40:90] = -torch.inf                     # unattended by the piece (some by both)
    want_acc, want_lse = acc.double().clone(), lse.double().clone()
    tcp._merge_rows(want_acc[:, :, start:stop], want_lse[:, :, start:stop], out.double(), lse_j.double())
    _merge_kernel(acc[:, :, start:stop], lse[:, :, start:stop], out, lse_j)
    torch.cuda.synchronize()
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    live = torch.isfinite(want_lse)
    assert (lse[live].double() - want_lse[live]).abs().max() < 1e-5
    # (16-bit rows: one rounding of the fp32 merge, within an ulp)
    tol = 1e-5 if not own else 2.0 ** -(8 if dtype == torch.bfloat16 else 10)
    assert ((acc.double() - want_acc).abs() / want_acc.abs().clamp(min=1.0)).max() < tol
    assert torch.equal(acc[:, :, :start], want_acc[:, :, :start].to(acc.dtype))
