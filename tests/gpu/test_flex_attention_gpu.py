"""GPU: the public path (mods → IR → CuTeDSL forward) against the float64 reference.

224 randomized cases: every mod of tests/mod_cases.py (none, causal, sliding window,
document, prefix-LM, ALiBi, softcap, relative bias, dense bias, combinations, a custom
torch-style function) × random shapes (odd lengths, Q != KV, GQA/MQA) × (bf16, D128) /
(fp16, D64). Outputs are NaN-poisoned before each launch (destination-passing core);
LSE is checked too. Plus: changing captured values never recompiles; the torch adapter
end to end; clear errors for what the kernel cannot do.
"""

import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")

import flexattn  # noqa: E402
import flexattn.torch as fa  # noqa: E402
import flexattn.torch.attention as fa_attention  # noqa: E402
from flexattn import mods, reference  # noqa: E402
from flexattn.core import AttentionSpec, check_inputs  # noqa: E402
from flexattn.core.kernel_path import forward_into  # noqa: E402
from flexattn.kernels.launch import cache  # noqa: E402

from forward_check import TOL, check_forward, torch_device  # noqa: E402
from mod_cases import CASES  # noqa: E402

CONFIGS = [(torch.bfloat16, 128), (torch.float16, 64)]
CASES_PER_MOD = 16


