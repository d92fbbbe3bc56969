"""CPU: how the core plans and feeds the backward kernels (``core.backward_path``) — the
runner is replaced by a recorder, so nothing launches; the arguments are checked."""

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("cutlass")

from flexattn import create_block_mask, mods  # noqa: E402
from flexattn.core import AttentionSpec, check_inputs  # noqa: E402
from flexattn.core.backward_path import BackwardArrays, backward_into  # noqa: E402
from flexattn.core.kernel_path import Device  # noqa: E402
from flexattn.kernels.launch import cache  # noqa: E402
from flexattn.kernels.launch.backward import workspace_dtypes, workspace_shapes  # noqa: E402

B, Hq, Hkv, Q, KV, D = 2, 4, 2, 300, 260, 64


class _Recorder:
    def __init__(self, cfg):
        self.cfg = cfg
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


@pytest.fixture
def runners(monkeypatch):
    made = []

    def backward_runner(cfg, tvm_ffi=False):
        made.append(_Recorder(cfg))
        made[-1].tvm_ffi = tvm_ffi
        return made[-1]

    monkeypatch.setattr(cache, "backward_runner", backward_runner)
    monkeypatch.setenv("FLEXATTN_TVM_FFI", "0")  # the from_dlpack runner (explicit stream); see test_tvm_ffi_*
    return made


def _call(spec, dtype=torch.bfloat16, d_lse=False, bshd=False, deterministic=False, merged_lse=False, d=D):
    def mk(H, S):
        if bshd:  # [B, S, H, D] storage, as the torch adapter may pass
            return torch.zeros(B, S, H, d, dtype=dtype).transpose(1, 2)
        return torch.zeros(B, H, S, d, dtype=dtype)

    q, d_out, out = mk(Hq, Q), torch.zeros(B, Hq, Q, d, dtype=dtype), torch.zeros(B, Hq, Q, d, dtype=dtype)
    k, v = mk(Hkv, KV), mk(Hkv, KV)
    lse = torch.zeros(B, Hq, Q)
    arrays = BackwardArrays(q, k, v, out, lse, d_out, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                            d_lse=torch.zeros(B, Hq, Q) if d_lse else None)
    allocs = []

    def alloc(shape, dtype, zeroed):
        allocs.append((shape, dtype, zeroed))
        return torch.zeros(shape, dtype=getattr(torch, dtype))

    copied = []

    def to_device(x):
        copied.append(x)
        return torch.from_numpy(np.array(x)) if not isinstance(x, torch.Tensor) else x

    result = backward_into(arrays, check_inputs(q, k, v, spec), spec, Device(1234, to_device), alloc,
                           deterministic=deterministic, merged_lse=merged_lse)
    return arrays, result, allocs, copied


def test_band_call_walks_by_arithmetic(runners):
    """A sliding window's block mask (built from its mask alone) runs the band structure:
    no lists passed, unless deterministic (its dQ turns count visitors from the lists)."""
    bm = create_block_mask(mods.sliding_window(100), None, None, Q, KV)
    spec = AttentionSpec.from_args(block_mask=bm, enable_gqa=True)
    _call(spec)
    _call(spec, deterministic=True)
    band, det = runners
    assert band.cfg.band and not band.cfg.block_sparse and band.calls[0][-1] is None
    assert det.cfg.block_sparse and not det.cfg.band and len(det.calls[0][-1]) == 8


