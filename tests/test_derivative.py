"""Symbolic derivative of score mods vs torch autograd (float64) on the same functions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flexattn.mods import alibi, bias, relative_bias, score_mod, softcap
from flexattn.mods import ir
from flexattn.mods.derivative import differentiate
from flexattn.mods.evaluate import evaluate

B, H, QL, KVL, D = 2, 3, 7, 9, 2
SHAPE = (B, H, QL, KVL)


def np_grid():
    return (np.arange(B).reshape(B, 1, 1, 1), np.arange(H).reshape(1, H, 1, 1),
            np.arange(QL).reshape(1, 1, QL, 1), np.arange(KVL).reshape(1, 1, 1, KVL))


def torch_grid():
    return tuple(torch.from_numpy(x) for x in np_grid())


def leaf(rng, *shape, offset=0.0):
    return (torch.from_numpy(rng.normal(size=shape)) + offset).requires_grad_(True)


def symbolic_grads(mod, score, dS):
    """dL/dscore and dL/dbuffer (per capture slot) from the symbolic derivative."""
    caps = [c.detach().numpy() if isinstance(c, torch.Tensor) else c for c in mod.captures]
    b, h, q, kv = np_grid()
    env = {"score": score, "b": b, "h": h, "q": q, "kv": kv}
    der = differentiate(mod.expr)
    d_score = dS * np.broadcast_to(evaluate(der.d_score, env, caps), SHAPE)
    grads = {}
    for load, g in der.d_loads:
        assert load.op == "load" and load.dtype == ir.FLOAT and g.dtype == ir.FLOAT
        slot = load.attr.slot
        idx = tuple(np.broadcast_to(evaluate(a, env, caps), SHAPE) for a in load.args)
        contrib = dS * np.broadcast_to(evaluate(g, env, caps), SHAPE)
        buf = grads.setdefault(slot, np.zeros(np.shape(caps[slot])))
        np.add.at(buf, idx, contrib)
    return d_score, grads, der


def autograd(fn, score, dS, tensors):
    s = torch.from_numpy(score.copy()).requires_grad_(True)
    for t in tensors:
        t.grad = None
    out = fn(s, *torch_grid())
    (out * torch.from_numpy(dS)).sum().backward()
    return s.grad.numpy(), [t.grad.numpy() if t.grad is not None else np.zeros(t.shape) for t in tensors]


def check(mod, fn, tensors, seed=0, scale=2.0):
    rng = np.random.default_rng(seed)
    score = rng.normal(size=SHAPE) * scale
    dS = rng.normal(size=SHAPE)
    d_score, grads, der = symbolic_grads(mod, score, dS)
    t_score, t_grads = autograd(fn, score, dS, tensors)
    np.testing.assert_allclose(d_score, t_score, rtol=1e-7, atol=1e-9)
    for t, tg in zip(tensors, t_grads):
        slots = [i for i, c in enumerate(mod.captures) if c is t]
        assert len(slots) == 1, "each trainable tensor is one capture"
        got = grads.get(slots[0], np.zeros(t.shape))
        np.testing.assert_allclose(got, tg, rtol=1e-7, atol=1e-9)
    return der


def _cases():
    rng = np.random.default_rng(42)
    cases = {}

    cases["softcap"] = lambda: (softcap(5.0), lambda s, b, h, q, kv: 5.0 * torch.tanh(s / 5.0), [])

    def alibi_case():
        slopes = leaf(rng, H)
        return alibi(slopes), lambda s, b, h, q, kv: s + slopes[h] * (kv - q), [slopes]
    cases["alibi"] = alibi_case

    def rel_case():
        table = leaf(rng, H, 2 * D + 1)
        return (relative_bias(table),
                lambda s, b, h, q, kv: s + table[h, torch.clamp(q - kv, -D, D) + D], [table])
    cases["relative_bias_per_head"] = rel_case

    def rel1_case():
        table = leaf(rng, 2 * D + 1)
        return relative_bias(table), lambda s, b, h, q, kv: s + table[torch.clamp(q - kv, -D, D) + D], [table]
    cases["relative_bias_shared"] = rel1_case

    def bias_case():
        t = leaf(rng, H, QL, KVL)
        return bias(t), lambda s, b, h, q, kv: s + t[h, q, kv], [t]
    cases["bias_3d"] = bias_case

    def bias_bcast_case():
        t = leaf(rng, 1, H, 1, KVL)
        return bias(t), lambda s, b, h, q, kv: s + t[0, h, 0, kv], [t]
    cases["bias_broadcast"] = bias_bcast_case

    def read_twice():
        w = leaf(rng, H)
        f = lambda s, b, h, q, kv: s * w[h] + w[h] ** 2  # noqa: E731
        return score_mod(f), f, [w]
    cases["buffer_read_twice"] = read_twice

    # torch functions the tracer writes with the IR's own ops (trace.py): the derivative
    # pass sees only those ops
    def rewritten():
        w, c = leaf(rng, H), leaf(rng, KVL)
        f = lambda s, b, h, q, kv: (torch.logaddexp(s, c[kv] * w[h]) + torch.log1p(s * s)  # noqa: E731
                                    - torch.expm1(-w[h] ** 2) + torch.fmod(s * 3.0, 1.3 + w[h] ** 2)
                                    + torch.trunc(s) * w[h])
        return score_mod(f), f, [w, c]
    cases["logaddexp_log1p_expm1_fmod_trunc"] = rewritten

    def periodic():
        freq = leaf(rng, H)
        f = lambda s, b, h, q, kv: s * torch.cos(s * 0.3) + torch.sin(freq[h] * (q - kv))  # noqa: E731
        return score_mod(f), f, [freq]
    cases["sin_cos"] = periodic

    def tanh_sigmoid():
        w, w2 = leaf(rng, H), leaf(rng, QL)
        f = lambda s, b, h, q, kv: torch.tanh(s) * w[h] + torch.sigmoid(s * w2[q])  # noqa: E731
        return score_mod(f), f, [w, w2]
    cases["tanh_sigmoid"] = tanh_sigmoid

    def unaries():
        f = lambda s, b, h, q, kv: (torch.exp(s / 4) + torch.log(s.abs() + 1) + torch.sqrt(s.abs() + 0.5)  # noqa: E731
                                    + torch.rsqrt(s * s + 1) + torch.exp2(s / 8) + torch.log2(s.abs() + 2))
        return score_mod(f), f, []
    cases["unaries"] = unaries

    def min_max():
        w = leaf(rng, H)
        f = lambda s, b, h, q, kv: torch.minimum(s, w[h]) + torch.maximum(s * 0.5, -w[h])  # noqa: E731
        return score_mod(f), f, [w]
    cases["min_max"] = min_max

    def where_case():
        w = leaf(rng, H)
        f = lambda s, b, h, q, kv: torch.where(s > w[h], s * 2, s * s) + torch.where(q >= kv, w[h], 0.0)  # noqa: E731
        return score_mod(f), f, [w]
    cases["where"] = where_case

    def div_case():
        w = leaf(rng, H, offset=5.0)
        f = lambda s, b, h, q, kv: s / w[h] - (s * s) / (w[h] * w[h] + 1)  # noqa: E731
        return score_mod(f), f, [w]
    cases["truediv"] = div_case

    def abs_neg():
        w = leaf(rng, KVL)
        f = lambda s, b, h, q, kv: torch.abs(s - w[kv]) - (s - w[kv] * 3)  # noqa: E731
        return score_mod(f), f, [w]
    cases["abs_neg_sub"] = abs_neg

    def remainder():
        w = leaf(rng, H)
        f = lambda s, b, h, q, kv: torch.remainder(s, w[h].abs() + 1.0)  # noqa: E731
        return score_mod(f), f, [w]
    cases["remainder"] = remainder

    def casts():
        f = lambda s, b, h, q, kv: s + (s * 3).int() + (s > 0).float() * s  # noqa: E731
        return score_mod(f), f, []
    cases["casts"] = casts

    def clamp_case():
        w = leaf(rng, H)
        f = lambda s, b, h, q, kv: s.clamp(-1.0, 1.0) * w[h] + torch.clamp(s * w[h], min=0.0)  # noqa: E731
        return score_mod(f), f, [w]
    cases["clamp"] = clamp_case

    def chain():
        slopes = leaf(rng, H)
        m = softcap(4.0) >> alibi(slopes) >> score_mod(lambda s, b, h, q, kv: s * s)
        f = lambda s, b, h, q, kv: (4.0 * torch.tanh(s / 4.0) + slopes[h] * (kv - q)) ** 2  # noqa: E731
        return m, f, [slopes]
    cases["chain"] = chain

    def powers():
        w = leaf(rng, QL)
        f = lambda s, b, h, q, kv: s ** 3 * 0.125 + (s.abs() + 1) ** -0.5 + (s * s + w[q] ** 2 + 1) ** 0.5  # noqa: E731
        return score_mod(f), f, [w]
    cases["powers"] = powers

    def float_index_buffer():
        w = leaf(rng, H, QL)
        ids = torch.tensor([0, 1, 1, 2, 0, 2, 1])
        f = lambda s, b, h, q, kv: s * w[h, ids[q]] + w[h, q].exp()  # noqa: E731
        return score_mod(f), f, [w]
    cases["nested_index"] = float_index_buffer

    def float16_buffer():
        w16 = torch.from_numpy(rng.normal(size=H)).half()
        f = lambda s, b, h, q, kv: s * w16[h]  # noqa: E731
        return score_mod(f), (lambda s, b, h, q, kv: s * w16.double()[h]), []
    cases["float16_buffer_no_grad_requested"] = float16_buffer

    # torch_functions.py: closed forms, so their derivatives are exact up to rounding
    def closed_form_functions():
        w, c = leaf(rng, H), leaf(rng, KVL)
        f = lambda s, b, h, q, kv: (torch.sinh(s / 4) * w[h] + torch.cosh(c[kv]) + F.softplus(s, beta=2.0)  # noqa: E731
                                    + torch.pow(s.abs() + 0.5, w[h]) + torch.pow(2.0, s * c[kv]) + F.silu(s * w[h])
                                    + torch.asinh(c[kv] * s) + F.elu(s) + F.mish(s) + torch.hypot(s, c[kv])
                                    + torch.log10(s * s + 1) + torch.lerp(s, c[kv], 0.7) + (s.abs() + 1) ** 1.5)
        return score_mod(f), f, [w, c]
    cases["sinh_cosh_softplus_pow_silu_asinh_elu_mish_hypot"] = closed_form_functions

    # erf and atan are IR nodes with exact derivatives; gelu, erfc, asin, acos, atan2 are built on them
    def erf_atan_family():
        w = leaf(rng, H)
        f = lambda s, b, h, q, kv: (torch.erf(s * w[h]) + torch.erfc(s) + torch.atan(s * w[h]) + F.gelu(s)  # noqa: E731
                                    + torch.atan2(s, w[h]) + torch.asin(torch.tanh(s) * 0.9)
                                    + torch.acos(torch.sigmoid(s * w[h])))
        return score_mod(f), f, [w]
    cases["erf_erfc_atan_gelu_atan2_asin_acos"] = erf_atan_family

    # reductions of vector reads (mods/vectors.py): the gradient reaches every element read
    # (trailing dims named, so torch's broadcast evaluation of the same function agrees)
    def vector_reductions():
        e = leaf(rng, H, 3, 2)
        last2 = (-2, -1)
        f = lambda s, b, h, q, kv: (s * e[h].amax(dim=last2) + torch.logsumexp(e[h], dim=-1).sum(-1) * s  # noqa: E731
                                    + e[h].norm(dim=last2) * s + e[h, 0].prod(-1) + e[h].var(dim=last2) * s
                                    + e[h].std(dim=-2).sum(-1) + torch.linalg.vector_norm(e[h] * 0.5, ord=3, dim=last2))
        return score_mod(f), f, [e]
    cases["amax_logsumexp_norm_prod_var_std"] = vector_reductions
    return cases


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_derivative_matches_autograd(name):
    mod, fn, tensors = CASES[name]()
    check(mod, fn, tensors)


def test_int_buffers_have_no_gradient():
    ids = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2])
    mod = score_mod(lambda s, b, h, q, kv: s * 2 + ids[kv])
    der = differentiate(mod.expr)
    assert der.d_loads == ()
    assert der.d_score == ir.const(2.0)


def test_score_not_used():
    w = torch.ones(H, dtype=torch.float64)
    der = differentiate(score_mod(lambda s, b, h, q, kv: w[h] * q).expr)
    assert der.d_score == ir.const(0.0)
    assert len(der.d_loads) == 1


def test_identity_and_same_read_merged():
    assert differentiate(score_mod(lambda s, b, h, q, kv: s).expr).d_score == ir.const(1.0)
    w = torch.ones(H, dtype=torch.float64)
    der = differentiate(score_mod(lambda s, b, h, q, kv: s * w[h] + w[h] * w[h]).expr)
    assert len(der.d_loads) == 1  # one read site: w[h]
    der2 = differentiate(score_mod(lambda s, b, h, q, kv: w[h] + w[q % H]).expr)
    assert len(der2.d_loads) == 2  # two different reads of the same buffer


def test_tie_of_min_max_splits_gradient():
    w = torch.zeros(H, dtype=torch.float64)
    mod = score_mod(lambda s, b, h, q, kv: torch.maximum(s, w[h]))
    der = differentiate(mod.expr)
    env = {"score": np.array([0.0, 1.0, -1.0]), "h": np.array([0, 1, 2])}
    np.testing.assert_allclose(evaluate(der.d_score, env, [w.numpy()]), [0.5, 1.0, 0.0])
    (load, g), = der.d_loads
    np.testing.assert_allclose(evaluate(g, env, [w.numpy()]), [0.5, 0.0, 1.0])
    # torch agrees at ties
    s = torch.tensor([0.0, 1.0, -1.0], dtype=torch.float64, requires_grad=True)
    w2 = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    torch.maximum(s, w2).sum().backward()
    np.testing.assert_allclose(s.grad.numpy(), [0.5, 1.0, 0.0])


def test_finite_differences_for_builtins():
    rng = np.random.default_rng(5)
    for mod in (softcap(3.0), softcap(3.0) >> softcap(1.5), alibi(num_heads=H)):
        score = rng.normal(size=SHAPE)
        caps = [c.detach().numpy() if isinstance(c, torch.Tensor) else c for c in mod.captures]
        b, h, q, kv = np_grid()
        env = {"score": score, "b": b, "h": h, "q": q, "kv": kv}
        eps = 1e-6
        fd = (evaluate(mod.expr, {**env, "score": score + eps}, caps)
              - evaluate(mod.expr, {**env, "score": score - eps}, caps)) / (2 * eps)
        d = np.broadcast_to(evaluate(differentiate(mod.expr).d_score, env, caps), SHAPE)
        np.testing.assert_allclose(d, fd, rtol=1e-6, atol=1e-8)
