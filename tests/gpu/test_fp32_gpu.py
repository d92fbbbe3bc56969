"""GPU: float32 inputs (issue 25, item 1) run the forward kernel's tf32 MMAs — 3xTF32 under
torch's default "highest" float32 matmul precision, one tf32 pass under "high" — against
the float64 reference: random odd shapes, GQA, NaN-poisoned outputs, the block structures
(dense, causal, band, block-sparse lists) and score mods, head dims 32..256. Errors are
compared with torch flex_attention's own float32 errors under the same setting (the
issue's bar: no worse). The operand kernel (V^T with its key order, tf32 parts) is checked
element by element."""

import math
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")

import flexattn.torch as fa  # noqa: E402
from flexattn import mods, reference  # noqa: E402
from flexattn.core import AttentionSpec, check_inputs  # noqa: E402
from flexattn.core.kernel_path import forward_into, plan_forward  # noqa: E402
from flexattn.kernels.fwd.fp32_operands import key_order  # noqa: E402
from flexattn.torch.devices import _forward_device  # noqa: E402
from mod_cases import STRUCTURES, structure_mods  # noqa: E402

# Max |out - float64| bounds for N(0, 1) inputs: 3xTF32 is within a few float32 ulps of the
# output (torch flex's float32 "highest": ~1e-6 at S 4096); one tf32 pass ~1e-3 (flex: 2e-3).
TOL = {"highest": 1e-5, "high": 8e-3}


@pytest.fixture(params=["highest", "high"])
def precision(request):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(request.param)
    yield request.param
    torch.set_float32_matmul_precision(before)


def _round_tf32(x: torch.Tensor) -> torch.Tensor:
    """cvt.rna.tf32.f32 on the host: round the magnitude to 10 mantissa bits, ties away."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


PAIRS = [(64, 64), (128, 128), (32, 32), (80, 80), (256, 256), (192, 128), (192, 192), (144, 144), (64, 128)]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"d{p[0]}-{p[1]}")
@pytest.mark.parametrize("kind", STRUCTURES)
def test_fp32_against_reference(pair, kind, precision):
    D, Dv = pair
    rng = np.random.default_rng(zlib.crc32(repr((pair, kind, precision)).encode()))
    torch.manual_seed(int(rng.integers(0, 2**31)))
    B, Hkv = int(rng.integers(1, 3)), int(rng.choice([1, 2]))
    Hq = Hkv * int(rng.choice([1, 2, 4]))
    Q = int(rng.integers(1, 600))
    KV = Q if kind in ("causal", "band", "scored") and rng.random() < 0.5 else int(rng.integers(1, 600))
    q = torch.randn(B, Hq, Q, D, device="cuda")
    k = torch.randn(B, Hkv, KV, D, device="cuda")
    v = torch.randn(B, Hkv, KV, Dv, device="cuda")
    score, mask = structure_mods(kind, rng, Hq, max(Q, KV))
    spec = AttentionSpec.from_args(score=score, mask=mask, enable_gqa=True)
    shape = check_inputs(q, k, v, spec)
    out = torch.full((B, Hq, Q, Dv), float("nan"), device="cuda")
    lse = torch.full((B, Hq, Q), float("nan"), device="cuda")
    device = _forward_device(q.device)
    assert device.tf32_passes == (3 if precision == "highest" else 1)
    forward_into(q, k, v, out, lse, shape, spec, device)
    torch.cuda.synchronize()
    want_o, want_lse = reference.forward(q.cpu(), k.cpu(), v.cpu(), spec)
    got_o, got_lse = out.double().cpu().numpy(), lse.double().cpu().numpy()
    name = f"D{D}/{Dv} {kind} {precision} B{B} Hq{Hq} Hkv{Hkv} Q{Q} KV{KV}"
    assert not np.isnan(got_o).any() and not np.isnan(got_lse).any(), f"{name}: NaN left"
    dead = np.isneginf(want_lse)
    assert np.array_equal(np.isneginf(got_lse), dead), f"{name}: empty rows differ"
    err = np.abs(got_o - want_o).max()
    assert err < TOL[precision], f"{name}: out error {err:.3g}"
    live = ~dead
    if live.any():
        lse_err = np.abs(got_lse[live] - want_lse[live]).max()
        assert lse_err < TOL[precision] * 10, f"{name}: lse error {lse_err:.3g}"
    cfg = plan_forward(q, shape, spec, tf32_passes=device.tf32_passes).config
    assert (cfg.dtype, cfg.tf32_passes) == ("fp32", device.tf32_passes)


@pytest.mark.parametrize("D", [128, 80])
def test_as_accurate_as_torch_flex(precision, D):
    """The torch door (a torch-style causal function through create_block_mask) against
    torch flex_attention (compiled, float32) on the same inputs: max error against float64
    no worse than flex's — under "highest" without slack (S's head-dim chain in pieces,
    FwdConfig.s_promote: 0.48-0.77x flex's over six seeds and shapes, H200 2026-11-30),
    under "high" (one tf32 pass each) with 20% for the rounding lottery. D 80: 3xTF32 runs
    64-key tiles there so that S's pieces fit (kernel_path._fp32_tiles)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(5)
    B, H, S = 1, 4, 1537
    q, k, v = (torch.randn(B, H, S, D, device="cuda") for _ in range(3))

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    ours = fa.flex_attention(q, k, v, block_mask=fa.create_block_mask(causal, None, None, S, S, device="cuda"))
    theirs = torch.compile(flex_attention)(q, k, v, block_mask=create_block_mask(causal, None, None, S, S,
                                                                                    device="cuda"))
    qd, kd, vd = (t.double() for t in (q, k, v))
    s = (qd @ kd.transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool, device="cuda").tril(), float("-inf"))
    want = torch.softmax(s, -1) @ vd
    err_ours, err_flex = ((x.double() - want).abs().max().item() for x in (ours, theirs))
    slack = 1.0 if precision == "highest" else 1.2
    assert err_ours <= slack * err_flex, f"{precision}: ours {err_ours:.3g} vs flex {err_flex:.3g}"


