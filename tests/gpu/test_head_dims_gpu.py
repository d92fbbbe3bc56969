"""GPU: the forward kernel at every head dim it takes beyond 64 / 128 and below 64 (16 and 32 run
four consumer warpgroups), and value head dims that differ from the query's (issue 25, item 1), against
the float64 reference.

Random shapes (odd lengths, Q != KV, GQA), NaN-poisoned outputs, LSE checked, each head-dim
pair under a dense, causal, band (sliding window as a lambda), block-sparse (documents) and
scored (softcap + ALiBi) call. The backward runs every multiple of 16 from 32 to 256: trained
at 32, 48, 80, 96, 112 (48, 80, 112: dQ halves that are not multiples of 16) and, with the
head dim split between the warpgroups, 144, 192, 256 against the reference, and with value
head dims apart from the query's; at head dim 16 a call autograd records is refused before
any launch with an error that says so.
"""

import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")

import flexattn.torch as fa  # noqa: E402
from flexattn import reference  # noqa: E402
from flexattn.core import AttentionSpec, check_inputs  # noqa: E402
from flexattn.core.kernel_path import plan_forward  # noqa: E402
from forward_check import check_forward  # noqa: E402
from mod_cases import STRUCTURES, structure_mods  # noqa: E402

PAIRS = [(16, 16), (16, 32), (32, 32), (80, 80), (96, 96), (192, 192), (256, 256), (192, 128), (128, 64), (64, 128),
         (256, 128)]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"d{p[0]}-{p[1]}")
@pytest.mark.parametrize("kind", STRUCTURES)
def test_head_dims_against_reference(pair, kind):
    D, Dv = pair
    rng = np.random.default_rng(zlib.crc32(repr((pair, kind)).encode()))
    torch.manual_seed(int(rng.integers(0, 2**31)))
    B, Hkv = int(rng.integers(1, 3)), int(rng.choice([1, 2]))
    Hq = Hkv * int(rng.choice([1, 2, 4]))
    Q = int(rng.integers(1, 600))
    KV = Q if kind in ("causal", "band", "scored") and rng.random() < 0.5 else int(rng.integers(1, 600))
    dtype = torch.bfloat16 if rng.random() < 0.7 else torch.float16
    q = torch.randn(B, Hq, Q, D, device="cuda", dtype=dtype)
    k = torch.randn(B, Hkv, KV, D, device="cuda", dtype=dtype)
    v = torch.randn(B, Hkv, KV, Dv, device="cuda", dtype=dtype)
    score, mask = structure_mods(kind, rng, Hq, max(Q, KV))
    spec = AttentionSpec.from_args(score=score, mask=mask, enable_gqa=True)
    shape = check_inputs(q, k, v, spec)
    check_forward(f"D{D}/{Dv} {kind} B{B} Hq{Hq} Hkv{Hkv} Q{Q} KV{KV} {dtype}", q, k, v, spec, shape)
    # The planned tiles are the ones the planner tests expect to fit (no launch failure above).
    plan = plan_forward(q, shape, spec)
    assert (plan.config.head_dim, plan.config.head_dim_v) == (D, Dv)


def _scored_call(seed_key, D, causal, make_score):
    """A door call with the score ``make_score(slopes)`` (ALiBi's slopes for its heads),
    causal or not, on fresh random inputs drawn from ``seed_key``: odd lengths, GQA, bf16 or
    fp16. Returns (q, k, v, shape, spec, name)."""
    from flexattn import mods

    rng = np.random.default_rng(zlib.crc32(repr(seed_key).encode()))
    torch.manual_seed(int(rng.integers(0, 2**31)))
    B, Hkv = int(rng.integers(1, 3)), int(rng.choice([1, 2]))
    Hq = Hkv * int(rng.choice([1, 2, 4]))
    Q = int(rng.integers(300, 1100))
    KV = Q if causal and rng.random() < 0.5 else int(rng.integers(1, 1100))
    dtype = torch.bfloat16 if rng.random() < 0.7 else torch.float16
    q = torch.randn(B, Hq, Q, D, device="cuda", dtype=dtype)
    k = torch.randn(B, Hkv, KV, D, device="cuda", dtype=dtype)
    v = torch.randn(B, Hkv, KV, D, device="cuda", dtype=dtype)
    slopes = torch.exp2(-8.0 * torch.arange(1, Hq + 1, device="cuda") / Hq)
    spec = AttentionSpec.from_args(score_mod=make_score(slopes), mask=mods.causal() if causal else None,
                                   enable_gqa=True)
    name = f"D{D} causal={causal} B{B} Hq{Hq} Hkv{Hkv} Q{Q} KV{KV} {dtype}"
    return q, k, v, check_inputs(q, k, v, spec), spec, name


# Light score mods take the four consumer warpgroups' 256-row tiles at D <= 64 (kernel_path.
# _tall_tile_score): torch-style functions (a division by a constant included), built-ins and
# their chain, causal or not, with odd lengths and GQA.
def _alibi_softcap(slopes):
    from flexattn import mods

    return mods.alibi(slopes) >> mods.softcap(7.0)


LIGHT_SCORES = {
    "softcap_division": lambda slopes: lambda s, b, h, q, kv: 30 * torch.tanh(s / 30),
    "alibi_torch": lambda slopes: lambda s, b, h, q, kv: s + slopes[h] * (kv - q),
    "alibi_softcap": _alibi_softcap,
    "shifted": lambda slopes: lambda s, b, h, q, kv: 20 * torch.tanh((s + slopes[h] * (kv - q)) / 20) - 0.25,
}