def _random_problem(rng, dtype, D):
    B = int(rng.integers(1, 3))
    Hkv = int(rng.choice([1, 2, 4]))
    Hq = Hkv * int(rng.choice([1, 2, 4]))
    Q = int(rng.integers(1, 700))
    KV = Q if rng.random() < 0.4 else int(rng.integers(1, 700))
    q = torch.randn(B, Hq, Q, D, device="cuda", dtype=dtype)
    k = torch.randn(B, Hkv, KV, D, device="cuda", dtype=dtype)
    v = torch.randn(B, Hkv, KV, D, device="cuda", dtype=dtype)
    return B, Hq, Q, KV, q, k, v


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{str(c[0])[6:]}-d{c[1]}")
@pytest.mark.parametrize("case", sorted(CASES))
def test_randomized_against_reference(case, config):
    dtype, D = config
    rng = np.random.default_rng(zlib.crc32(repr((case, D)).encode()))
    torch.manual_seed(int(rng.integers(0, 2**31)))
    for i in range(CASES_PER_MOD // len(CONFIGS)):
        B, Hq, Q, KV, q, k, v = _random_problem(rng, dtype, D)
        mask, score, _, _ = CASES[case](rng, B, Hq, Q, KV)
        scale = float(rng.uniform(0.05, 0.3)) if rng.random() < 0.3 else None
        spec = AttentionSpec.from_args(score=score, mask=mask, scale=scale, enable_gqa=True)
        check_forward(f"{case}#{i} B{B} Hq{Hq} Hkv{k.shape[1]} Q{Q} KV{KV}", q, k, v, spec)


@pytest.mark.parametrize("case", ["causal_softcap", "window_document_alibi_softcap", "document_batched", "custom_function"])
def test_tvm_ffi_launch_matches_reference(case, monkeypatch):
    """The opt-in TVM-FFI launch path (FLEXATTN_TVM_FFI=1) computes the same results."""
    pytest.importorskip("tvm_ffi")
    monkeypatch.setenv("FLEXATTN_TVM_FFI", "1")
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    for dtype, D in CONFIGS:
        B, Hq, Q, KV, q, k, v = _random_problem(rng, dtype, D)
        mask, score, _, _ = CASES[case](rng, B, Hq, Q, KV)
        check_forward(f"ffi {case}", q, k, v, AttentionSpec.from_args(score=score, mask=mask, enable_gqa=True))


def test_new_values_never_recompile():
    rng = np.random.default_rng(5)
    B, Hq, Q, KV = 1, 4, 300, 300
    q, k, v = (torch.randn(B, Hq, Q, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    variants = [
        (mods.softcap(10.0), mods.sliding_window(40) & mods.document(np.sort(rng.integers(0, 3, KV)))),
        (mods.softcap(25.0), mods.sliding_window(200) & mods.document(np.sort(rng.integers(0, 5, KV)))),
        (mods.softcap(3.0), mods.sliding_window(7) & mods.document(np.zeros(KV, dtype=np.int64))),
    ]
    counts = []
    for score, mask in variants:
        check_forward("values", q, k, v, AttentionSpec.from_args(score=score, mask=mask))
        counts.append(cache.compile_count())
    assert counts[0] == counts[1] == counts[2]


def test_torch_adapter_cuda_end_to_end():
    q, k, v = (torch.randn(2, 8, 333, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    bm = fa.create_block_mask(mods.causal() & mods.sliding_window(100), None, None, 333, 333)
    out, lse = fa.flex_attention(q, k, v, score_mod=mods.alibi(num_heads=8), block_mask=bm, return_lse=True)
    assert out.is_cuda and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want = fa.flex_attention(q.cpu().double(), k.cpu().double(), v.cpu().double(),
                             score_mod=mods.alibi(num_heads=8), block_mask=bm)
    assert (out.double().cpu() - want).abs().max() < 2.5e-2
    out.float().square().sum().backward()  # backward: reference on the host until the kernel lands
    assert q.grad is not None and q.grad.is_cuda and torch.isfinite(q.grad.float()).all()


def test_kernel_limits_are_clear_errors():
    q = torch.randn(1, 2, 64, 72, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiples of 16"):
        fa.flex_attention(q, q, q)
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.float64)
    with pytest.raises(ValueError, match="bfloat16, float16 and float32"):
        fa.flex_attention(q, q, q)


@pytest.mark.parametrize("kind", ["window from its mask", "causal from its mask", "lists of their own"])
@pytest.mark.parametrize("block_size", [64, (64, 32), (128, 64), 256])
def test_block_masks_at_any_block_size(kind, block_size):
    """Block masks at another BLOCK_SIZE than the kernels' 128 x 128 run with torch's
    meaning (blockmask/coarsen.py: lists of their own read on the kernels' tiles through a
    table of their states), forward and backward, against float64."""
    B, H, Q, D = 2, 4, 333, 64
    doc = torch.repeat_interleave(torch.arange(5), torch.tensor([60, 13, 100, 80, 80])).to(torch.int32)
    mask = {"window from its mask": mods.sliding_window(40), "causal from its mask": mods.causal(),
            "lists of their own": mods.document(doc.numpy())}[kind]
    bm = fa.create_block_mask(mask, B, H, Q, Q, BLOCK_SIZE=block_size)
    if kind == "lists of their own":   # the same lists, given as lists (not from the mask alone)
        g = torch.Generator().manual_seed(1)
        drop = torch.rand(bm.kv_num_blocks.shape, generator=g) < 0.3   # some rows attend fewer tiles
        num = torch.as_tensor(bm.kv_num_blocks).cpu()   # (built on the GPU: torch's default device)
        counts = torch.where(drop, torch.clamp(num - 1, min=0), num).to(torch.int32)
        bm = fa.BlockMask.from_kv_blocks(counts, *(torch.as_tensor(x).cpu() for x in (bm.kv_indices, bm.full_kv_num_blocks,
                                                                                    bm.full_kv_indices)),
                                         BLOCK_SIZE=bm.BLOCK_SIZE,
                                         mask_mod=bm.mask_mod, seq_lengths=(Q, Q))
    q, k, v, d_out = (torch.randn(B, H, Q, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    spec = AttentionSpec.from_args(block_mask=bm)
    host = [x.double().cpu().numpy() for x in (q, k, v, d_out)]
    want, _ = reference.forward(*host[:3], spec)
    grads = reference.backward(*host, None, spec)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = fa.flex_attention(*leaves, block_mask=bm)
    out.backward(d_out)
    for name, got, ref in (("out", out, want), ("dq", leaves[0].grad, grads.dq), ("dk", leaves[1].grad, grads.dk),
                           ("dv", leaves[2].grad, grads.dv)):
        err = np.abs(got.detach().double().cpu().numpy() - ref).max()
        assert err <= 3e-2 * max(np.abs(ref).max(), 1e-3), f"{kind} {block_size} {name}: {err:.3g}"


@pytest.mark.parametrize("q_len", [1, 5, 16])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_cuda_matches_reference(q_len, paged):
    """Decode through the forward kernel (no split-KV yet): true positions, GQA, caches."""
    rng = np.random.default_rng(q_len + 10 * paged)
    B, Hq, Hkv, cap, D, page = 3, 16, 4, 1024, 128, 64
    lengths = torch.from_numpy(rng.integers(q_len, cap + 1, size=B)).int().cuda()
    k = torch.randn(B, Hkv, cap, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cache = fa.KVCache(k, v, lengths)
    if paged:
        table = torch.randperm(B * cap // page, device="cuda").int().view(B, cap // page)
        kp = torch.empty(B * cap // page, page, Hkv, D, device="cuda", dtype=torch.bfloat16)
        vp = torch.empty_like(kp)
        paged_cache = fa.PagedKVCache(kp, vp, table, lengths.clone())
        for b in range(B):
            paged_cache.assign(b, np.arange(cap), k[b], v[b])
        cache = paged_cache
    q = torch.randn(B, Hq, q_len, D, device="cuda", dtype=torch.bfloat16)
    score, mask = mods.alibi(num_heads=Hq), mods.sliding_window(300)
    out = fa.decode(q, cache, score_mod=score, mask=mask)
    want = fa.decode(q.cpu().double(), fa.KVCache(k.cpu().double(), v.cpu().double(), lengths.cpu()),
                     score_mod=score, mask=mask)
    assert (out.double().cpu() - want).abs().max() < 2.5e-2


# ----------------------------------------------------------------- repeated eager calls
def _torch_ref(q, k, v, **kw):
    return fa.flex_attention(q.cpu().double(), k.cpu().double(), v.cpu().double(), **kw)


def test_repeated_calls_take_the_prepared_path_and_stay_right():
    """From the second sighting on, a repeated inference call skips checks and planning
    (fa_attention._PREPARED); fresh inputs every call, results against the reference each time."""
    pytest.importorskip("tvm_ffi")
    fa_attention._PREPARED.clear()
    slopes = torch.rand(4, device="cuda")
    score = mods.alibi(slopes)
    bm = fa.create_block_mask(mods.causal() & mods.sliding_window(70), None, None, 300, 300)
    for i in range(4):
        q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.float16) for _ in range(3))
        slopes.copy_(torch.rand(4, device="cuda"))      # in-place update: must be seen
        out, lse = fa.flex_attention(q, k, v, score_mod=score, block_mask=bm, return_lse=True)
        want, want_lse = _torch_ref(q, k, v, score_mod=mods.alibi(slopes.cpu()), block_mask=bm, return_lse=True)
        assert (out.double().cpu() - want).abs().max() < 5e-3, i
        assert (lse.double().cpu() - want_lse).abs().max() < 2e-3, i
        assert len(fa_attention._PREPARED._entries) == (1 if i >= 1 else 0)
    # another layout (strides) or dtype is another entry, not a wrong hit
    qt = torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.float16).transpose(1, 2)
    for _ in range(2):
        out = fa.flex_attention(qt, k, v, score_mod=score, block_mask=bm)
    assert (out.double().cpu() - _torch_ref(qt, k, v, score_mod=mods.alibi(slopes.cpu()), block_mask=bm)).abs().max() < 5e-3
    assert len(fa_attention._PREPARED._entries) == 2
    # entries die with the mod objects they were keyed by (and release their captures)
    del score
    import gc
    gc.collect()
    assert len(fa_attention._PREPARED._entries) == 0


def test_prepared_path_leaves_recorded_calls_to_autograd():
    pytest.importorskip("tvm_ffi")
    slopes = torch.rand(2, device="cuda", requires_grad=True)
    score = mods.alibi(slopes)
    q, k, v = (torch.randn(1, 2, 200, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        for _ in range(3):
            fa.flex_attention(q, k, v, score_mod=score)
    out = fa.flex_attention(q, k, v, score_mod=score)     # grad mode on, trainable slopes
    assert out.grad_fn is not None
    out.float().sum().backward()
    assert slopes.grad is not None and torch.isfinite(slopes.grad).all()


@pytest.mark.parametrize("kind", ["documents+alibi", "causal-det"])
def test_repeated_training_steps_take_the_prepared_path(kind, monkeypatch):
    """Training steps repeat through the prepared forward and backward (no checks, no
    planning after the second sighting and the first prepared backward), with fresh inputs
    and in-place updated captures each step: gradients of q, k, v and the trainable slopes
    against the float64 reference every step. Switching torch's deterministic setting or
    which captures need gradients goes back through the full path once, then is prepared
    again; entries still die with their mods."""
    pytest.importorskip("tvm_ffi")
    fa_attention._PREPARED.clear()
    full = {"check": 0, "backward": 0}
    for name, key in (("_checked_call", "check"), ("_kernel_backward", "backward")):
        def counted(*a, _f=getattr(fa_attention, name), _k=key, **kw):
            # (the CPU reference takes _checked_call too; _kernel_backward is CUDA's alone)
            full[_k] += 1 if _k == "backward" else a[0].is_cuda
            return _f(*a, **kw)
        monkeypatch.setattr(fa_attention, name, counted)
    slopes = torch.rand(4, device="cuda", requires_grad=True)
    score = mods.alibi(slopes)
    S = 333
    if kind == "documents+alibi":
        ids = np.sort(np.random.default_rng(0).integers(0, 3, S)).astype(np.int32)
        call = dict(score_mod=score, block_mask=fa.create_block_mask(mods.document(ids), None, None, S, S))
    else:
        call = dict(score_mod=score, mask=mods.causal())
    if kind.endswith("-det"):
        torch.use_deterministic_algorithms(True)
    try:
        for i in range(6):
            if i == 4:   # the slopes leave training: another gradient mask
                slopes.requires_grad_(False)
            q, k, v = (torch.randn(2, 4, S, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            with torch.no_grad():
                slopes.copy_(torch.rand(4, device="cuda"))
            out = fa.flex_attention(q, k, v, **call)
            d_out = torch.randn_like(out)
            inputs = (q, k, v) + ((slopes,) if slopes.requires_grad else ())
            grads = torch.autograd.grad(out, inputs, d_out)
            # against the float64 reference; the slopes' gradient given the kernel's output
            # (as tests/gpu/test_autograd_gpu.py: it sums over every score)
            spec = AttentionSpec.from_args(score, call.get("block_mask"), None, False, call.get("mask"), None)
            qc, kc, vc = (t.detach().cpu() for t in (q, k, v))
            want = reference.backward(qc, kc, vc, d_out.cpu(), None, spec=spec, out=out.detach().cpu())
            for g, w in zip(grads, (want.dq, want.dk, want.dv) + ((want.d_captures[0],) if len(grads) > 3 else ())):
                g, w = g.double().cpu().numpy(), np.asarray(w, dtype=np.float64)
                rel = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-12)
                assert np.abs(g - w).max() <= 4e-2 * np.abs(w).max() and rel <= 1.5e-2, (i, g.shape, rel)
            # steps 0, 1: the full path (the second sighting prepares the forward); 2: the
            # prepared forward, a full backward that prepares the backward; 3: prepared
            # throughout; 4: a new gradient mask: one full backward again; 5: prepared
            assert full["check"] == min(i + 1, 2), (i, full)
            assert full["backward"] == [1, 2, 3, 3, 4, 4][i], (i, full)
    finally:
        torch.use_deterministic_algorithms(False)
    del score, call, spec, out   # (the last step's graph holds its call)
    import gc
    gc.collect()
    assert len(fa_attention._PREPARED._entries) == 0


def test_bounds_checked_debug_mode_on_the_gpu():
    """With flexattn.check_bounds(), a CUDA call whose score mod reads past its table is an
    IndexError naming the read before any launch, repeated or not; in range it runs the
    kernel and matches the unchecked call."""
    bias = torch.randn(4, 2 * 200 - 2, device="cuda")    # one short for q - kv + 199
    q, k, v = (torch.randn(1, 4, 200, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def relative(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + 199]

    ok = mods.alibi(torch.rand(4, device="cuda"))
    want = fa.flex_attention(q, k, v, score_mod=ok)
    with flexattn.check_bounds():
        for _ in range(3):   # repeated: the prepared path declines while checking
            with pytest.raises(IndexError, match=r"relative.*index 398 along dim 1.*q=199, kv=0"):
                fa.flex_attention(q, k, v, score_mod=relative)
            torch.testing.assert_close(fa.flex_attention(q, k, v, score_mod=ok), want)


def test_cuda_graph_capture_and_replay():
    """A warmed-up call (compiled, prepared) is captured into a CUDA graph; replays
    recompute from whatever the static inputs hold, mods' captured tensors included."""
    q, k, v = (torch.randn(2, 4, 257, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    slopes = torch.rand(4, device="cuda")
    score, mask = mods.alibi(slopes), mods.causal()
    bm = fa.create_block_mask(mods.causal() & mods.sliding_window(100), None, None, 257, 257)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(3):  # compile, then the prepared path
            fa.flex_attention(q, k, v, score_mod=score, mask=mask)
            fa.flex_attention(q, k, v, block_mask=bm)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out_a = fa.flex_attention(q, k, v, score_mod=score, mask=mask)
        out_b = fa.flex_attention(q, k, v, block_mask=bm)
    for _ in range(2):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        slopes.copy_(torch.rand(4, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        want_a = _torch_ref(q, k, v, score_mod=mods.alibi(slopes.cpu()), mask=mods.causal())
        want_b = _torch_ref(q, k, v, block_mask=bm)
        assert (out_a.double().cpu() - want_a).abs().max() < 2.5e-2
        assert (out_b.double().cpu() - want_b).abs().max() < 2.5e-2


def test_band_tile_tickets_at_the_door():
    """A torch-style sliding window with two rounds of tiles (9 q tiles x 34 heads on 132
    SMs) runs its band's persistent CTAs by tile tickets: right on the full path, on the
    prepared repeats (a counter per launch) and in a CUDA graph's replays."""
    from flexattn.core.kernel_path import plan_forward

    q, k, v = (torch.randn(1, 34, 1100, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= 300) & (q_idx >= kv_idx)

    bm = fa.create_block_mask(window, None, None, 1100, 1100, device="cuda")
    spec = AttentionSpec.from_args(block_mask=bm)
    assert plan_forward(q, check_inputs(q, k, v, spec), spec).config.tile_tickets   # (132 SMs)
    want = _torch_ref(q, k, v, block_mask=fa.create_block_mask(window, None, None, 1100, 1100))
    outs = []
    with torch.no_grad():
        for _ in range(4):   # the full path, then prepared launches
            outs.append(fa.flex_attention(q, k, v, block_mask=bm))
    torch.cuda.synchronize()
    assert (outs[0].double().cpu() - want).abs().max() < 2.5e-2
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = fa.flex_attention(q, k, v, block_mask=bm)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("bounds, clusters, partial", [((512, 768, 1536), True, False),
                                                       ((512, 640, 1536), False, False),
                                                       ((512, 700, 1536), False, True)])
def test_document_block_mask_runs_clusters_where_row_pairs_match(bounds, clusters, partial, monkeypatch):
    """Documents on 256-token boundaries: once the GPU-built mask's states reached the host,
    the two CTAs of a cluster walk identical lists and share K/V loads (cluster_m 2), with
    results bitwise equal to the one-CTA walk; a boundary inside a pair of q blocks keeps
    one CTA per tile. Boundaries on 128-token tiles leave no partial tile: the kernel walks
    the full list alone, without the mask (FwdConfig.partial_blocks); one inside a tile
    keeps both."""
    from flexattn.core.kernel_path import plan_forward

    torch.manual_seed(len(bounds) + bounds[1])
    S = 2048
    q, k, v = (torch.randn(2, 4, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    doc_cpu = torch.bucketize(torch.arange(S), torch.tensor(bounds), right=True)
    doc = doc_cpu.cuda()

    def document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    bm = fa.create_block_mask(document, None, None, S, S, device="cuda")
    torch.cuda.synchronize()   # the states' host copy has landed
    spec = AttentionSpec.from_args(block_mask=bm)
    cfg = plan_forward(q, check_inputs(q, k, v, spec), spec).config
    assert cfg.block_sparse and cfg.cluster_m == (2 if clusters else 1)
    assert cfg.partial_blocks == cfg.mods.has_mask == partial
    monkeypatch.setenv("FLEXATTN_LIST_CLUSTERS", "0")
    assert plan_forward(q, check_inputs(q, k, v, spec), spec).config.cluster_m == 1
    fa_attention._PREPARED.clear()
    with torch.no_grad():
        one_cta = fa.flex_attention(q, k, v, block_mask=bm)
        monkeypatch.delenv("FLEXATTN_LIST_CLUSTERS")
        fa_attention._PREPARED.clear()
        outs = [fa.flex_attention(q, k, v, block_mask=bm) for _ in range(3)]   # full path, then prepared
    torch.cuda.synchronize()
    want = _torch_ref(q, k, v, block_mask=fa.create_block_mask(
        lambda b, h, q_idx, kv_idx: doc_cpu[q_idx] == doc_cpu[kv_idx], None, None, S, S))
    assert (outs[0].double().cpu() - want).abs().max() < 2.5e-2
    assert all(torch.equal(o, one_cta) for o in outs)


def test_full_tiles_listed_as_partial_keep_the_partial_walk():
    """create_block_mask(separate_full_blocks=False) on the GPU lists every visited tile as
    partial while its tile states still say full: with documents on tile boundaries (no
    partial state) the planner must still walk the partial lists (and evaluate the mask),
    not plan the full-only walk over empty full lists."""
    from flexattn.core.kernel_path import plan_forward

    torch.manual_seed(3)
    S = 1024
    q, k, v = (torch.randn(1, 2, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    doc = (torch.arange(S) // 256).cuda()

    def document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    bm = fa.create_block_mask(document, None, None, S, S, device="cuda", separate_full_blocks=False)
    torch.cuda.synchronize()   # the states' host copy has landed
    assert bm.has_partial_tiles() is True
    spec = AttentionSpec.from_args(block_mask=bm)
    cfg = plan_forward(q, check_inputs(q, k, v, spec), spec).config
    assert cfg.partial_blocks and cfg.mods.has_mask
    with torch.no_grad():
        out = fa.flex_attention(q, k, v, block_mask=bm)
        want = fa.flex_attention(q, k, v, block_mask=fa.create_block_mask(document, None, None, S, S, device="cuda"))
    torch.cuda.synchronize()
    assert (out.float() - want.float()).abs().max() < 2e-2


@pytest.mark.parametrize("Q, KV", [(300, 300), (300, 517), (517, 300), (1, 129)])
def test_torch_style_causal_block_mask_runs_the_causal_structure(Q, KV):
    """A torch user's causal lambda through create_block_mask(..., device='cuda') and
    block_mask= runs the kernel's diagonal (recognized from the IR), matching the float64
    reference and the block-sparse walk of the same lists (from_kv_blocks keeps them)."""
    from flexattn.core.kernel_path import plan_forward

    torch.manual_seed(Q + KV)
    q = torch.randn(2, 4, Q, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, KV, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    bm = fa.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, Q, KV, device="cuda")
    spec = AttentionSpec.from_args(block_mask=bm, enable_gqa=True)
    plan = plan_forward(q, check_inputs(q, k, v, spec), spec)
    assert plan.config.causal and plan.block_mask is None
    out = fa.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    given = type(bm).from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                    mask_mod=bm.mask_mod, seq_lengths=(Q, KV))
    sparse = fa.flex_attention(q, k, v, block_mask=given, enable_gqa=True)
    want, _ = reference.forward(q.cpu(), k.cpu(), v.cpu(), AttentionSpec.from_args(mask=mods.causal(), enable_gqa=True))
    assert (out.double().cpu() - want).abs().max() < TOL[torch.bfloat16]
    assert (out.double() - sparse.double()).abs().max() < TOL[torch.bfloat16]


def test_torch_block_masks_convert_once_and_run_their_structure():
    """torch's own create_block_mask (on the GPU) through block_mask=: converted once per
    object, a causal one runs the kernel's diagonal, results match the reference; repeats
    take the prepared path (no conversion)."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    from flexattn.blockmask.layout import as_block_mask
    from flexattn.core.kernel_path import plan_forward

    torch.manual_seed(7)
    q = torch.randn(2, 4, 600, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 4, 600, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    bm = torch_create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 600, 600, device="cuda")
    ours = as_block_mask(bm)
    assert as_block_mask(bm) is ours and ours.from_mask
    spec = AttentionSpec.from_args(block_mask=ours)
    assert plan_forward(q, check_inputs(q, k, v, spec), spec).config.causal
    outs = [fa.flex_attention(q, k, v, block_mask=bm) for _ in range(3)]
    want, _ = reference.forward(q.cpu(), k.cpu(), v.cpu(), AttentionSpec.from_args(mask=mods.causal()))
    for out in outs:
        assert np.abs(out.double().cpu().numpy() - want).max() < TOL[torch.bfloat16]


def test_block_mask_built_on_the_gpu_by_default():
    """``create_block_mask`` without ``device=`` builds where torch's does (the current
    accelerator): CUDA lists, the host-built mask's values, the same attention."""
    torch.manual_seed(12)

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 200)

    default = fa.create_block_mask(window, None, None, 700, 700)
    host = fa.create_block_mask(window, None, None, 700, 700, device="cpu")
    assert default.kv_indices.is_cuda and default.kv_num_blocks.is_cuda and not host.kv_indices.is_cuda
    for name in ("kv_num_blocks", "full_kv_num_blocks"):
        assert torch.equal(getattr(default, name).cpu(), getattr(host, name))
    q, k, v = (torch.randn(1, 2, 700, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    torch.testing.assert_close(fa.flex_attention(q, k, v, block_mask=default),
                               fa.flex_attention(q, k, v, block_mask=host))
    assert fa.create_mask(window, None, None, 8, 8).is_cuda
    # CPU tensors (the README's example, run on a GPU machine) take the reference with either mask
    qc, kc, vc = (x[:, :, :300].float().cpu() for x in (q, k, v))
    small = fa.create_block_mask(window, None, None, 300, 300)
    assert small.kv_indices.is_cuda
    torch.testing.assert_close(fa.flex_attention(qc, kc, vc, block_mask=small),
                               fa.flex_attention(qc, kc, vc, block_mask=small.to("cpu")))


def test_block_mask_to_device_and_back():
    """``BlockMask.to("cuda")`` puts the lists on the GPU as torch tensors (mask and
    from_mask kept); ``.to("cpu")`` brings them back as CPU tensors; both run the same attention."""
    torch.manual_seed(11)
    q, k, v = (torch.randn(1, 2, 300, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    host = fa.create_block_mask(mods.sliding_window(64), None, None, 300, 300, device="cpu")
    on_gpu = host.to("cuda")
    assert isinstance(on_gpu.kv_indices, torch.Tensor) and on_gpu.kv_indices.is_cuda
    assert on_gpu.mask_mod is host.mask_mod and on_gpu.from_mask == host.from_mask
    back = on_gpu.to("cpu")
    assert isinstance(back.kv_indices, torch.Tensor) and not back.kv_indices.is_cuda
    assert torch.equal(back.kv_indices, on_gpu.kv_indices.cpu())
    want = fa.flex_attention(q, k, v, block_mask=host)
    for bm in (on_gpu, back):
        assert torch.equal(fa.flex_attention(q, k, v, block_mask=bm), want)


@pytest.mark.parametrize("case", ["none", "causal", "band", "torch_style_causal_softcap", "document_batched"])
def test_max_scores_against_reference(case):
    """``return_aux=AuxRequest(lse=True, max_scores=True)``: the forward kernel's row maxima
    (NaN-poisoned before the launch) against the float64 reference, inference and through
    autograd (then the gradients match the plain call's, whose kernel takes no maxima on its
    fast path: its P rounds against other references, so to bf16's rounding); lse as always."""
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    for i in range(3):
        B, Hq, Q, KV, q, k, v = _random_problem(rng, torch.bfloat16, 128)
        mask, score, _, _ = CASES[case](rng, B, Hq, Q, KV)
        spec = AttentionSpec.from_args(score=score, mask=mask, enable_gqa=True)
        shape = check_inputs(q, k, v, spec)
        out = torch.full((B, Hq, Q, 128), float("nan"), dtype=q.dtype, device="cuda")
        lse = torch.full((B, Hq, Q), float("nan"), device="cuda")
        got_max = torch.full((B, Hq, Q), float("nan"), device="cuda")
        forward_into(q, k, v, out, lse, shape, spec, torch_device(), got_max)
        _, want_lse, want_max = reference.forward(q.cpu(), k.cpu(), v.cpu(), spec, max_scores=True)
        got_max = got_max.double().cpu().numpy()
        assert np.array_equal(np.isneginf(got_max), np.isneginf(want_max)), f"{case}#{i}: empty rows differ"
        live = ~np.isneginf(want_max)
        err = np.abs(got_max[live] - want_max[live]).max() if live.any() else 0.0
        assert err < 2e-2 * max(1.0, np.abs(want_max[live]).max()), f"{case}#{i}: max error {err:.3g}"
    # Through the torch door, with autograd: the same maxima, out's gradients as the plain call's.
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    o1, aux = fa.flex_attention(qg, kg, vg, score_mod=score, enable_gqa=True, mask=mask,
                                return_aux=fa.AuxRequest(lse=True, max_scores=True))
    assert not aux.max_scores.requires_grad
    np.testing.assert_allclose(aux.max_scores.double().cpu().numpy(), got_max, rtol=0, atol=0)
    o1.float().square().sum().backward()
    grads = [t.grad.clone() for t in (qg, kg, vg)]
    for t in (qg, kg, vg):
        t.grad = None
    o2 = fa.flex_attention(qg, kg, vg, score_mod=score, enable_gqa=True, mask=mask)
    o2.float().square().sum().backward()
    for a, t in zip(grads, (qg, kg, vg)):
        torch.testing.assert_close(a, t.grad, rtol=0, atol=2e-2 * t.grad.abs().max().item())


def test_vector_read_bias_trains_against_reference():
    """A score mod reducing rows of captured embeddings (torch.dot, mods/vectors.py) through
    the torch door on the GPU: forward and the gradients of q, k, v and of both embeddings
    against the float64 reference (the embeddings' through the reference given the kernel's
    stored output, as tests/gpu/test_autograd_gpu.py does for captured tensors)."""
    torch.manual_seed(5)
    B, Hq, Hkv, S, D, R = 2, 4, 2, 200, 128, 8
    q = torch.randn(B, Hq, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    q_emb = (0.3 * torch.randn(B, Hq, S, R, device="cuda")).requires_grad_()
    k_emb = (0.3 * torch.randn(B, Hkv, S, R, device="cuda")).requires_grad_()

    def score(s, b, h, q_idx, kv_idx):
        return s + torch.dot(q_emb[b, h, q_idx], k_emb[b, h // 2, kv_idx])

    out = fa.flex_attention(q, k, v, score_mod=score, enable_gqa=True)
    d_out = torch.randn_like(out)
    out.backward(d_out)
    spec = AttentionSpec.from_args(score=mods.score_mod(score), enable_gqa=True)
    want_o, _ = reference.forward(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), spec)
    assert np.abs(out.detach().double().cpu().numpy() - want_o).max() < 2.5e-2
    want = reference.backward(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), d_out.cpu(), None, spec=spec,
                              out=out.detach().cpu())
    captures = spec.score.captures
    grads = {"dq": (q.grad, want.dq), "dk": (k.grad, want.dk), "dv": (v.grad, want.dv)}
    for name, t in (("d_q_emb", q_emb), ("d_k_emb", k_emb)):
        slot = next(i for i, c in enumerate(captures) if c is t)
        grads[name] = (t.grad, want.d_captures[slot])
    for name, (got, ref) in grads.items():
        got = got.double().cpu().numpy().reshape(np.shape(ref))
        rel = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-12)
        assert rel < 2e-2, f"{name}: rel err {rel:.3g}"


def test_compiled_graphs_repeat_through_prepared_op_launches(monkeypatch):
    """A compiled forward's op call repeats through ``_OpPrepared`` (the eager door's
    prepared launch: no checks, no planning) with each call's score-mod tensors: values
    updated in place and a closure rebound to new tensors are both seen, equal to the eager
    call and to the float64 reference."""
    from flexattn.core.kernel_path import PreparedForward
    import flexattn.torch.ops as fat

    launches = []
    real = PreparedForward.launch_operands
    monkeypatch.setattr(PreparedForward, "launch_operands",
                        lambda self, *a: (launches.append(1), real(self, *a))[1])
    fat._OP_PREPARED.clear()
    H = 4

    def make(slopes, table):
        def score(s, b, h, q_idx, kv_idx):
            return s + slopes[h] * (kv_idx - q_idx) + table[h, (q_idx - kv_idx) % 64]
        return score

    holder = {"score": make(torch.rand(H, device="cuda"), torch.randn(H, 64, device="cuda"))}

    def forward(q, k, v):
        return fa.flex_attention(q, k, v, score_mod=holder["score"])

    compiled = torch.compile(forward, fullgraph=True)
    q, k, v = (torch.randn(2, H, 333, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for step in range(4):
        if step == 2:
            slopes = torch.rand(H, device="cuda")
            holder["score"] = make(slopes, torch.randn(H, 64, device="cuda"))
        if step == 3:
            with torch.no_grad():
                slopes.mul_(3.0)
        got = compiled(q, k, v)
        assert torch.equal(got, forward(q, k, v)), step
    assert len(launches) >= 3, launches   # every call after the first
    want, _ = reference.forward(q.cpu(), k.cpu(), v.cpu(), AttentionSpec.from_args(score_mod=holder["score"]))
    assert np.abs(got.double().cpu().numpy() - want).max() < TOL[torch.bfloat16]


def test_compiled_training_repeats_through_prepared_op_launches(monkeypatch):
    """The compiled graph's backward op repeats through ``_OpPreparedBackward``: gradients of
    q, k, v and of the closed-over bias table equal the eager ones at every step, also after
    the table is updated in place."""
    from flexattn.core.backward_path import PreparedBackward
    import flexattn.torch.ops as fat

    launches = []
    real = PreparedBackward.launch
    monkeypatch.setattr(PreparedBackward, "launch",
                        lambda self, *a, **kw: (launches.append(len(a) > 2), real(self, *a, **kw))[1])
    fat._OP_PREPARED.clear()
    H = 4
    table = torch.randn(H, 64, device="cuda", requires_grad=True)

    def score(s, b, h, q_idx, kv_idx):
        return s + table[h, (q_idx - kv_idx) % 64]

    def forward(q, k, v):
        return fa.flex_attention(q, k, v, score_mod=score)

    compiled = torch.compile(forward, fullgraph=True)
    q, k, v = (torch.randn(1, H, 300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    for step in range(3):
        if step == 2:
            with torch.no_grad():
                table.mul_(2.0)
        got = torch.autograd.grad(compiled(q, k, v).float().square().sum(), (q, k, v, table))
        want = torch.autograd.grad(forward(q, k, v).float().square().sum(), (q, k, v, table))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    assert sum(launches) >= 2, launches   # the op's launches with this call's tensors


def test_compiled_score_functions_defined_inside_forward_train_on_the_kernels():
    """A score function defined in the compiled ``forward``, closing over the module's
    bias table (torch's HOP captures it; flexattn/torch/nested.py rewrites it into our op):
    our kernels run (the op's CUDA path is entered), the values and the gradients of q, k,
    v and the table equal the eager call's at every step, also after in-place updates, with
    one compilation."""
    from torch._dynamo.testing import CompileCounterWithBackend
    import flexattn.torch.ops as fat

    calls = []
    real = fat._kernel_forward
    fat._OP_PREPARED.clear()
    H = 4

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(H, 64, device="cuda"))

        def forward(self, q, k, v):
            def score_mod(s, b, h, q_idx, kv_idx):
                return s + self.table[h, (q_idx - kv_idx) % 64]
            return fa.flex_attention(q, k, v, score_mod=score_mod)

    model = Model()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    q, k, v = (torch.randn(1, H, 300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    spy = lambda *a, **kw: (calls.append(1), real(*a, **kw))[1]   # noqa: E731
    for step in range(3):
        if step == 2:
            with torch.no_grad():
                model.table.mul_(2.0)
        fat._kernel_forward = spy         # the compiled call only (the first: later ones
        try:                              # launch prepared, _OpPrepared)
            got_out = compiled(q, k, v)
        finally:
            fat._kernel_forward = real
        got = torch.autograd.grad(got_out.float().square().sum(), (q, k, v, model.table))
        want_out = model(q, k, v)
        want = torch.autograd.grad(want_out.float().square().sum(), (q, k, v, model.table))
        torch.testing.assert_close(got_out, want_out, atol=2e-2, rtol=2e-2)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    assert calls, "the compiled call did not reach flexattn's kernels"
    assert counter.frame_count == 1


def test_compiled_torch_block_masks_built_inside_train_on_the_kernels():
    """torch's create_block_mask inside the compiled step over per-step document ids (its
    lists stay graph values, converted per call by our op): values and gradients equal the
    eager call with the same torch block mask, for new ids each step, one compilation."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    H, S = 4, 512

    def step(q, k, v, docs):
        def same_doc(b, h, qi, ki):
            return (docs[qi] == docs[ki]) & (qi >= ki)
        bm = torch_create_block_mask(same_doc, None, None, S, S, device="cuda")
        return fa.flex_attention(q, k, v, block_mask=bm)

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    q, k, v = (torch.randn(2, H, S, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    for width in (100, 37, 300):
        docs = (torch.arange(S, device="cuda") // width).to(torch.int32)
        got_out = compiled(q, k, v, docs)
        got = torch.autograd.grad(got_out.float().square().sum(), (q, k, v))
        want_out = step(q, k, v, docs)
        want = torch.autograd.grad(want_out.float().square().sum(), (q, k, v))
        torch.testing.assert_close(got_out, want_out, atol=2e-2, rtol=2e-2)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    assert counter.frame_count == 1


_OUTSIDE_BIAS = None   # read as a global below; made by the test (no CUDA tensor at import: CPU collection)


def test_compiled_block_masks_built_inside_beside_a_score_reading_an_outside_tensor():
    """torch's create_block_mask inside the compiled step beside a score function reading a
    trainable tensor made outside (a global): through torch's HOP, on the kernels; values
    and gradients (the tensor's too) equal eager, one compilation."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    global _OUTSIDE_BIAS
    H, S = 4, 512
    bias = _OUTSIDE_BIAS = (torch.randn(512, device="cuda") * 0.5).requires_grad_(True)

    def step(q, k, v, docs):
        bm = torch_create_block_mask(lambda b, h, qi, ki: (docs[qi] == docs[ki]) & (qi >= ki), None, None, S, S,
                                     device="cuda")
        return fa.flex_attention(q, k, v, block_mask=bm, score_mod=lambda s, b, h, qi, ki: (
            s + _OUTSIDE_BIAS[qi] * torch.cos(_OUTSIDE_BIAS[ki])))

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    q, k, v = (torch.randn(2, H, S, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    for width in (100, 37):
        docs = (torch.arange(S, device="cuda") // width).to(torch.int32)
        got_out = compiled(q, k, v, docs)
        got = torch.autograd.grad(got_out.float().square().sum(), (q, k, v, bias))
        want_out = step(q, k, v, docs)
        want = torch.autograd.grad(want_out.float().square().sum(), (q, k, v, bias))
        torch.testing.assert_close(got_out, want_out, atol=2e-2, rtol=2e-2)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)
    assert counter.frame_count == 1


def test_compiled_functions_defined_inside_under_each_backend():
    """A score function defined in the compiled step beside a mask= function reading no
    tensors: torch.compile's default backend (Inductor, told apart by
    ``nested.compiling_for_inductor``) runs our kernels; aot_eager runs torch's own
    implementation of the whole call (before, it silently left the mask out). Both match
    a float64 reference, gradients too."""
    import flexattn.torch.ops as fat

    H, S = 4, 384
    bias = torch.randn(H, device="cuda")

    def step(q, k, v, bias):
        def score(s, b, h, qi, ki):
            return s + bias[h]
        return fa.flex_attention(q, k, v, score_mod=score, mask=lambda b, h, qi, ki: ki <= qi - 5)

    def reference(q, k, v):   # float64; rows with no key give zeros, as torch's flex does
        s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + bias.double()[None, :, None, None]
        idx = torch.arange(S, device="cuda")
        allowed = idx[None, :] <= idx[:, None] - 5
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
        return p @ v

    q, k, v = (torch.randn(2, H, S, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want_out = reference(q64, k64, v64)
    want = torch.autograd.grad(want_out.square().sum(), (q64, k64, v64))
    real = fat._kernel_forward
    for backend in ("inductor", "aot_eager"):
        torch._dynamo.reset()
        fat._OP_PREPARED.clear()
        calls = []
        fat._kernel_forward = lambda *a, **kw: (calls.append(1), real(*a, **kw))[1]
        try:
            compiled = torch.compile(step, fullgraph=True) if backend == "inductor" else \
                torch.compile(step, backend=backend, fullgraph=True)
            got_out = compiled(q, k, v, bias)
        finally:
            fat._kernel_forward = real
        got = torch.autograd.grad(got_out.float().square().sum(), (q, k, v))
        for name, a, b in zip(("out", "dq", "dk", "dv"), (got_out, *got), (want_out, *want)):
            error = (a.double() - b).abs().max().item() / b.abs().max().item()
            assert error < 2e-2, (backend, name, error)
        assert bool(calls) == (backend == "inductor"), (backend, calls)


def test_key_value_batch_of_one_broadcasts_in_place():
    """A key / value batch of 1 beside a query batch of 3 (torch broadcasts it): the
    kernels read the stride-0 views in place; forward, LSE and gradients equal those of
    explicit copies (K / V gradients summed over the batch), a causal torch-style mask and
    a per-sequence score."""
    torch.manual_seed(43)
    B, H, S, D = 3, 4, 333, 128
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k1, v1 = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    block_mask = fa.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device="cuda")

    def score(s, b, h, qi, ki):
        return s + 0.25 * b

    got = fa.flex_attention(q, k1, v1, score_mod=score, block_mask=block_mask, return_lse=True)
    grads = torch.autograd.grad(got[0].float().square().sum() + got[1].sum(), (q, k1, v1))
    copies = [t.detach().expand(B, -1, -1, -1).clone().requires_grad_() for t in (k1, v1)]
    want = fa.flex_attention(q, *copies, score_mod=score, block_mask=block_mask, return_lse=True)
    want_grads = torch.autograd.grad(want[0].float().square().sum() + want[1].sum(), (q, *copies))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(grads[0], want_grads[0], atol=1e-2, rtol=1e-2)
    for a, b in zip(grads[1:], want_grads[1:]):
        torch.testing.assert_close(a.float(), b.float().sum(0, keepdim=True), atol=3e-2, rtol=3e-2)
