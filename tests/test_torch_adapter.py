"""flexattn.torch on CPU tensors: drop-in forward, autograd, torch BlockMask, clear errors."""

import math

import numpy as np
import pytest
import torch

import flexattn
import flexattn.torch as fa
import flexattn.torch.attention as fa_attention
from flexattn import mods

import naive_attention as naive
from mod_cases import CASES


def _qkv(B=2, Hq=4, Hkv=4, Q=33, KV=47, D=16, dtype=torch.float64, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(B, Hq, Q, D, generator=g), torch.randn(B, Hkv, KV, D, generator=g),
          torch.randn(B, Hkv, KV, D, generator=g)]
    return [x.to(dtype).requires_grad_(grad) for x in xs]


def test_create_block_mask_importable_everywhere():
    """flexattn.torch's create_block_mask is the core's (plus building inside torch.compile)."""
    bm = fa.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 256, 256)
    core = flexattn.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 256, 256)
    assert isinstance(bm, fa.BlockMask) and bm.BLOCK_SIZE == (128, 128)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        np.testing.assert_array_equal(getattr(bm, name), getattr(core, name))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_output_dtype_shape_and_lse(dtype):
    q, k, v = _qkv(dtype=dtype)
    out, lse = fa.flex_attention(q, k, v, block_mask=fa.create_block_mask(mods.causal(), None, None, 33, 47, BLOCK_SIZE=16), return_lse=True)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == q.shape[:3]
    want, want_lse = naive.attention(q.double(), k.double(), v.double(), mask_fn=lambda b, h, qi, ki: qi >= ki)
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_autograd_matches_naive(case):
    rng = np.random.default_rng(len(case))
    B, Hq, Hkv, Q, KV, D = 2, 4, 2, 29, 40, 8
    mask, score, mask_fn, score_fn = CASES[case](rng, B, Hq, Q, KV)
    q, k, v = _qkv(B, Hq, Hkv, Q, KV, D, grad=True, seed=1)
    out, lse = fa.flex_attention(q, k, v, mask=mask, score_mod=score, enable_gqa=True, return_lse=True)
    w = torch.randn_like(out)
    (out * w).sum().backward()
    got = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    want, _ = naive.attention(q, k, v, score_fn, mask_fn)
    (want * w).sum().backward()
    for a, b in zip(got, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_gradient_through_lse():
    q, k, v = _qkv(grad=True, seed=2)
    out, lse = fa.flex_attention(q, k, v, return_lse=True)
    (lse.double() ** 2).sum().backward()
    got = q.grad.clone()
    q.grad = None
    _, want_lse = naive.attention(q, k, v)
    (want_lse ** 2).sum().backward()
    torch.testing.assert_close(got, q.grad, atol=1e-6, rtol=1e-6)  # lse itself is float32


@pytest.mark.parametrize("kind", ["bias_table", "alibi_slopes", "relative_table", "read_twice"])
def test_trainable_captured_tensors_get_gradients(kind):
    H = 4
    q, k, v = _qkv(1, H, H, 20, 20, 8, grad=True, seed=3)
    if kind == "bias_table":
        buf = torch.randn(H, 20, 20, dtype=torch.float64, requires_grad=True)
        score = lambda s, b, h, qi, ki: s + buf[h, qi, ki]  # noqa: E731
    elif kind == "alibi_slopes":
        buf = torch.rand(H, dtype=torch.float64, requires_grad=True)
        score = mods.alibi(buf)
    elif kind == "relative_table":
        buf = torch.randn(H, 9, dtype=torch.float64, requires_grad=True)
        score = mods.relative_bias(buf)
    else:
        buf = torch.rand(H, dtype=torch.float64, requires_grad=True)
        score = lambda s, b, h, qi, ki: s * buf[h] + buf[h] * buf[h]  # noqa: E731
    out = fa.flex_attention(q, k, v, score_mod=score, block_mask=fa.create_block_mask(mods.causal(), None, None, 20, 20, BLOCK_SIZE=8))
    out.square().sum().backward()
    got = buf.grad.clone()
    buf.grad = None
    fn = score if callable(score) and not isinstance(score, mods.Mod) else None
    if kind == "alibi_slopes":
        fn = lambda s, b, h, qi, ki: s + buf[h] * (ki - qi)  # noqa: E731
    elif kind == "relative_table":
        fn = lambda s, b, h, qi, ki: s + buf[h, (qi - ki).clamp(-4, 4) + 4]  # noqa: E731
    want, _ = naive.attention(q, k, v, fn, lambda b, h, qi, ki: qi >= ki)
    want.square().sum().backward()
    torch.testing.assert_close(got, buf.grad, atol=1e-9, rtol=1e-9)


def test_gradcheck_float64():
    q, k, v = _qkv(1, 2, 1, 5, 7, 3, grad=True, seed=4)
    slopes = torch.rand(2, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, slopes):
        return fa.flex_attention(q, k, v, score_mod=mods.alibi(slopes) >> mods.softcap(2.0),
                                 mask=mods.sliding_window(3), enable_gqa=True, return_lse=True)

    assert torch.autograd.gradcheck(f, (q, k, v, slopes), eps=1e-6, atol=1e-6)


def test_accepts_torch_block_mask_and_matches_torch_flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = _qkv(2, 2, 2, 64, 96, 16, seed=5)
    doc = torch.tensor([0] * 40 + [1] * 56)

    def mask(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (qi >= ki)

    def score(s, b, h, qi, ki):
        return s - (qi - ki).abs().to(s.dtype) * 0.05

    tbm = create_block_mask(mask, None, None, 64, 96, device="cpu", BLOCK_SIZE=32)
    want = flex_attention(q, k, v, score_mod=score, block_mask=tbm)
    got = fa.flex_attention(q, k, v, score_mod=score, block_mask=tbm)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_fully_masked_rows_no_nan_and_zero_grad():
    q, k, v = _qkv(1, 1, 1, 10, 10, 4, grad=True, seed=6)
    m = mods.mask_mod(lambda b, h, qi, ki: (qi < 5) & (ki <= qi))
    out, lse = fa.flex_attention(q, k, v, mask=m, return_lse=True)
    assert torch.all(out[0, 0, 5:] == 0) and torch.all(torch.isneginf(lse[0, 0, 5:]))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.all(q.grad[0, 0, 5:] == 0)


def test_scale_argument():
    q, k, v = _qkv(seed=7)
    got = fa.flex_attention(q, k, v, scale=0.3)
    want, _ = naive.attention(q, k, v, scale=0.3)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("call, err, words", [
    (lambda q, k, v: fa.flex_attention(q[0], k, v), ValueError, "query must be 4-D"),
    (lambda q, k, v: fa.flex_attention(q.numpy(), k, v), TypeError, "query must be a torch.Tensor"),
    (lambda q, k, v: fa.flex_attention(q, k.float(), v), TypeError, "share a dtype"),
    (lambda q, k, v: fa.flex_attention(q.long(), k.long(), v.long()), TypeError, "floating"),
    (lambda q, k, v: fa.flex_attention(q, k[:, :2], v[:, :2]), ValueError, "enable_gqa=True"),
    (lambda q, k, v: fa.flex_attention(q, k[:, :3], v[:, :3], enable_gqa=True), ValueError, "multiple"),
    (lambda q, k, v: fa.flex_attention(q, k[..., :8], v), ValueError, "head dims differ"),
    (lambda q, k, v: fa.flex_attention(q, k, v[:, :, :5]), ValueError, "same sequence length"),
    (lambda q, k, v: fa.flex_attention(q[:1], k, v), ValueError, "batch sizes differ"),   # (k / v of batch 1 broadcast)
    (lambda q, k, v: fa.flex_attention(q, k, v, scale="big"), TypeError, "scale"),
    (lambda q, k, v: fa.flex_attention(q, k, v, scale=math.nan), TypeError, "scale"),
    (lambda q, k, v: fa.flex_attention(q, k, v, enable_gqa=1), TypeError, "enable_gqa"),
    (lambda q, k, v: fa.flex_attention(q, k, v, score_mod=42), TypeError, "score_mod"),
    (lambda q, k, v: fa.flex_attention(q, k, v, score_mod=lambda s, b: s), TypeError, "score, b, h, q_idx, kv_idx"),
    (lambda q, k, v: fa.flex_attention(q, k, v, score_mod=mods.causal()), TypeError, "score mod"),
    (lambda q, k, v: fa.flex_attention(q, k, v, mask=mods.softcap(3.0)), TypeError, "mask mod"),
    (lambda q, k, v: fa.flex_attention(q, k, v, block_mask="causal"), TypeError, "block_mask"),
    (lambda q, k, v: fa.flex_attention(q, k, v, block_mask=fa.create_block_mask(mods.causal(), None, None, 32, 32)), ValueError, "Q_LEN=32"),
    (lambda q, k, v: fa.flex_attention(q, k, v, block_mask=fa.create_block_mask(mods.causal(), 3, None, 33, 47)), ValueError, "batch size 3"),
    (lambda q, k, v: fa.flex_attention(q, k, v, mask=mods.causal(), block_mask=fa.create_block_mask(mods.full(), None, None, 33, 47)), ValueError, "either mask= or block_mask="),
    (lambda q, k, v: fa.flex_attention(q, k, v, score_mod=mods.softcap(2.0), score=mods.softcap(2.0)), TypeError, "not both"),
    (lambda q, k, v: fa.flex_attention(q, k, v, kernel_options=3), TypeError, "kernel_options"),
])
def test_bad_input_gives_clear_error(call, err, words):
    q, k, v = _qkv()
    with pytest.raises(err, match=words):
        call(q, k, v)


def test_device_copies_of_read_only_arrays_warn_nothing():
    import warnings

    from flexattn.torch.devices import _DeviceCopies

    x = np.arange(6, dtype=np.int32)
    x.flags.writeable = False
    copies = _DeviceCopies(torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = copies(x)
    assert t.tolist() == list(range(6)) and copies(x) is t      # copied once, then cached


def test_prepared_entry_takes_inference_calls_and_leaves_recorded_ones(monkeypatch):
    """The repeated-call path (``PreparedCalls.run`` of ``_call_key``) on CPU tensors with a fake launch:
    it serves inference calls (detaching inputs that require grad under no_grad) and
    declines what the full path must do: calls autograd records (inputs or score-mod
    tensors requiring grad with grad mode on), another current device, another layout."""
    from flexattn.core import AttentionSpec
    from flexattn.core.prepared import PreparedCalls
    from flexattn.problem.validate import check_inputs

    monkeypatch.setattr(torch.cuda, "current_device", lambda: -1)   # CPU tensors: get_device() == -1
    monkeypatch.setattr(fa_attention, "_current_raw_stream", lambda index: 0)
    launched = []

    class FakePrepared:
        def launch(self, q, k, v, out, lse, stream=None):
            launched.append((q.requires_grad, k.requires_grad, v.requires_grad, lse))

    slopes = torch.rand(4)
    score, mask = mods.alibi(slopes), mods.causal()
    q, k, v = _qkv(B=1, Q=8, KV=8, dtype=torch.float16)
    call = (None, None, None, False, mask, score)
    spec = AttentionSpec.from_args(score=score, mask=mask)
    shape = check_inputs(q, k, v, spec)
    cache = PreparedCalls()
    for _ in range(2):    # prepared on the second sighting
        cache.add(fa_attention._call_key(q, k, v, call), call, lambda: fa_attention._PreparedCall(spec, shape, q, FakePrepared()))

    def run(q, k, v, call, return_lse):   # as flex_attention's repeated-call path
        return cache.run(fa_attention._call_key(q, k, v, call), q, k, v, return_lse)

    out, lse = run(q, k, v, call, return_lse=False)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (1, 4, 8)
    _, lse2 = run(q, k, v, call, return_lse=False)
    assert lse2 is lse                                       # the LSE sink, not an allocation
    _, lse3 = run(q, k, v, call, return_lse=True)
    assert lse3 is not lse
    assert len(launched) == 3

    qg = q.clone().requires_grad_(True)
    assert run(qg, k, v, call, return_lse=False) is None          # autograd records it
    with torch.no_grad():
        assert run(qg, k, v, call, return_lse=False) is not None  # inference: detached
    assert launched[-1][:3] == (False, False, False)
    slopes.requires_grad_(True)
    assert run(q, k, v, call, return_lse=False) is None           # trainable slopes
    with torch.no_grad():
        assert run(q, k, v, call, return_lse=False) is not None
    slopes.requires_grad_(False)

    qt = q.transpose(2, 3).contiguous().transpose(2, 3)                # same shape, other strides
    assert run(qt, k, v, call, return_lse=False) is None
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert run(q, k, v, call, return_lse=False) is None           # another current device
    assert len(launched) == 5


def test_eager_autograd_path_only_for_plain_tensors():
    """``_EagerAttention`` (no custom-op dispatch) is taken only for plain tensors outside
    dispatch modes and functorch transforms; fake tensors and torch.func keep the ops."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flexattn.torch.attention import _plain_eager

    x = torch.zeros(2, 3)
    assert _plain_eager(x, x.requires_grad_())
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.zeros(2, 3))
        assert not _plain_eager(fake)
    seen = []

    def f(t):
        seen.append(_plain_eager(t))
        return t.sum()

    torch.func.grad(f)(torch.zeros(3))
    assert seen == [False]


def test_written_empty_skips_the_deterministic_fill_and_restores_it():
    """Under torch.use_deterministic_algorithms torch fills every new tensor with NaN
    (an extra kernel each); arrays the kernels write in full skip it, and the global
    switch is back afterwards, also when the allocation fails."""
    from flexattn.torch.devices import _written_empty

    fill = torch.utils.deterministic
    assert fill.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    try:
        calls = []
        real_empty = torch.empty

        def spy(*args, **kwargs):
            calls.append(fill.fill_uninitialized_memory)
            return real_empty(*args, **kwargs)

        torch.empty = spy
        try:
            x = _written_empty(3, 5, dtype=torch.float32, device="cpu")
            with pytest.raises(RuntimeError):
                _written_empty(-1, dtype=torch.float32, device="cpu")
        finally:
            torch.empty = real_empty
        assert calls == [False, False] and x.shape == (3, 5)
        assert fill.fill_uninitialized_memory
        assert torch.isnan(torch.empty(4)).all()          # torch's own allocations still filled
    finally:
        torch.use_deterministic_algorithms(False)
    assert _written_empty((2,), dtype=torch.int64, device="cpu").dtype == torch.int64


def test_backward_operands_are_read_in_place_where_the_kernels_can():
    """The backward's dO and LSE reach the kernels without a copy where TMA reads them as
    they are: the gradient of a transposed output ([B, S, H, D] storage), context
    parallelism's row slices of dO and LSE; a copy where it cannot: an expanded gradient
    (zero strides), strides off 16 bytes, a base off 16 bytes, a non-contiguous head dim."""
    from flexattn.torch.launches import _backward_arrays

    B, H, S, D = 2, 4, 40, 64
    q = torch.randn(B, H, S, D, dtype=torch.bfloat16)
    lse = torch.randn(B, H, 2 * S)[:, :, 8:8 + S]                       # a row slice
    def passed(d_out, lse=lse):
        arrays = _backward_arrays(q, q, q, q, lse, d_out, None)
        return arrays.d_out.data_ptr() == d_out.data_ptr(), arrays.lse.data_ptr() == lse.data_ptr()

    base = torch.randn(B, 2 * S, H, D, dtype=torch.bfloat16)
    assert passed(base.transpose(1, 2)[:, :, 16:16 + S]) == (True, True)   # transposed, rows 16..
    assert passed(torch.randn(B, H, S, D, dtype=torch.bfloat16)) == (True, True)
    assert passed(torch.ones(1, 1, 1, D, dtype=torch.bfloat16).expand(B, H, S, D))[0] is False
    assert passed(torch.randn(B, H, S, D + 4, dtype=torch.bfloat16)[..., :D])[0] is False     # rows of 68
    assert passed(torch.randn(B * H * S * D + 1, dtype=torch.bfloat16)[1:].view(B, H, S, D))[0] is False
    assert passed(torch.randn(B, H, D, S, dtype=torch.bfloat16).transpose(2, 3))[0] is False
    assert passed(q, lse=torch.randn(B, H, S, 2)[..., 0])[1] is False    # strided sequence dim
    got = _backward_arrays(q, q, q, q, lse, torch.ones(1, 1, 1, D, dtype=torch.bfloat16).expand(B, H, S, D), None)
    assert got.d_out.is_contiguous() and torch.equal(got.d_out, torch.ones(B, H, S, D, dtype=torch.bfloat16))


def test_torch_mask_helpers_match_torch():
    """and_masks / or_masks / noop_mask / create_mask / FlexKernelOptions, as torch's:
    the same dense masks, and flex_attention with them equal to torch's eager call."""
    from torch.nn.attention.flex_attention import and_masks, create_mask, noop_mask, or_masks
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    def causal_fn(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def near(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 5

    def score_fn(s, b, h, q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx, s, -float("inf"))

    pairs = [(fa.and_masks(causal_fn, near), and_masks(causal_fn, near)),
             (fa.or_masks(causal_fn, near), or_masks(causal_fn, near)),
             (fa.noop_mask, noop_mask), (fa.and_masks(), and_masks()), (score_fn, score_fn)]
    for ours, theirs in pairs:
        assert torch.equal(fa.create_mask(ours, 2, 3, 40, 50), create_mask(theirs, 2, 3, 40, 50, device="cpu"))
    q, k, v = (torch.randn(1, 2, 40, 16, dtype=torch.float64) for _ in range(3))
    for ours, theirs in pairs[:3]:
        want = torch_flex(q, k, v, block_mask=torch_create_block_mask(theirs, None, None, 40, 40, device="cpu"))
        got = fa.flex_attention(q, k, v, block_mask=fa.create_block_mask(ours, None, None, 40, 40))
        torch.testing.assert_close(got, want)
    assert "FlexKernelOptions" in fa.__all__ and fa.FlexKernelOptions is not None


def test_nested_jagged_inputs_get_a_clear_error():
    jagged = torch.nested.nested_tensor([torch.randn(2, 5, 16), torch.randn(2, 7, 16)], layout=torch.jagged)
    with pytest.raises(ValueError, match="document_from_offsets"):
        fa.flex_attention(jagged, jagged, jagged)


def test_return_aux_matches_torch():
    """``return_aux=AuxRequest(lse=, max_scores=)`` as torch's: the outputs asked for, None
    for the others; max_scores equal to torch's own math implementation (torch computes
    it only on the GPU; its math path is what its kernels are checked against), -inf on
    rows that see nothing; not differentiable, gradients of out unchanged; return_lse
    together with return_aux refused as torch does."""
    from torch._higher_order_ops.flex_attention import math_attention
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 37, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def score(s, b, h, q_idx, kv_idx):
        return 20 * torch.tanh(s / 20) + (q_idx - kv_idx) * 0.01

    def mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx > 3)

    bm = fa.create_block_mask(mask, None, None, 37, 37)
    out, aux = fa.flex_attention(q, k, v, score_mod=score, block_mask=bm, scale=0.25,
                                 return_aux=fa.AuxRequest(lse=True, max_scores=True))
    assert isinstance(aux, fa.AuxOutput)
    _, want_lse, want_max = math_attention(q.detach(), k.detach(), v.detach(), score,
                                           torch_create_block_mask(mask, None, None, 37, 37, device="cpu").as_tuple(),
                                           0.25, {})
    torch.testing.assert_close(aux.max_scores, want_max * math.log(2), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(aux.lse, want_lse * math.log(2), atol=1e-6, rtol=1e-6)
    assert torch.isneginf(aux.max_scores[:, :, :4]).all() and not aux.max_scores.requires_grad
    (out.square().sum() + aux.lse.sum()).backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    plain, lse = fa.flex_attention(q, k, v, score_mod=score, block_mask=bm, scale=0.25, return_lse=True)
    (plain.square().sum() + lse.sum()).backward()
    for a, t in zip(got, (q, k, v)):
        torch.testing.assert_close(a, t.grad)
    only_lse = fa.flex_attention(q, k, v, block_mask=bm, return_aux=fa.AuxRequest(lse=True))[1]
    assert only_lse.lse is not None and only_lse.max_scores is None
    assert fa.flex_attention(q, k, v, return_aux=fa.AuxRequest())[1] == fa.AuxOutput(None, None)
    with pytest.raises(ValueError, match="return_lse and return_aux"):
        fa.flex_attention(q, k, v, return_lse=True, return_aux=fa.AuxRequest(lse=True))


def test_vector_reads_with_dot_and_sum_train_like_torch():
    """A score mod reading rows of captured tensors and reducing them — torch.dot, ``@``,
    ``(a * b).sum()``, ``.mean(-1)`` — traces (unrolled, mods/vectors.py) and matches
    attention computed with torch ops, forward and gradients of q, k, v and of the
    captured embeddings (GQA: the kv head is h // G)."""
    g = torch.Generator().manual_seed(11)
    B, Hq, Hkv, S, D, R = 2, 4, 2, 23, 8, 6
    G = Hq // Hkv
    q = torch.randn(B, Hq, S, D, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    q_emb = (0.3 * torch.randn(B, Hq, S, R, generator=g, dtype=torch.float64)).requires_grad_()
    k_emb = (0.3 * torch.randn(B, Hkv, S, R, generator=g, dtype=torch.float64)).requires_grad_()

    def score(s, b, h, q_idx, kv_idx):
        a, c = q_emb[b, h, q_idx], k_emb[b, h // G, kv_idx]
        return s + torch.dot(a, c) + 0.5 * (a * c).sum() - (a @ c) * 0.25 + (a - c).square().mean(-1)

    out = fa.flex_attention(q, k, v, score_mod=score, enable_gqa=True)
    kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    ke = k_emb.repeat_interleave(G, 1)
    dots = torch.einsum("bhqr,bhkr->bhqk", q_emb, ke)
    sq = ((q_emb[:, :, :, None, :] - ke[:, :, None, :, :]) ** 2).mean(-1)
    s = q @ kk.transpose(-1, -2) / math.sqrt(D) + 1.25 * dots + sq
    want = torch.softmax(s, -1) @ vv
    torch.testing.assert_close(out, want)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, q_emb, k_emb), grad)
    exp = torch.autograd.grad(want, (q, k, v, q_emb, k_emb), grad)
    for a, b in zip(got, exp):
        torch.testing.assert_close(a, b)


def test_vector_reads_refuse_what_they_cannot_unroll():
    from flexattn.mods.trace import TraceError

    big = torch.randn(4, 300)
    emb = torch.randn(4, 6)
    table = torch.randn(4, 3, 3)
    with pytest.raises(TraceError, match="at most 256"):
        mods.score_mod(lambda s, b, h, q, kv: s + big[h].sum())
    with pytest.raises(TraceError, match="lengths 6 and 3"):
        mods.score_mod(lambda s, b, h, q, kv: s + torch.dot(emb[h], table[h, 0]))
    with pytest.raises(TraceError, match="1-D"):
        mods.score_mod(lambda s, b, h, q, kv: s + torch.dot(table[h], table[h]))
    # a row left unreduced (the capture indexed in fewer dims than it has): says so
    with pytest.raises(TraceError, match=r"vector of shape \(6,\) appeared as the function's return value"):
        mods.score_mod(lambda s, b, h, q, kv: s + emb[h])
    with pytest.raises(TraceError, match=r"vector of shape \(3, 3\)"):
        mods.mask_mod(lambda b, h, q, kv: table[h] > 0)


def test_block_masks_of_the_torch_module_hold_tensors():
    """Index lists of block masks made through flexattn.torch are int32 torch tensors, as
    torch's (create_block_mask, from_kv_blocks, slices, to, update), equal to torch's own;
    the kernels keep reading the host arrays (list_array)."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    def mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 70)

    ours = fa.create_block_mask(mask, 2, 3, 320, 320, BLOCK_SIZE=32)   # (torch pads a partial last row differently)
    theirs = torch_create_block_mask(mask, 2, 3, 320, 320, device="cpu", BLOCK_SIZE=32)
    assert isinstance(ours, fa.BlockMask) and isinstance(ours, flexattn.BlockMask)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        got = getattr(ours, name)
        assert isinstance(got, torch.Tensor) and got.dtype == torch.int32 and got.device.type == "cpu", name
        assert isinstance(ours.list_array(name), np.ndarray)
        np.testing.assert_array_equal(got.numpy(), ours.list_array(name))
    torch.testing.assert_close(ours.kv_num_blocks, theirs.kv_num_blocks)
    torch.testing.assert_close(ours.full_kv_num_blocks, theirs.full_kv_num_blocks)
    assert all(isinstance(x, torch.Tensor) for x in ours.as_tuple()[2:10])
    ours.kv_indices.zero_()   # the presented tensor is a copy: the kernels' lists stay
    assert ours.list_array("kv_indices").any()
    derived = [ours[0], ours[:, 1], ours._adjust(200, 200), ours.to("cpu"),
               fa.BlockMask.from_kv_blocks(theirs.kv_num_blocks, theirs.kv_indices, BLOCK_SIZE=32)]
    for d in derived:
        assert type(d) is fa.BlockMask and isinstance(d.kv_indices, torch.Tensor)
    docs = fa.create_block_mask(flexattn.mods.document(torch.arange(64) // 20), None, None, 64, 64, BLOCK_SIZE=16)
    assert isinstance(docs.update(torch.arange(64) // 30).q_indices, torch.Tensor)
    # the core's own block masks keep numpy lists
    assert isinstance(flexattn.create_block_mask(mask, None, None, 300, 300).kv_indices, np.ndarray)


def test_block_masks_whose_lists_do_not_fit_the_call_are_refused_before_launch():
    """A user-made block mask whose lists hold more (or fewer) blocks than the call's lengths
    need would send the kernels past the ends of its rows or past the keys: a clear error
    before any launch (CPU tensors take the same checks)."""
    q = torch.randn(1, 2, 300, 16)
    num = torch.ones(1, 1, 4, dtype=torch.int32)
    idx = torch.tensor([0, 1, 2, 3], dtype=torch.int32).repeat(1, 1, 4, 1)
    wide = fa.BlockMask.from_kv_blocks(num * 4, idx, BLOCK_SIZE=128, seq_lengths=(300, 300))   # 4 x 4 > 3 x 3
    with pytest.raises(ValueError, match=r"lists 4 x 4 blocks of 128 x 128, but Q_LEN=300, KV_LEN=300 need 3 x 3"):
        fa.flex_attention(q, q, q, block_mask=wide)
    fits = fa.BlockMask.from_kv_blocks(num[..., :3] * 3, idx[..., :3, :3], BLOCK_SIZE=128, seq_lengths=(300, 300))
    fa.flex_attention(q, q, q, block_mask=fits)
    with pytest.raises(ValueError, match="kv_indices"):   # counts beyond the lists, indices out of range
        fa.BlockMask.from_kv_blocks(num * 5, idx)
    with pytest.raises(ValueError, match="kv_indices"):
        fa.BlockMask.from_kv_blocks(num, idx + 4)


def test_create_block_mask_keyword_arguments_as_torch():
    """create_block_mask(separate_full_blocks=False): every visited block listed as partial,
    as torch's lists; the same attention; compute_dq_write_order / dq_kv_order accepted."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    def mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 70)

    import inspect

    ours = fa.create_block_mask(mask, None, None, 300, 300, BLOCK_SIZE=32, separate_full_blocks=False,
                                compute_dq_write_order=True, dq_kv_order=False)
    assert int(np.asarray(ours.full_kv_num_blocks).sum()) == 0
    # torch's own lists to compare with, where this torch has the argument (2.11 lacks it)
    if "separate_full_blocks" in inspect.signature(torch_create_block_mask).parameters:
        theirs = torch_create_block_mask(mask, None, None, 300, 300, device="cpu", BLOCK_SIZE=32,
                                         separate_full_blocks=False)
        np.testing.assert_array_equal(np.asarray(ours.kv_num_blocks), theirs.kv_num_blocks.numpy())
        n = np.asarray(ours.kv_num_blocks)
        for row in np.ndindex(n.shape):
            np.testing.assert_array_equal(np.sort(np.asarray(ours.kv_indices)[row][:n[row]]),
                                          np.sort(theirs.kv_indices[row][:n[row]].numpy()))
    separate = fa.create_block_mask(mask, None, None, 300, 300, BLOCK_SIZE=32)
    assert int(np.asarray(separate.full_kv_num_blocks).sum()) > 0
    q, k, v = (torch.randn(1, 2, 300, 16, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(fa.flex_attention(q, k, v, block_mask=ours), fa.flex_attention(q, k, v, block_mask=separate))


def test_mask_device_defaults_as_torch(monkeypatch):
    """``device=None`` in create_block_mask / create_mask is torch's default: the current
    accelerator (the mask is built and kept there), the host on a machine without one."""
    built = []
    monkeypatch.setattr(fa, "_create_block_mask", lambda mask, B, H, Q, KV, device, *rest: built.append(device) or
                        __import__("flexattn").create_block_mask(mask, B, H, Q, KV))
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: None)
    fa.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 64, 64)
    assert fa.create_mask(lambda b, h, q, kv: q >= kv, None, None, 4, 4).device.type == "cpu"
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda check_available=False: torch.device("cuda"))
    fa.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 64, 64)
    fa.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 64, 64, device="cpu")
    assert built == [None, "cuda", "cpu"]


def _paged_decode_problem(B=3, Hq=4, Hkv=2, D=16, page=16, n_pages=14, L=64, lengths=(40, 64, 17)):
    """torch's PagedAttention as its users decode: one physical cache of batch 1 holding
    every sequence's pages (shuffled by reservation order), a q_len-1 query per sequence,
    and a torch block mask over logical positions converted to physical pages. Returns
    (q, physical k / v, converted block mask, logical k / v, logical block mask)."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    g = torch.Generator().manual_seed(31)
    paged = PagedAttention(n_pages, page, B, device="cpu")
    for b in reversed(range(B)):             # later sequences take the first pages
        paged.reserve(torch.tensor(b), torch.tensor(L))
    k_cache, v_cache = (torch.zeros(1, Hkv, n_pages * page, D, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, Hkv, L, D, generator=g, dtype=torch.float64) for _ in range(2))
    paged.assign(torch.arange(B), torch.arange(L)[None].expand(B, L), k, v, k_cache, v_cache)
    lens = torch.tensor(lengths)
    logical = torch_create_block_mask(lambda b, h, qi, ki: ki < lens[b], B, None, 1, L, device="cpu",
                                      BLOCK_SIZE=page)
    q = torch.randn(B, Hq, 1, D, generator=g, dtype=torch.float64)
    return q, k_cache, v_cache, paged.convert_logical_block_mask(logical), k, v, logical


def test_key_value_batch_of_one_broadcasts_as_torchs():
    """torch broadcasts a key / value batch of 1 over the query batch (its PagedAttention
    decodes that way): the same outputs as torch's flex_attention and as the logical
    cache; gradients of the shared K / V summed over the batch (as of explicit copies)."""
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    q, k_cache, v_cache, physical, k, v, logical = _paged_decode_problem()
    out = fa.flex_attention(q, k_cache, v_cache, block_mask=physical, enable_gqa=True)
    torch.testing.assert_close(out, torch_flex(q, k_cache, v_cache, block_mask=physical, enable_gqa=True))
    torch.testing.assert_close(out, fa.flex_attention(q, k, v, block_mask=logical, enable_gqa=True))

    g = torch.Generator().manual_seed(32)
    q = torch.randn(3, 4, 24, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k1, v1 = (torch.randn(1, 2, 30, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    score = lambda s, b, h, qi, ki: s + 0.1 * b - 0.05 * (qi - ki).abs()   # noqa: E731  (per-sequence)
    got = fa.flex_attention(q, k1, v1, score_mod=score, enable_gqa=True, return_lse=True)
    grads = torch.autograd.grad(got[0].square().sum() + got[1].sum(), (q, k1, v1))
    copies = [t.detach().expand(3, -1, -1, -1).clone().requires_grad_() for t in (k1, v1)]
    want = fa.flex_attention(q, *copies, score_mod=score, enable_gqa=True, return_lse=True)
    want_grads = torch.autograd.grad(want[0].square().sum() + want[1].sum(), (q, *copies))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grads[0], want_grads[0])
    for a, b in zip(grads[1:], want_grads[1:]):
        torch.testing.assert_close(a, b.sum(0, keepdim=True))
    with pytest.raises(ValueError, match="batch sizes differ"):
        fa.flex_attention(q, k1.expand(2, -1, -1, -1), v1.expand(2, -1, -1, -1), enable_gqa=True)


def test_device_copies_key_tensors_read_in_place():
    """``Device.same_memory`` for torch: a tensor on the device and contiguous is handed to
    the kernel as a view of itself, so it is keyed by its data pointer, dtype and shape (an
    update in place keeps the key; a rebound storage changes it); strided tensors and
    tensors on another device are copied at every launch (no key)."""
    from flexattn.torch.devices import _DeviceCopies

    copies = _DeviceCopies(torch.device("cpu"))
    table = torch.arange(12.0).reshape(3, 4)
    key = copies.same_memory(table)
    assert key is not None and copies(table).data_ptr() == table.data_ptr()
    table.mul_(2)
    assert copies.same_memory(table) == key                          # in place: same memory
    table.data = torch.zeros(3, 4)
    assert copies.same_memory(table) != key                          # rebound storage
    assert copies.same_memory(table.t()) is None                     # strided: copied contiguous
    assert copies.same_memory(np.arange(3)) is None                  # host arrays: copied
    assert _DeviceCopies(torch.device("meta")).same_memory(table) is None   # another device