@pytest.mark.parametrize("D", [32, 64])
@pytest.mark.parametrize("name", list(LIGHT_SCORES))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "dense"])
def test_light_score_mods_on_four_warpgroup_tiles(D, name, causal):
    q, k, v, shape, spec, desc = _scored_call((D, name, causal), D, causal, LIGHT_SCORES[name])
    assert plan_forward(q, shape, spec).config.tile_m == 256
    check_forward(f"{name} {desc}", q, k, v, spec, shape)


# Scaled indices (planned; FLEXATTN_SCALED_INDICES=0 turns them off): a float index's product
# with a row constant as one FFMA per element (affine_index.FloatAffine): ALiBi, a product of
# two factors, a constant slope, a negated index.
SCALED = {
    "alibi": lambda slopes: lambda s, b, h, q, kv: s + slopes[h] * (kv - q),
    "two_factors": lambda slopes: lambda s, b, h, q, kv: s + 0.5 * (slopes[h] * (kv - q)),
    "constant": lambda slopes: lambda s, b, h, q, kv: s + (kv - q) * 0.01,
    "negated": lambda slopes: lambda s, b, h, q, kv: s + slopes[h] * (q - kv),
}


@pytest.mark.parametrize("D", [32, 128])
@pytest.mark.parametrize("name", sorted(SCALED))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "dense"])
def test_scaled_indices_against_reference(D, name, causal, monkeypatch):
    monkeypatch.delenv("FLEXATTN_SCALED_INDICES", raising=False)
    q, k, v, shape, spec, desc = _scored_call(("scaled", D, name, causal), D, causal, SCALED[name])
    assert plan_forward(q, shape, spec).config.mods.scaled_indices
    check_forward(f"{name} {desc}", q, k, v, spec, shape)


def test_torch_door_inference_and_a_clear_error_for_gradients():
    q = torch.randn(2, 4, 300, 16, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    out = fa.flex_attention(q, k, v, block_mask=fa.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 300, 300))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="backward supports query and value head dims"):
        fa.flex_attention(q.requires_grad_(), k, v)


BACKWARD_DIMS = [32, 48, 80, 96, 112, 144, 192, 256]
# Error bounds relative to the largest reference gradient (max-abs) and to its norm (as
# tests/gpu/test_autograd_gpu.py).
GRAD_TOL = {torch.bfloat16: (4e-2, 1.5e-2), torch.float16: (1e-2, 4e-3)}


@pytest.mark.parametrize("D", BACKWARD_DIMS)
@pytest.mark.parametrize("kind", ["causal", "band", "documents", "scored"])
def test_backward_head_dims_against_reference(D, kind):
    """Training at head dims beyond 64 / 128 (equal value head dim): gradients of q, k, v
    through the torch door (autograd, the backward kernels) against the float64 reference."""
    _train_against_reference(D, D, kind)


# Value head dims apart from the query's (BwdConfig head_dim_v), through the torch door.
VALUE_PAIRS = [(128, 64), (64, 128), (96, 64), (128, 96), (192, 128), (256, 128), (128, 256)]


@pytest.mark.parametrize("pair", VALUE_PAIRS, ids=lambda p: f"d{p[0]}-{p[1]}")
@pytest.mark.parametrize("kind", ["causal", "documents", "scored"])
def test_backward_value_head_dims_against_reference(pair, kind):
    _train_against_reference(*pair, kind)


def _train_against_reference(D, Dv, kind):
    rng = np.random.default_rng(zlib.crc32(repr(("bwd", D, kind) if D == Dv else ("bwd", D, Dv, kind)).encode()))
    torch.manual_seed(int(rng.integers(0, 2**31)))
    B, Hkv = int(rng.integers(1, 3)), int(rng.choice([1, 2]))
    Hq = Hkv * int(rng.choice([1, 2]))
    Q = int(rng.integers(64, 500))
    KV = Q if rng.random() < 0.5 else int(rng.integers(64, 500))
    dtype = torch.bfloat16 if rng.random() < 0.7 else torch.float16
    q, k, v = (torch.randn(B, h, n, d, device="cuda", dtype=dtype).requires_grad_()
               for h, n, d in ((Hq, Q, D), (Hkv, KV, D), (Hkv, KV, Dv)))
    score, mask = structure_mods(kind, rng, Hq, max(Q, KV))
    out = fa.flex_attention(q, k, v, score_mod=score, mask=mask, enable_gqa=True)
    d_out = torch.randn_like(out)
    out.backward(d_out)
    spec = AttentionSpec.from_args(score=score, mask=mask, enable_gqa=True)
    want = reference.backward(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), d_out.cpu(), None, spec=spec)
    tol_max, tol_rel = GRAD_TOL[dtype]
    for name, got, ref in (("dq", q.grad, want.dq), ("dk", k.grad, want.dk), ("dv", v.grad, want.dv)):
        got = got.double().cpu().numpy()
        assert not np.isnan(got).any(), f"D{D}/{Dv} {kind} {name}: NaN"
        scale = max(np.abs(ref).max(), 1e-6)
        err, rel = np.abs(got - ref).max(), np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-12)
        assert err <= tol_max * scale and rel <= tol_rel, \
            f"D{D}/{Dv} {kind} {name}: max {err:.3g} (ref {scale:.3g}) rel {rel:.3g}"