def test_block_sparse_call_reads_the_q_side_lists(runners):
    slopes = torch.rand(Hq)
    table = np.random.default_rng(0).standard_normal((Hq, 9))
    score = mods.alibi(slopes) >> mods.softcap(5.0) >> mods.relative_bias(table)
    docs = np.repeat(np.arange(3), -(-max(Q, KV) // 3))[:max(Q, KV)]
    bm = create_block_mask(mods.sliding_window(100) & mods.document(docs), None, None, Q, KV)
    spec = AttentionSpec.from_args(score=score, block_mask=bm, enable_gqa=True, scale=0.2)
    arrays, result, allocs, copied = _call(spec, d_lse=True)
    (runner,) = runners
    assert runner.cfg.block_sparse and not runner.cfg.causal and runner.cfg.key() == result.config.key()
    (args,) = runner.calls
    passed, ws, scale, mod_args, grads, stream, lists = args
    assert passed is arrays and arrays.d_lse is not None
    assert scale == 0.2 and stream == 1234 and len(mod_args) == len(runner.cfg.mods.captures())
    for got, want in zip(lists, (bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices)):
        np.testing.assert_array_equal(got.numpy(), want)
    # workspace uninitialised, buffer gradients zeroed, one per grad slot, shaped like the capture
    dtypes = workspace_dtypes(runner.cfg)
    want_ws = [(s, dtypes[n], False) for n, s in workspace_shapes(runner.cfg, B, Hq, Q).items()]
    assert allocs[:len(want_ws)] == want_ws
    i_slopes, i_table = (next(i for i, c in enumerate(score.captures) if c is x) for x in (slopes, table))
    assert runner.cfg.mods.grad_slots == tuple(sorted((i_slopes, i_table)))
    assert sorted(allocs[len(want_ws):]) == [((Hq,), "float32", True), ((Hq, 9), "float32", True)]
    assert [tuple(g.shape) for g in ws] == [s for s, _, _ in want_ws]
    assert len(grads) == 2 and all(g.dtype == torch.float32 for g in grads)
    # by score capture: the numbers (softcap's, the table's half width) get None
    assert len(result.capture_grads) == len(score.captures)
    assert tuple(result.capture_grads[i_slopes].shape) == (Hq,)
    assert tuple(result.capture_grads[i_table].shape) == (Hq, 9)
    assert {id(g) for g in grads} == {id(result.capture_grads[i]) for i in (i_slopes, i_table)}
    assert all(g is None for i, g in enumerate(result.capture_grads) if i not in (i_slopes, i_table))


def test_causal_and_dense_calls_have_no_lists_and_no_grads(runners):
    for mask, causal in ((mods.causal(), True), (None, False)):
        _, result, allocs, _ = _call(AttentionSpec.from_args(mask=mask, enable_gqa=True), dtype=torch.float16)
        args = runners[-1].calls[0]
        assert result.config.causal == causal and not result.config.block_sparse
        assert result.config.dtype == "fp16" and result.config.head_dim == D
        assert args[4] is None and args[6] is None and args[0].d_lse is None  # grads, lists, d_lse
        # LSE, delta, dq_accum and dq_first_store's tickets (one int32 per q tile)
        assert [a[1] for a in allocs] == ["float32"] * 3 + ["int32"] and result.capture_grads == ()


def test_a_merged_lse_zeroes_every_dq_row(runners, monkeypatch):
    """Context parallelism's chunk pairs read the LSE merged over every chunk: finite in rows
    this pair's mask leaves empty, so no first-visit dQ stores (their preprocess zeroes only
    LSE = -inf rows, and a pair's unvisited tiles kept stale accumulators: sessions 73's
    dQ errors of 0.2 relative in test_context_parallel_gpu.py), nor dq_finish's stores. A
    call's own LSE keeps them."""
    monkeypatch.delenv("FLEXATTN_DQ_FIRST_STORE", raising=False)
    docs = np.repeat(np.arange(3), -(-max(Q, KV) // 3))[:max(Q, KV)]
    for mask in (mods.causal(), mods.sliding_window(100), mods.document(docs) & mods.causal()):
        spec = AttentionSpec.from_args(mask=mask, enable_gqa=True)
        (_, own, own_allocs, _), (_, merged, merged_allocs, _) = _call(spec), _call(spec, merged_lse=True)
        assert own.config.dq_first_store and not merged.config.dq_first_store, mask
        assert own.config.key() != merged.config.key()
        assert dataclasses.replace(own.config, dq_first_store=False, dq_ticket_on_data=False) == merged.config
        assert "int32" in [a[1] for a in own_allocs] and "int32" not in [a[1] for a in merged_allocs]
    # dq_finish (an A/B setting; 64-row visits: head dim 128) rests on the same ground
    monkeypatch.setenv("FLEXATTN_DQ_FINISH", "1")
    spec = AttentionSpec.from_args(mask=mods.causal(), enable_gqa=True)
    (_, own, _, _), (_, merged, _, _) = _call(spec, d=128), _call(spec, merged_lse=True, d=128)
    assert own.config.dq_finish and not (merged.config.dq_finish or merged.config.dq_first_store)


def test_zero_dim_capture_gradient_is_passed_as_one_element(runners):
    t = torch.tensor(0.5)
    _, result, allocs, _ = _call(AttentionSpec.from_args(score=mods.score_mod(lambda s, b, h, q, kv: s * t),
                                                         enable_gqa=True))
    grads = [a for a in allocs if a[2]]        # (the zeroed allocations; the workspace is not)
    assert grads == [((1,), "float32", True)] and tuple(result.capture_grads[0].shape) == (1,)


def test_what_the_kernel_cannot_do_is_refused(runners):
    with pytest.raises(ValueError, match="bfloat16, float16 and float32"):
        _call(AttentionSpec.from_args(enable_gqa=True), dtype=torch.float64)
    with pytest.raises(ValueError, match="no deterministic mode"):   # float32's dQ: fp32 atomics
        _call(AttentionSpec.from_args(enable_gqa=True), dtype=torch.float32, deterministic=True)
    assert not runners


def test_float32_plans_the_float32_kernel(runners):
    """float32 runs bwd/tf32_sync.py's kernel with the Device's tf32 passes (3: the default,
    torch's "highest"), 32-row visits of 64-key CTAs, and a plain workspace."""
    _, result, allocs, _ = _call(AttentionSpec.from_args(score=mods.softcap(20.0), mask=mods.causal(),
                                                         enable_gqa=True), dtype=torch.float32)
    cfg = result.config
    assert (cfg.dtype, cfg.tf32_passes, cfg.tile_m, cfg.tile_n, cfg.causal) == ("fp32", 3, 32, 64, True)
    assert [a[1] for a in allocs[:3]] == ["float32"] * 3


def test_every_adapters_backward_plan_refuses_what_is_not_verified():
    """backward_config (JAX's and CuPy's backward plans too, not only the torch door)
    refuses head dim 16, query's or value's, and accepts every other the forward takes,
    value head dims apart from the query's included; beyond 128 the config splits the head
    dim between the warpgroups (64-key CTAs) or swaps dK / dV (96-key CTAs)."""
    from flexattn.core.backward_path import backward_config
    from flexattn.kernels.fwd.sm90 import FwdConfig

    assert not backward_config(FwdConfig(head_dim=96)).split_head_dim
    backward_config(FwdConfig(head_dim=128, head_dim_v=64))
    for kw in (dict(head_dim=192, head_dim_v=128), dict(head_dim=128, head_dim_v=192), dict(head_dim=256)):
        cfg = backward_config(FwdConfig(**kw))
        # the swapped layout where bwd.plan.SWAP_PLANNED names the head dims: 96 keys at 192/128
        # and 128/192, 48 at 256/256 (two Q stages, one dO stage)
        tile_n = {(192, 128): 96, (128, 192): 96, (256, 256): 48}[kw["head_dim"], kw.get("head_dim_v", kw["head_dim"])]
        assert cfg.split_head_dim and cfg.tile_n == tile_n and cfg.tile_m == 64 and cfg.dkv_swap
    assert backward_config(FwdConfig(head_dim=256)).num_stages == 2 and backward_config(FwdConfig(head_dim=256)).do_ring == 1
    assert backward_config(FwdConfig(head_dim=192, head_dim_v=128)).num_stages == 2
    assert backward_config(FwdConfig(head_dim=192)).do_ring == 1     # 192/192: FA4's rings (96 keys)
    assert backward_config(FwdConfig(head_dim=144)).tile_n == 64     # not planned: the split layout
    for kw in (dict(head_dim=16), dict(head_dim=64, head_dim_v=16)):
        with pytest.raises(ValueError, match="backward supports query and value head dims"):
            backward_config(FwdConfig(**kw))


def test_arguments_pass_the_real_runners_checks(runners):
    """The recorded call, given to a real ``BackwardRunner``: validated and compiled on
    these CPU tensors (CUTE_DSL_ARCH=sm_90a), not launched (~10 s)."""
    from flexattn.kernels.launch.backward import BackwardRunner

    score = mods.alibi(torch.rand(Hq)) >> mods.softcap(5.0)
    docs = np.repeat(np.arange(3), -(-max(Q, KV) // 3))[:max(Q, KV)]
    bm = create_block_mask(mods.sliding_window(100) & mods.document(docs), None, None, Q, KV)
    spec = AttentionSpec.from_args(score=score, block_mask=bm, enable_gqa=True)
    _call(spec, d_lse=True, bshd=True)
    (recorder,) = runners
    real = BackwardRunner(recorder.cfg)
    assert callable(real.bind(*recorder.calls[0]))
    # preprocess, main and postprocess (dQ finished by the main kernel: not planned)
    assert not recorder.cfg.dq_finish and real.num_compiled == 3


def test_deterministic_call_adds_integer_workspace_and_kv_side_lists(runners):
    """deterministic=True: the config says so, the workspace has its int32 dQ semaphores and
    int64 fixed-point buffer-gradient accumulators, and block-sparse calls also pass the
    kv-side lists (a CTA counts the kv blocks ahead of it in a q tile's list)."""
    from flexattn.kernels.bwd.plan import workspace_dtypes

    slopes = torch.rand(Hq)
    bm = create_block_mask(mods.sliding_window(100), None, None, Q, KV)
    spec = AttentionSpec.from_args(score=mods.alibi(slopes), block_mask=bm, enable_gqa=True)
    _, result, allocs, _ = _call(spec, deterministic=True)
    (runner,) = runners
    assert runner.cfg.deterministic and result.config.deterministic
    (args,) = runner.calls
    ws, lists = args[1], args[6]
    dtypes = workspace_dtypes(runner.cfg)
    assert [str(w.dtype).replace("torch.", "") for w in ws] == list(dtypes.values())
    assert {"int32", "int64"} <= set(dtypes.values())
    assert len(lists) == 8
    for got, want in zip(lists, (bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices,
                                 bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)):
        np.testing.assert_array_equal(got.numpy(), want)


def test_grad_captures_limit_the_buffer_gradients(runners):
    """Only the wanted captures are differentiated (e.g. the tensors that require grad):
    the kernel config's grad slots, the allocated gradients and the result shrink alike,
    and the filter is part of the compile key."""
    slopes = torch.rand(Hq)
    table = np.random.default_rng(0).standard_normal((Hq, 9))
    score = mods.alibi(slopes) >> mods.relative_bias(table)
    spec = AttentionSpec.from_args(score=score, mask=mods.causal(), enable_gqa=True)
    i_slopes, i_table = (next(i for i, c in enumerate(score.captures) if c is x) for x in (slopes, table))
    q = torch.zeros(B, Hq, Q, D, dtype=torch.bfloat16)
    k = torch.zeros(B, Hkv, KV, D, dtype=torch.bfloat16)
    shape = check_inputs(q, k, k, spec)

    def call(grad_captures):
        arrays = BackwardArrays(q, k, k, q, torch.zeros(B, Hq, Q), q, torch.empty_like(q), torch.empty_like(k),
                                torch.empty_like(k))
        allocs = []

        def alloc(shape_, dtype, zeroed):
            allocs.append((shape_, zeroed))
            return torch.zeros(shape_, dtype=getattr(torch, dtype))

        to_device = lambda x: x if isinstance(x, torch.Tensor) else torch.from_numpy(np.array(x))  # noqa: E731
        result = backward_into(arrays, shape, spec, Device(0, to_device), alloc, grad_captures=grad_captures)
        return result, [a for a in allocs if a[1]]

    everything, grads_all = call(None)
    assert everything.config.mods.grad_slots == tuple(sorted((i_slopes, i_table))) and len(grads_all) == 2
    only_slopes, grads_one = call((i_slopes,))
    assert only_slopes.config.mods.grad_slots == (i_slopes,) and grads_one == [((Hq,), True)]
    assert only_slopes.capture_grads[i_table] is None and only_slopes.capture_grads[i_slopes] is not None
    nothing, grads_none = call(())
    assert nothing.config.mods.grad_slots == () and not nothing.config.buffer_grads and grads_none == []
    keys = {r.config.key() for r in (everything, only_slopes, nothing)}
    assert len(keys) == 3


def test_torch_maps_the_grad_mask_onto_capture_slots():
    import flexattn.torch.launches as fa_launches

    slopes, bias = torch.rand(Hq), torch.rand(Hq, Q, KV)
    score = mods.alibi(slopes) >> mods.bias(bias)
    spec = AttentionSpec.from_args(score=score)
    tensor_slots = [i for i, c in enumerate(score.captures) if isinstance(c, torch.Tensor)]
    assert fa_launches._grad_captures(spec, 0b11) == tuple(tensor_slots)
    assert fa_launches._grad_captures(spec, 0b10) == (tensor_slots[1],)
    assert fa_launches._grad_captures(spec, 0) == ()


def test_tvm_ffi_call_passes_framework_tensors_and_compiles(runners, monkeypatch):
    """Where TVM-FFI is installed, the backward launches through ``FfiBackwardRunner``: the
    same arrays without a stream (TVM-FFI's environment stream is set around the launch),
    captures as TVM-FFI arguments; a real runner given the recorded call compiles its three
    kernels for those signatures, and refuses CPU tensors with the compiled signature."""
    pytest.importorskip("tvm_ffi")
    from flexattn.kernels.launch.backward import FfiBackwardRunner

    monkeypatch.setenv("FLEXATTN_TVM_FFI", "1")
    score = mods.alibi(torch.rand(Hq)) >> mods.softcap(5.0)
    docs = np.repeat(np.arange(3), -(-max(Q, KV) // 3))[:max(Q, KV)]
    bm = create_block_mask(mods.sliding_window(100) & mods.document(docs), None, None, Q, KV)
    spec = AttentionSpec.from_args(score=score, block_mask=bm, enable_gqa=True, scale=0.2)
    arrays, result, allocs, copied = _call(spec, d_lse=True, bshd=True)
    (recorder,) = runners
    assert recorder.tvm_ffi
    (args,) = recorder.calls
    passed, ws, scale, mod_args, grads, lists = args
    assert passed is arrays and scale == 0.2
    assert torch.Tensor in {type(a) for a in mod_args} and float in {type(a) for a in mod_args}
    real = FfiBackwardRunner(recorder.cfg)
    with pytest.raises(ValueError, match="expected device_type=cuda"):
        real.run(*args)
    assert real.num_compiled == (2 if recorder.cfg.dq_finish else 3)
    with pytest.raises(ValueError, match="workspace dq_accum"):
        real.run(arrays, ws[:2] + (ws[2][:, :, :8],) + ws[3:], scale, mod_args, grads, lists)
    with pytest.raises(ValueError, match="block_sparse"):
        real.run(arrays, ws, scale, mod_args, grads, lists[:3])


def test_both_runners_share_the_q_kv_shape_check():
    from flexattn.kernels.launch.backward import check_q_and_kv_shapes

    check_q_and_kv_shapes((2, 8, 5, 64), (2, 2, 7, 64))
    for q_shape, k_shape, words in (((1, 4, 8, 64), (2, 2, 8, 64), "batch must match"),
                                    ((1, 4, 8, 64), (1, 3, 8, 64), "multiple of Hkv"),
                                    ((1, 4, 8, 64), (1, 0, 8, 64), "multiple of Hkv"),
                                    ((1, 4, 0, 64), (1, 2, 8, 64), "empty sequences")):
        with pytest.raises(ValueError, match=words):
            check_q_and_kv_shapes(q_shape, k_shape)


def test_a_prepared_backward_skips_the_per_step_checks(monkeypatch):
    """``PreparedBackward.launch``: a repeated step's shapes are the prepared call's,
    checked when it was prepared, so the runner skips its ``check`` (``checked=True``); a
    compiled graph's call with new operand arrays is still checked."""
    from flexattn.core.backward_path import PreparedBackward
    from flexattn.core.kernel_path import plan_forward

    calls = []

    class Runner:
        def kernels(self, with_dlse):
            return None

        def run(self, *args, checked=False, outputs=None):
            calls.append(checked)

    monkeypatch.setattr(cache, "backward_runner", lambda cfg, tvm_ffi=False: Runner())
    slopes = torch.rand(Hq)
    spec = AttentionSpec.from_args(score=mods.alibi(slopes), mask=mods.causal(), enable_gqa=True)
    q, k, v = torch.zeros(B, Hq, Q, D), torch.zeros(B, Hkv, KV, D), torch.zeros(B, Hkv, KV, D)
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    shape = check_inputs(q, k, v, spec)
    prepared = PreparedBackward(plan_forward(q, shape, spec), spec, shape, Device(1234, lambda x: torch.as_tensor(x)),
                                False, None)
    arrays = BackwardArrays(q, k, v, torch.zeros(B, Hq, Q, D, dtype=torch.bfloat16), torch.zeros(B, Hq, Q),
                            torch.zeros(B, Hq, Q, D, dtype=torch.bfloat16), torch.empty_like(q), torch.empty_like(k),
                            torch.empty_like(v))
    alloc = lambda s, dtype, zeroed: torch.zeros(s, dtype=getattr(torch, dtype))   # noqa: E731
    prepared.launch(arrays, alloc)
    positions = prepared.operand_positions((slopes,))
    prepared.launch(arrays, alloc, (torch.rand(Hq),), positions)
    assert calls == [True, False]


@pytest.mark.parametrize("dq_finish", [False, True])
def test_outputs_allocated_after_the_preprocess_launch(dq_finish):
    """``FfiBackwardRunner.run(outputs=)``: dq, dk, dv come from the callable once the
    preprocess is launched (so a host-bound step's allocations overlap its GPU work), and
    the main kernel and the postprocess write those; under dq_finish, whose preprocess
    zeroes dQ's empty rows, before it."""
    from flexattn.kernels.bwd.sm90 import BwdConfig
    from flexattn.kernels.launch.backward import FfiBackwardRunner

    runner = FfiBackwardRunner(BwdConfig(head_dim=64, dq_finish=dq_finish))
    events = []
    fresh = ("dq", "dk", "dv")
    pre = lambda *a: events.append(("pre", a[8]))                    # noqa: E731  (a[8]: dQ under dq_finish)
    main = lambda *a: events.append(("main", a[8:11]))               # noqa: E731  (dq_out, dk, dv)
    post = lambda *a: events.append(("post", a[1]))                  # noqa: E731
    runner.kernels = lambda with_dlse: (pre, main, None if dq_finish else post)
    arrays = BackwardArrays(*(object() for _ in range(6)), None, None, None)
    workspace = (object(), object(), object())
    runner.run(arrays, workspace, 1.0, (), None, checked=True,
               outputs=lambda: events.append(("outputs", None)) or fresh)
    if dq_finish:
        assert events == [("outputs", None), ("pre", "dq"), ("main", fresh)]
    else:
        assert events == [("pre", None), ("outputs", None), ("main", (None, "dk", "dv")), ("post", "dq")]