@pytest.mark.parametrize("passes", [1, 3])
def test_operand_kernel(passes):
    """V^T (keys permuted within each 8, zeros past the end; 3xTF32: hi then lo parts along
    the batch dim) and Q's parts, against a host emulation of the rounding."""
    from flexattn.kernels.fwd.sm90 import FwdConfig
    from flexattn.kernels.launch.fp32 import fp32_operands
    from flexattn.torch.devices import _backward_alloc

    torch.manual_seed(passes)
    B, H, S, D = 2, 3, 77, 80
    q = torch.randn(B, H, S, D, device="cuda")
    v = torch.randn(B, H, S, D, device="cuda")[:, :, :, :]     # any outer strides
    cfg = FwdConfig(dtype="fp32", tf32_passes=passes, head_dim=D, tile_n=64)
    q2, k2, vt = fp32_operands(cfg, q, q, v.transpose(1, 2).contiguous().transpose(1, 2), _backward_alloc(q.device))
    torch.cuda.synchronize()
    s8 = -(-S // 8) * 8
    order = torch.tensor([key_order(p) for p in range(s8)], device="cuda")
    padded = torch.cat([v, torch.zeros(B, H, s8 - S, D, device="cuda")], dim=2)
    want_vt = padded[:, :, order].transpose(2, 3)
    hi = _round_tf32(want_vt)
    assert vt.shape == (B * (2 if passes == 3 else 1), H, D, s8)
    assert torch.equal(vt[:B], hi)
    if passes == 3:
        assert torch.equal(vt[B:], _round_tf32(want_vt - hi))
        assert torch.equal(q2[:B], _round_tf32(q)) and torch.equal(q2[B:], _round_tf32(q - _round_tf32(q)))
    else:
        assert q2 is q and k2 is q


def test_fp32_errors_name_what_runs():
    q = torch.randn(1, 2, 64, 240, device="cuda", requires_grad=True)
    with pytest.raises(ValueError, match="does not fit shared memory"):   # head dim 240: forward only
        fa.flex_attention(q, q, q)
    with torch.no_grad():
        out = fa.flex_attention(q, q, q)
    assert out.dtype == torch.float32


def _float64_grads(q, k, v, do, scale, score=None, causal=True):
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = (qd @ kd.transpose(-1, -2)) * scale
    if score is not None:
        s = score(s)
    if causal:
        S, L = q.shape[2], k.shape[2]
        s = s.masked_fill(~torch.ones(S, L, dtype=torch.bool, device="cuda").tril(), float("-inf"))
    (torch.softmax(s, -1) @ vd).backward(do.double())
    return qd.grad, kd.grad, vd.grad


def _grad_errors(got, want):
    top = max(w.abs().max().item() for w in want)
    return [(g.double() - w).abs().max().item() / top for g, w in zip(got, want)]


def test_fp32_training_as_accurate_as_torch_flex(precision):
    """float32 training at the torch door (a causal function through create_block_mask and a
    softcap score function written with torch ops) through autograd, against torch
    flex_attention's own float32 backward (compiled) on the same inputs: each gradient's max
    error against float64 no worse than flex's (20% slack for the rounding lottery).

    "highest", dQ: dS = P (dP - D) cancels where a row sees few keys (row 0 of causal: dP =
    D exactly, which flex's IEEE products keep). With S^T's and dP^T's head-dim chains in
    one tensor-core accumulator ours was 4x flex's here (1.5e-6 against 4.4e-7, H100
    2026-11-27); summed in pieces of 2 k-blocks (BwdConfig.chain_promote) it is within
    the same 20% (the H200 study of 2026-11-30: 0.94-1.10x flex's), in pieces of 1 (planned
    at D128 since) 0.68-0.71x at S 4096."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(6)
    B, H, S, D = 1, 4, 1025, 128
    q, k, v, do = (torch.randn(B, H, S, D, device="cuda") for _ in range(4))

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def softcap(score, b, h, q_idx, kv_idx):
        return 20 * torch.tanh(score / 20)

    def grads(fn, bm):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        fn(qq, kk, vv, score_mod=softcap, block_mask=bm).backward(do)
        return qq.grad, kk.grad, vv.grad

    ours = grads(fa.flex_attention, fa.create_block_mask(causal, None, None, S, S, device="cuda"))
    theirs = grads(torch.compile(flex_attention), create_block_mask(causal, None, None, S, S, device="cuda"))
    want = _float64_grads(q, k, v, do, 1 / math.sqrt(D), lambda s: 20 * torch.tanh(s / 20))
    for name, e_ours, e_flex in zip(("dq", "dk", "dv"), _grad_errors(ours, want), _grad_errors(theirs, want)):
        assert e_ours <= 1.2 * e_flex + 1e-7, f"{precision} {name}: ours {e_ours:.3g} vs flex {e_flex:.3g}"
        assert e_ours < (1e-4 if precision == "highest" else 2e-2), f"{precision} {name}: {e_ours:.3g}"


def test_fp32_through_decode_compile_and_cupy():
    """float32 at the other doors: ``decode`` on a float32 cache (the decode kernel is 16-bit:
    the step runs as an attention problem on the forward's tf32 kernel), a short query
    (no decode route for float32), ``torch.compile`` (one graph) and CuPy."""
    torch.manual_seed(9)
    B, Hq, Hkv, L, D = 2, 8, 2, 700, 128
    k_cache = torch.randn(B, Hkv, 1024, D, device="cuda")
    v_cache = torch.randn(B, Hkv, 1024, D, device="cuda")
    lengths = torch.tensor([L, 301], dtype=torch.int32, device="cuda")
    q = torch.randn(B, Hq, 1, D, device="cuda")
    out = fa.decode(q, fa.KVCache(k_cache, v_cache, lengths), mask=mods.causal())
    for b, n in enumerate((L, 301)):
        kb, vb = k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n]
        want, _ = reference.forward(q[b:b + 1].cpu(), kb.cpu(), vb.cpu(), AttentionSpec.from_args(enable_gqa=True))
        assert np.abs(out[b:b + 1].double().cpu().numpy() - want).max() < TOL["highest"]

    k, v = k_cache[:, :, :L], v_cache[:, :, :L]
    short = fa.flex_attention(q, k, v, enable_gqa=True)
    want, _ = reference.forward(q.cpu(), k.cpu(), v.cpu(), AttentionSpec.from_args(enable_gqa=True))
    assert np.abs(short.double().cpu().numpy() - want).max() < TOL["highest"]

    slopes = torch.rand(Hq, device="cuda")
    qq = torch.randn(B, Hq, 300, D, device="cuda")

    def alibi(s, b, h, qi, ki):
        return s + slopes[h] * (ki - qi)

    def step(q_, k_, v_):
        return fa.flex_attention(q_, k_, v_, score_mod=alibi, enable_gqa=True)

    compiled = torch.compile(step, fullgraph=True)
    torch.testing.assert_close(compiled(qq, k, v), step(qq, k, v), atol=1e-5, rtol=1e-5)

    cupy = pytest.importorskip("cupy")
    import flexattn.cupy as fc

    cq, ck, cv = (cupy.asarray(x.cpu().numpy()) for x in (qq, k, v))
    got, _ = fc.flex_attention(cq, ck, cv, enable_gqa=True)
    want, _ = reference.forward(qq.cpu(), k.cpu(), v.cpu(), AttentionSpec.from_args(enable_gqa=True))
    assert np.abs(cupy.asnumpy(got).astype(np.float64) - want).max() < TOL["highest"]


def test_fp32_training_under_torch_compile():
    """float32 training in a compiled step (fullgraph), a score function closing over a
    learned bias table made outside it: the same gradients as the eager call (same kernels),
    the table's included, and new values never recompile. Written in session 23, not yet
    run on a GPU."""
    torch.manual_seed(11)
    B, H, S, D = 1, 4, 300, 64
    q, k, v = (torch.randn(B, H, S, D, device="cuda", requires_grad=True) for _ in range(3))
    table = torch.zeros(2 * S, device="cuda", requires_grad=True)

    def biased(s, b, h, qi, ki):
        return s + table[qi - ki + S]

    def step(q_, k_, v_):
        return fa.flex_attention(q_, k_, v_, score_mod=biased).square().sum()

    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    grads = []
    for fn in (step, compiled):
        for t in (q, k, v, table):
            t.grad = None
        fn(q, k, v).backward()
        grads.append([t.grad.clone() for t in (q, k, v, table)])
    for name, eager, comp in zip(("dq", "dk", "dv", "d_table"), *grads):
        torch.testing.assert_close(comp, eager, atol=1e-5, rtol=1e-4, msg=name)
    with torch.no_grad():
        table.add_(0.1)
    compiled(q, k, v).backward()
    assert counter.frame_count == 1, "new values recompiled"
