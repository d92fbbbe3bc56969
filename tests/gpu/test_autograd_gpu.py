"""GPU: torch autograd end to end through ``flexattn.torch.flex_attention`` on CUDA.

The forward and backward kernels run inside the ``flexattn::attention_fwd/bwd`` custom
ops; gradients of query, key, value and of trainable captured tensors (a dense bias, ALiBi
slopes, a relative-position table) are compared with the float64 reference
``flexattn.reference.backward``. Tolerances as in test_bwd_gpu.py: dq/dk/dv against the
exact reference; captured-tensor gradients against the reference given the kernel's own
stored output (``out=``), since delta = rowsum(dO·O) uses the bf16/fp16 O (see
``reference.backward``). No NaN anywhere (fully masked rows included).

Five kernel configurations (each ~5 s to compile): built-in causal (bf16, D128), sliding
window block mask + ALiBi (fp16, D64; with and without dLSE), document + softcap (bf16,
D128), built-in causal + relative bias (bf16, D64), dense bias (fp16, D128). Skipped
without CUDA.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")

import flexattn.torch as fa  # noqa: E402
from flexattn import mods, reference  # noqa: E402
from flexattn.core import AttentionSpec  # noqa: E402

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# Error bounds relative to the largest reference gradient (max-abs) and to its norm.
TOL = {"bf16": (4e-2, 1.5e-2), "fp16": (1e-2, 4e-3)}


def _close(what, got, want, dtype):
    got = got.detach().double().cpu().numpy().reshape(np.shape(want))
    assert not np.isnan(got).any(), f"{what}: NaN elements"
    tol_max, tol_rel = TOL[DTYPES[dtype]]
    ref = max(np.abs(want).max(), 1e-6)
    err = np.abs(got - want).max()
    rel = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-12)
    assert err <= tol_max * ref and rel <= tol_rel, f"{what}: max err {err:.3g} (ref {ref:.3g}), rel {rel:.3g}"


def _leaf(shape, dtype, bshd=False):
    """A leaf tensor requiring grad, [B, H, S, D] (or a [B, S, H, D] storage viewed so)."""
    if bshd:
        B, H, S, D = shape
        leaf = torch.randn(B, S, H, D, device="cuda", dtype=dtype).requires_grad_()
        return leaf, leaf.transpose(1, 2)
    leaf = torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_()
    return leaf, leaf


def _qkv(B, Hq, Hkv, Q, KV, D, dtype, bshd=False):
    """(leaves, views): grads land on the leaves; attention sees the [B, H, S, D] views."""
    pairs = [_leaf((B, Hq, Q, D), dtype, bshd), _leaf((B, Hkv, KV, D), dtype, bshd),
             _leaf((B, Hkv, KV, D), dtype, bshd)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _check(label, views, leaves, spec, out, d_out, d_lse=None, trainable=()):
    """Compare the leaves' (and trainable captures') .grad with the reference."""
    q, k, v = (x.detach().cpu() for x in views)
    dtype = views[0].dtype
    d_out_cpu = d_out.detach().cpu() if d_out is not None else torch.zeros(out.shape, dtype=torch.float64)
    d_lse_cpu = d_lse.detach().cpu() if d_lse is not None else None
    want = reference.backward(q, k, v, d_out_cpu, d_lse_cpu, spec=spec)
    for name, leaf, view, ref in zip("qkv", leaves, views, (want.dq, want.dk, want.dv)):
        assert leaf.grad is not None, f"{label}: no gradient for {name}"
        grad = leaf.grad if leaf is view else leaf.grad.transpose(1, 2)  # [B, S, H, D] leaves
        _close(f"{label} d{name}", grad, ref, dtype)
    if not trainable:
        return
    # captured tensors: against the reference given the kernel's stored output
    want = reference.backward(q, k, v, d_out_cpu, d_lse_cpu, spec=spec, out=out.detach().cpu())
    captures = spec.score.captures
    for param in trainable:
        (slot,) = [i for i, c in enumerate(captures) if c is param]
        assert param.grad is not None, f"{label}: no gradient for capture {slot}"
        assert param.grad.dtype == param.dtype and param.grad.shape == param.shape
        _close(f"{label} d_capture[{slot}]", param.grad, want.d_captures[slot], dtype)


@pytest.mark.parametrize("loss", ["weighted", "sum"])
def test_causal_gqa(loss):
    """Built-in causal structure, GQA 4:1 (dK/dV summed over the group); ``out.sum()``
    hands the op a stride-0 gradient."""
    torch.manual_seed(0)
    B, Hq, Hkv, S, D, dtype = 2, 8, 2, 384, 128, torch.bfloat16
    leaves, (q, k, v) = _qkv(B, Hq, Hkv, S, S, D, dtype)
    out = fa.flex_attention(q, k, v, mask=mods.causal(), enable_gqa=True)
    if loss == "weighted":
        d_out = torch.randn_like(out)
        (out * d_out).sum().backward()
    else:
        d_out = torch.ones_like(out)
        out.sum().backward()
    spec = AttentionSpec.from_args(mask=mods.causal(), enable_gqa=True)
    _check(f"causal-{loss}", (q, k, v), leaves, spec, out, d_out)


def _window_alibi(lse_loss):
    """Sliding window as a block mask, trainable ALiBi slopes, GQA 2:1, odd length."""
    torch.manual_seed(1)
    B, Hq, Hkv, S, D, dtype = 1, 4, 2, 457, 64, torch.float16
    leaves, (q, k, v) = _qkv(B, Hq, Hkv, S, S, D, dtype)
    slopes = torch.tensor(mods.alibi_slopes(Hq), device="cuda").requires_grad_()
    score = mods.alibi(slopes)
    bm = fa.create_block_mask(mods.sliding_window(128), None, None, S, S)
    out, lse = fa.flex_attention(q, k, v, score_mod=score, block_mask=bm, enable_gqa=True, return_lse=True)
    d_out = d_lse = None
    if lse_loss == "none":
        d_out = torch.randn_like(out)
        (out * d_out).sum().backward()
    elif lse_loss == "out_and_lse":
        d_out, d_lse = torch.randn_like(out), torch.randn_like(lse)
        ((out.float() * d_out.float()).sum() + (lse * d_lse).sum()).backward()
    else:  # lse only: the op gets d_out=None (zeros)
        d_lse = torch.randn_like(lse)
        (lse * d_lse).sum().backward()
    spec = AttentionSpec.from_args(score=score, block_mask=bm, enable_gqa=True)
    _check(f"window-alibi-{lse_loss}", (q, k, v), leaves, spec, out, d_out, d_lse, trainable=[slopes])


@pytest.mark.parametrize("lse_loss", ["none", "out_and_lse", "lse_only"])
def test_sliding_window_block_mask_alibi_slopes(lse_loss):
    _window_alibi(lse_loss)


@pytest.mark.parametrize("S", [1000, 1024])
def test_causal_alibi_fixed_slopes_torch_style(S):
    """causal + ALiBi as a torch user writes it (a score_mod closing over a slopes tensor
    that needs no gradient): the backward's additive-mod path (ds'/ds = 1, no masked-element
    guard, the KV_LEN test only in the CTA whose keys straddle it; S 1000 has one, 1024
    none)."""
    torch.manual_seed(3)
    B, Hq, Hkv, D, dtype = 2, 8, 2, 128, torch.bfloat16
    leaves, (q, k, v) = _qkv(B, Hq, Hkv, S, S, D, dtype)
    slopes = torch.tensor(mods.alibi_slopes(Hq), device="cuda")

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    bm = fa.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, S, S, device="cuda")
    out = fa.flex_attention(q, k, v, score_mod=alibi, block_mask=bm, enable_gqa=True)
    d_out = torch.randn_like(out)
    (out * d_out).sum().backward()
    spec = AttentionSpec.from_args(score=mods.alibi(mods.alibi_slopes(Hq)), mask=mods.causal(), enable_gqa=True)
    _check(f"causal-alibi-fixed-{S}", (q, k, v), leaves, spec, out, d_out)


def test_torch_function_score_trains_a_temperature():
    """A score function written with torch functions that have no IR node of their own or
    are IR nodes since session 43 (F.gelu on erf, atan on a trainable per-head temperature,
    ALiBi slopes by torch.pow of the traced head), in a causal block mask: the backward
    kernels' derivative code, dq / dk / dv and the temperature's gradient."""
    torch.manual_seed(4)
    B, H, S, D, dtype = 1, 4, 333, 128, torch.bfloat16
    leaves, (q, k, v) = _qkv(B, H, H, S, S, D, dtype)
    temperature = (torch.rand(H, device="cuda") + 0.5).requires_grad_()

    def score(s, b, h, q_idx, kv_idx):
        s = torch.nn.functional.gelu(s) + torch.atan(s * temperature[h])
        return s + torch.pow(2, -8.0 * (h + 1) / H) * (kv_idx - q_idx)

    bm = fa.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, S, S, device="cuda")
    out = fa.flex_attention(q, k, v, score_mod=score, block_mask=bm)
    d_out = torch.randn_like(out)
    (out * d_out).sum().backward()
    spec = AttentionSpec.from_args(score=mods.score_mod(score), mask=mods.causal())
    _check("torch-functions", (q, k, v), leaves, spec, out, d_out)
    (slot,) = [i for i, c in enumerate(spec.score.captures) if c is temperature]
    want = reference.backward(*(x.detach().cpu() for x in (q, k, v)), d_out.detach().cpu(), None, spec=spec,
                              out=out.detach().cpu())
    _close("torch-functions d_temperature", temperature.grad, want.d_captures[slot], dtype)


def test_document_softcap_fully_masked_rows():
    """mask= (block mask built per call), softcap, Q > KV: queries of the last document
    see no key (out 0, lse -inf) and must get zero gradients, not NaN."""
    torch.manual_seed(2)
    B, Hq, Hkv, Q, KV, D, dtype = 2, 4, 4, 517, 300, 128, torch.bfloat16
    ids = torch.zeros(Q, dtype=torch.int32)
    for cut in (100, 250, 400):  # documents [0,100) [100,250) [250,400) [400,517)
        ids[cut:] += 1
    mask, score = mods.document(ids.cuda()), mods.softcap(20.0)
    leaves, (q, k, v) = _qkv(B, Hq, Hkv, Q, KV, D, dtype)
    out, lse = fa.flex_attention(q, k, v, score_mod=score, mask=mask, scale=0.1, return_lse=True)
    assert torch.isneginf(lse[:, :, 400:]).all() and (out[:, :, 400:] == 0).all()
    d_out = torch.randn_like(out)
    (out * d_out).sum().backward()
    assert (leaves[0].grad[:, :, 400:] == 0).all()
    spec = AttentionSpec.from_args(score=score, mask=mask, scale=0.1)
    _check("document-softcap", (q, k, v), leaves, spec, out, d_out)


def test_relative_bias_table_strided_inputs():
    """Built-in causal + a trainable relative-position table; [B, S, H, D] leaves (strided
    views reach the kernels), GQA 3:1, odd lengths with Q != KV."""
    torch.manual_seed(3)
    B, Hq, Hkv, Q, KV, D, dtype = 1, 6, 2, 333, 401, 64, torch.bfloat16
    leaves, (q, k, v) = _qkv(B, Hq, Hkv, Q, KV, D, dtype, bshd=True)
    table = (0.5 * torch.randn(Hq, 2 * 48 + 1, device="cuda")).requires_grad_()
    score = mods.relative_bias(table)
    out = fa.flex_attention(q, k, v, score_mod=score, mask=mods.causal(), enable_gqa=True)
    d_out = torch.randn_like(out)
    (out * d_out).sum().backward()
    spec = AttentionSpec.from_args(score=score, mask=mods.causal(), enable_gqa=True)
    _check("relative-bias", (q, k, v), leaves, spec, out, d_out, trainable=[table])


def test_trainable_dense_bias_and_untrained_capture():
    """A trainable [H, Q, KV] bias (dense gradient, summed over the batch) next to a
    captured tensor that does not require grad (its gradient is computed and dropped)."""
    torch.manual_seed(4)
    B, Hq, Hkv, Q, KV, D, dtype = 2, 2, 2, 200, 264, 128, torch.float16
    leaves, (q, k, v) = _qkv(B, Hq, Hkv, Q, KV, D, dtype)
    bias = (0.3 * torch.randn(Hq, Q, KV, device="cuda")).requires_grad_()
    gain = torch.rand(Hq, device="cuda") + 0.5  # no grad wanted

    def biased(s, b, h, q_idx, kv_idx):
        return s * gain[h] + bias[h, q_idx, kv_idx]

    score = mods.score_mod(biased)
    out = fa.flex_attention(q, k, v, score_mod=score)
    d_out = torch.randn_like(out)
    (out * d_out).sum().backward()
    assert gain.grad is None
    spec = AttentionSpec.from_args(score=score)
    _check("dense-bias", (q, k, v), leaves, spec, out, d_out, trainable=[bias])


def test_torch_compile_fullgraph_backward():
    """torch.compile(fullgraph=True) (aot_eager: AOT autograd over the custom ops) of a
    module with trainable slopes: the same kernels as the eager window+ALiBi case."""
    torch._dynamo.reset()
    S, Hq, Hkv, D, dtype = 457, 4, 2, 64, torch.float16

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.slopes = torch.nn.Parameter(torch.tensor(mods.alibi_slopes(Hq), device="cuda"))
            self.score = mods.alibi(self.slopes)
            self.block_mask = fa.create_block_mask(mods.sliding_window(128), None, None, S, S)

        def forward(self, q, k, v):
            return fa.flex_attention(q, k, v, score_mod=self.score, block_mask=self.block_mask, enable_gqa=True)

    torch.manual_seed(5)
    module = Attention()
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    leaves, (q, k, v) = _qkv(1, Hq, Hkv, S, S, D, dtype)
    out = compiled(q, k, v)
    d_out = torch.randn_like(out)
    (out * d_out).sum().backward()
    spec = AttentionSpec.from_args(score=module.score, block_mask=module.block_mask, enable_gqa=True)
    _check("compiled", (q, k, v), leaves, spec, out, d_out, trainable=[module.slopes])
    torch._dynamo.reset()


class _ProjectedAttention(torch.nn.Module):
    """A block as users write it: q/k/v projections (inductor compiles those), GQA
    attention with trainable ALiBi slopes under a causal block mask, an output projection."""

    def __init__(self, S, Hq=4, Hkv=2, D=64, dtype=torch.bfloat16):
        super().__init__()
        self.Hq, self.Hkv, self.D = Hq, Hkv, D
        width = Hq * D
        self.wq = torch.nn.Linear(width, Hq * D, bias=False, device="cuda", dtype=dtype)
        self.wkv = torch.nn.Linear(width, 2 * Hkv * D, bias=False, device="cuda", dtype=dtype)
        self.wo = torch.nn.Linear(Hq * D, width, bias=False, device="cuda", dtype=dtype)
        self.slopes = torch.nn.Parameter(torch.tensor(mods.alibi_slopes(Hq), device="cuda"))
        self.score = mods.alibi(self.slopes)
        self.block_mask = fa.create_block_mask(mods.causal(), None, None, S, S)

    def forward(self, x):
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, self.Hq, self.D).transpose(1, 2)
        k, v = self.wkv(x).view(B, S, 2, self.Hkv, self.D).unbind(2)
        out = fa.flex_attention(q, k.transpose(1, 2), v.transpose(1, 2), score_mod=self.score,
                                block_mask=self.block_mask, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(B, S, -1))


def _rel_err(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()


def test_torch_compile_inductor_fullgraph_training_step():
    """The default torch.compile (inductor) with fullgraph=True around the custom ops:
    outputs and every gradient (projections, slopes, input) as in eager mode."""
    torch._dynamo.reset()
    torch.manual_seed(11)
    S = 333
    model = _ProjectedAttention(S)
    x = torch.randn(2, S, model.Hq * model.D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    params = [x] + list(model.parameters())

    def step(fn):
        out = fn(x)
        grads = torch.autograd.grad(out.float().square().mean(), params)
        return out, grads

    out_e, grads_e = step(model)
    compiled = torch.compile(model, fullgraph=True)
    out_c, grads_c = step(compiled)
    assert not out_c.isnan().any()
    assert _rel_err(out_c, out_e) < 1e-2
    for i, (gc, ge) in enumerate(zip(grads_c, grads_e)):
        assert not gc.isnan().any(), f"grad {i}: NaN"
        assert _rel_err(gc, ge) < 2e-2, f"grad {i}: rel err {_rel_err(gc, ge):.3g}"
    torch._dynamo.reset()


def test_torch_compile_reduce_overhead_replays_cuda_graphs():
    """mode="reduce-overhead" (inductor + CUDA graphs): inference calls are captured and
    replayed; replays on new input data give the eager results."""
    torch._dynamo.reset()
    torch.manual_seed(12)
    S = 256
    model = _ProjectedAttention(S)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for i in range(4):        # warm-up, record, then replays
            x = torch.randn(2, S, model.Hq * model.D, device="cuda", dtype=torch.bfloat16)
            got = compiled(x).clone()
            want = model(x)
            assert _rel_err(got, want) < 1e-2, f"call {i}: rel err {_rel_err(got, want):.3g}"
    torch._dynamo.reset()


def test_torch_compile_reduce_overhead_training_steps():
    """Training under mode="reduce-overhead": forward and backward graphs (with the
    backward kernels and their workspaces) captured and replayed on new data; every
    gradient as in eager mode."""
    torch._dynamo.reset()
    torch.manual_seed(13)
    S = 256
    model = _ProjectedAttention(S)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    params = list(model.parameters())
    for i in range(4):
        x = torch.randn(2, S, model.Hq * model.D, device="cuda", dtype=torch.bfloat16)
        got = torch.autograd.grad(compiled(x).float().square().mean(), params)
        got = [g.clone() for g in got]
        want = torch.autograd.grad(model(x).float().square().mean(), params)
        for j, (gc, ge) in enumerate(zip(got, want)):
            assert not gc.isnan().any(), f"step {i}, grad {j}: NaN"
            assert _rel_err(gc, ge) < 2e-2, f"step {i}, grad {j}: rel err {_rel_err(gc, ge):.3g}"
    torch._dynamo.reset()


def test_repeated_steps_reuse_compiled_kernels():
    """Training steps with updated parameters compile nothing new."""
    from flexattn.kernels.launch import cache

    _window_alibi("none")
    before = cache.compile_count()
    _window_alibi("none")
    assert cache.compile_count() == before


def test_deterministic_algorithms_give_bitwise_equal_gradients():
    """torch.use_deterministic_algorithms(True) selects the deterministic backward: two
    steps give bitwise-equal dq/dk/dv and slope gradients (block-sparse, GQA, ALiBi)."""
    torch.manual_seed(9)
    B, Hq, Hkv, S, D, dtype = 2, 8, 2, 777, 128, torch.bfloat16
    leaves, (q, k, v) = _qkv(B, Hq, Hkv, S, S, D, dtype)
    slopes = torch.tensor(mods.alibi_slopes(Hq), device="cuda").requires_grad_()
    score = mods.alibi(slopes)
    bm = fa.create_block_mask(mods.sliding_window(300), None, None, S, S)
    d_out = torch.randn(B, Hq, S, D, device="cuda", dtype=dtype)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        grads = []
        for _ in range(2):
            for t in leaves + [slopes]:
                t.grad = None
            out = fa.flex_attention(q, k, v, score_mod=score, block_mask=bm, enable_gqa=True)
            (out * d_out).sum().backward()
            grads.append([t.grad.clone() for t in leaves + [slopes]])
    finally:
        torch.use_deterministic_algorithms(was)
    for name, a, b in zip(("dq", "dk", "dv", "dslopes"), *grads):
        assert torch.equal(a, b), f"deterministic mode: {name} differs between two runs"
    spec = AttentionSpec.from_args(score=score, block_mask=bm, enable_gqa=True)
    _check("deterministic", (q, k, v), leaves, spec, out, d_out, trainable=[slopes])
