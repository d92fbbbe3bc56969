"""torch / numpy functions the tracer writes with the IR's own ops (mods/torch_functions.py).

Each is traced inside a score mod and evaluated by the IR's numpy interpreter (float64),
then compared with torch (float64) on the same values: random values of several scales
and the special ones (signed zeros, halves, +-1, overflow edges, infinities, NaN).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flexattn.mods import TraceError, score_mod

_rng = np.random.default_rng(2026)
SPECIAL = np.array([-np.inf, -1e30, -100.0, -89.0, -20.0, -3.0, -2.5, -1.5, -1.0, -0.5, -1e-3, -0.0, 0.0,
                    1e-3, 0.25, 0.5, 1.0, 1.5, 2.5, 1 + math.sqrt(2), 3.0, 20.0, 89.0, 100.0, 1e30, np.inf, np.nan])
RANDOM = np.concatenate([_rng.normal(size=40), _rng.normal(size=20) * 8, _rng.uniform(-1, 1, size=20),
                         np.round(_rng.normal(size=10) * 4) + 0.5])
VALUES = np.concatenate([SPECIAL, RANDOM]).astype(np.float32).astype(np.float64)   # float32-exact
N = len(VALUES)


def traced_on(fn, x, y=None):
    """fn(x) (or fn(x, y) over the grid x[:, None], y[None, :]) through a traced score mod."""
    if y is None:
        mod = score_mod(lambda s, b, h, q, kv: fn(s))
        return mod(x[:, None], 0, 0, np.arange(len(x))[:, None], np.zeros((1, 1), np.int64))[:, 0]
    ys = torch.from_numpy(y)
    mod = score_mod(lambda s, b, h, q, kv: fn(s, ys[kv]))
    return mod(np.broadcast_to(x[:, None], (len(x), len(y))), 0, 0, np.arange(len(x))[:, None],
               np.arange(len(y))[None, :])


def assert_matches(got, want, rtol=1e-6, atol=1e-6, signed_zeros=False):
    got, want = np.broadcast_to(got, want.shape), want
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
    same_inf = np.isinf(want)
    np.testing.assert_array_equal(got[same_inf], want[same_inf])
    if signed_zeros:
        zero = want == 0
        np.testing.assert_array_equal(np.signbit(got[zero]), np.signbit(want[zero]))


ONE_ARGUMENT = {
    "round": torch.round,
    "round_decimals": lambda x: torch.round(x, decimals=2),
    "round_negative_decimals": lambda x: torch.round(x, decimals=-1),
    "frac": torch.frac,
    "reciprocal": torch.reciprocal,
    "signbit": lambda x: torch.signbit(x).double(),
    "sgn": torch.sgn,
    "nan_to_num": lambda x: torch.nan_to_num(x.float(), nan=-7.0).double(),
    "clamp_min_max": lambda x: torch.clamp_min(x, -2.0) + x.clamp_max(1.5),
    "log10": lambda x: torch.log10(x.abs()),
    "atan": torch.atan,
    "arctan_method": lambda x: x.arctan(),
    "asin": torch.asin,
    "acos": torch.acos,
    "sinh": torch.sinh,
    "cosh": torch.cosh,
    "asinh": torch.asinh,
    "acosh": torch.acosh,
    "atanh": torch.atanh,
    "sinc": torch.sinc,
    "deg2rad_rad2deg": lambda x: torch.deg2rad(x) + torch.rad2deg(x) * 1e-3,
    "relu": F.relu,
    "relu6": F.relu6,
    "hardtanh": lambda x: F.hardtanh(x, -2.0, 3.0),
    "leaky_relu": lambda x: F.leaky_relu(x, 0.2),
    "elu": lambda x: F.elu(x, alpha=0.7),
    "selu": F.selu,
    "celu": lambda x: F.celu(x, alpha=1.5),
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "softplus": lambda x: F.softplus(x, beta=2.0, threshold=10.0),
    "mish": F.mish,
    "logsigmoid": F.logsigmoid,
    "hardsigmoid": F.hardsigmoid,
    "hardswish": F.hardswish,
    "softsign": F.softsign,
    "tanhshrink": F.tanhshrink,
    "threshold": lambda x: F.threshold(x, 0.5, -3.0),
    "hardshrink": lambda x: F.hardshrink(x, 0.7),
    "softshrink": lambda x: F.softshrink(x, 0.7),
    "special_expit_erf_ndtr": lambda x: torch.special.expit(x) + torch.special.erf(x) + torch.special.ndtr(x),
    "special_entr_logit": lambda x: torch.special.entr(x) + torch.special.logit(torch.sigmoid(x), eps=1e-3),
    "power_fraction": lambda x: torch.pow(x, 1.5),
    "power_negative_whole": lambda x: x ** -3,
    "power_large_whole": lambda x: torch.pow(x / 8, 13.0),
    "power_one_third": lambda x: x ** (1 / 3),
    "number_to_traced_power": lambda x: torch.pow(2.0, x / 4),
    "negative_number_to_traced_power": lambda x: (-2.0) ** torch.round(x),
}

# Tolerances where the formula loses to the exact function (stated in torch_functions.py).
ATOL = {"atanh": 2e-6, "acosh": 2e-6, "power_large_whole": 0.0}
RTOL = {"power_large_whole": 1e-12}


@pytest.mark.parametrize("name", sorted(ONE_ARGUMENT))
def test_one_argument_functions_match_torch(name):
    fn = ONE_ARGUMENT[name]
    with np.errstate(all="ignore"):
        want = fn(torch.from_numpy(VALUES.copy())).double().numpy()
    got = traced_on(fn, VALUES)
    assert_matches(got, want, rtol=RTOL.get(name, 1e-6), atol=ATOL.get(name, 1e-6),
                   signed_zeros=name in ("round", "sgn", "atan", "sinh", "relu"))


TWO_ARGUMENTS = {
    "atan2": torch.atan2,
    "hypot": torch.hypot,
    "copysign": torch.copysign,
    "power": lambda x, y: torch.pow(x, y),
    "xlogy": torch.special.xlogy,
    "xlog1py": torch.special.xlog1py,
    "logaddexp2": torch.logaddexp2,
    "heaviside": torch.heaviside,
    "lerp": lambda x, y: torch.lerp(x, y, torch.sigmoid(y)),
    "addcmul_addcdiv": lambda x, y: torch.addcmul(x, x, y, value=0.5) + torch.addcdiv(y, x, y, value=2.0),
}


@pytest.mark.parametrize("name", sorted(TWO_ARGUMENTS))
def test_two_argument_functions_match_torch(name):
    fn = TWO_ARGUMENTS[name]
    x = VALUES[::2] if name not in ("atan2", "copysign", "power") else VALUES
    y = VALUES[1::2] if name not in ("atan2", "copysign", "power") else VALUES
    with np.errstate(all="ignore"):
        want = fn(torch.from_numpy(x.copy())[:, None], torch.from_numpy(y.copy())[None, :]).double().numpy()
    got = traced_on(fn, x, y)
    assert_matches(got, want, signed_zeros=name in ("atan2", "copysign"))


def test_round_is_half_to_even_at_every_tie():
    ties = np.arange(-20, 21) + 0.5
    near = np.nextafter(np.float32(0.5), np.float32(0)).astype(np.float64)   # rounding x + 0.5 breaks it
    x = np.concatenate([ties, [near, -near, 2.0 ** 23 - 0.5, 2.0 ** 24 + 2]])
    got = traced_on(torch.round, x)
    np.testing.assert_array_equal(got, np.round(x))


def test_integer_powers_stay_exact_integers():
    mod = score_mod(lambda s, b, h, q, kv: s + (q - kv) ** 3 + q ** 0 + torch.pow(kv, 5))
    q, kv = np.arange(-20, 20)[:, None], np.arange(40)[None, :]
    got = mod(np.zeros((1, 1)), 0, 0, q, kv)
    np.testing.assert_array_equal(got, (q - kv) ** 3 + 1 + kv ** 5)


@pytest.mark.parametrize("fn, words", [
    (lambda s, b, h, q, kv: s + q ** (kv % 3), ["traced integer power"]),
    (lambda s, b, h, q, kv: s + q ** -2, ["negative integer powers"]),
    (lambda s, b, h, q, kv: F.gelu(s, approximate="fast"), ["approximate='fast'"]),
    (lambda s, b, h, q, kv: torch.special.i0(s), ["special_i0"]),
])
def test_errors_name_what_is_unsupported(fn, words):
    with pytest.raises(TraceError) as e:
        score_mod(fn)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_spellings_reach_the_same_functions():
    """torch.f, x.f(), torch.special.f, F.f (in-place too), numpy's ufuncs and round()."""
    x = VALUES[np.abs(VALUES) < 50]

    def inplace(s):
        F.relu(s, inplace=True)
        return s

    pairs = [
        (lambda s: s.atan() + s.sinh() + s.relu(), lambda s: torch.atan(s) + torch.sinh(s) + F.relu(s)),
        (inplace, F.relu),
        (lambda s: F.leaky_relu(s, 0.1, inplace=True) * 2, lambda s: F.leaky_relu(s, 0.1) * 2),
        (lambda s: round(s) + s.round(decimals=1), lambda s: torch.round(s) + torch.round(s, decimals=1)),
        (lambda s: np.arctan(s) + np.hypot(s, 2.0) + np.round(s, 1) + np.cbrt(s) + np.arcsinh(s),
         lambda s: torch.atan(s) + torch.hypot(s, torch.tensor(2.0, dtype=s.dtype)) + torch.round(s, decimals=1)
         + torch.sign(s) * s.abs() ** (1 / 3) + torch.asinh(s)),
        (lambda s: torch.special.exp2(s / 8) + torch.special.round(s), lambda s: torch.exp2(s / 8) + torch.round(s)),
    ]
    for spelled, reference in pairs:
        want = reference(torch.from_numpy(x.copy())).numpy()
        assert_matches(traced_on(spelled, x), want)


def test_functions_apply_element_by_element_on_vector_reads():
    emb = torch.from_numpy(_rng.normal(size=(5, 4)))

    def fn(s, b, h, q, kv):
        return s + F.gelu(emb[q % 5]).sum() + torch.atan2(emb[kv % 5], emb[q % 5]).mean()

    mod = score_mod(fn)
    q, kv = np.arange(7)[:, None], np.arange(9)[None, :]
    got = mod(np.zeros((7, 9)), 0, 0, q, kv)
    e = emb.numpy()
    want = (F.gelu(torch.from_numpy(e[q % 5])).sum(-1).numpy()
            + torch.atan2(torch.from_numpy(e[kv % 5]), torch.from_numpy(e[q % 5])).mean(-1).numpy())
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# Tensor idioms torch users write in score mods: methods, alpha=, masked_fill, in-place ops
# (the traced value rebinds), torch.finfo of a traced value's dtype.
IDIOMS = {
    "masked_fill": lambda s, b, h, q, kv: s.masked_fill(q < kv, float("-inf")),
    "torch_masked_fill_finfo": lambda s, b, h, q, kv: torch.masked_fill(s, q < kv, torch.finfo(s.dtype).min),
    "methods": lambda s, b, h, q, kv: s.add(1.0).mul(0.5).sub(q * 0.01).div(2.0) + q.floor_divide(3),
    "alpha": lambda s, b, h, q, kv: torch.add(s, q - kv, alpha=0.1) + torch.sub(s, kv, alpha=2) + torch.rsub(s, 1.0),
    "in_place": lambda s, b, h, q, kv: s.clone().add_(0.5).clamp_(min=-1.0).mul_((q - kv).float().mul_(0.1)),
    "in_place_functions": lambda s, b, h, q, kv: torch.relu_(s.detach() * 1.0) + F.relu_(s - 1),
    "fill_and_masked_fill_": lambda s, b, h, q, kv: torch.zeros_like(s).fill_(2.0).masked_fill_(q > kv, 3.0) * s,
    "comparison_methods": lambda s, b, h, q, kv: torch.where(q.eq(kv) | q.gt(kv).logical_and(q.le(kv + 4)), s, -s),
    "bitwise_methods": lambda s, b, h, q, kv: torch.where(q.bitwise_and(3).ne(kv.bitwise_and(3)), s, s * 2),
    "type_as_contiguous": lambda s, b, h, q, kv: s.contiguous() + (q - kv).type_as(s) * 0.25,
    # constants made with a traced value's dtype (our dtype names become torch's)
    "dtype_from_traced_value": lambda s, b, h, q, kv: (torch.minimum(s, torch.tensor(3.0, dtype=s.dtype))
                                                       + torch.full((), 0.5, dtype=s.dtype, device=s.device)
                                                       + torch.zeros((), dtype=s.dtype) + torch.scalar_tensor(
                                                           -1.0, dtype=s.dtype)),
    # an integer base to a traced integer exponent is an integer, as torch computes it
    # (2 ** -2 == 0 there)
    "integer_base_powers": lambda s, b, h, q, kv: (s + 2 ** (-(h + 1)) + 3 ** (kv % 4) + (-2) ** (q % 5)
                                                   + (-1) ** q + 0 ** (kv % 2) + 1 ** (q - kv)),
}


@pytest.mark.parametrize("name", sorted(IDIOMS))
def test_tensor_idioms_match_torch(name):
    fn = IDIOMS[name]
    rng = np.random.default_rng(3)
    score = rng.normal(size=(7, 9)) * 2
    q, kv = np.arange(7)[:, None], np.arange(9)[None, :]
    got = np.broadcast_to(score_mod(fn)(score, 0, 1, q, kv), score.shape)
    dtype = torch.float32 if "finfo" in name else torch.float64   # (a mod's floats are float32)
    want = fn(torch.from_numpy(score.copy()).to(dtype), torch.tensor(0), torch.tensor(1), torch.from_numpy(q),
              torch.from_numpy(kv)).double().numpy()
    np.testing.assert_allclose(got, np.broadcast_to(want, score.shape), rtol=1e-6, atol=1e-6)


_EMB = torch.from_numpy(np.random.default_rng(5).normal(size=(5, 4, 3)))


def _reductions(s, b, h, q, kv):
    row, col = _EMB[q % 5], _EMB[kv % 5]
    return (s + row.amax() + col.amin(-1).sum() + torch.max(row) + torch.min(col) + row.max() * 0.5
            + row.norm() + torch.linalg.vector_norm(col, ord=1) + torch.norm(row, p=float("inf"))
            + row.norm(p=3) + col.norm(dim=-1).sum() + row[0].prod() + torch.logsumexp(col, dim=-1).mean()
            + torch.logsumexp(row * 30.0, dim=(0, 1)) * 0.01 + row.var() + col.std(dim=0).sum()
            + row.var(unbiased=False) + col.amax(dim=0, keepdim=True).sum())


def test_reductions_of_vector_reads_match_torch():
    """max / min / amax / amin / norm (p = 2, 1, inf, 3; torch.linalg.vector_norm) / prod /
    logsumexp / var / std over a captured tensor's trailing dims, whole or along dims."""
    rng = np.random.default_rng(4)
    score = rng.normal(size=(7, 9))
    q, kv = np.arange(7)[:, None], np.arange(9)[None, :]
    got = np.broadcast_to(score_mod(_reductions)(score, 0, 1, q, kv), score.shape)
    want = np.array([[_reductions(torch.tensor(score[i, j]), 0, 1, torch.tensor(i), torch.tensor(j)).item()
                      for j in range(9)] for i in range(7)])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_numpy_spellings_of_reductions_keep_numpy_semantics():
    """axis / keepdims (never silently dropped), np.max(x, axis) as values, var / std with
    numpy's ddof 0 (torch's correction is 1), jax.numpy alike; unsupported options refused."""
    jnp = pytest.importorskip("jax.numpy")
    e = _EMB.numpy()
    q, kv = np.arange(7)[:, None], np.arange(9)[None, :]

    def fn(s, b, h, q, kv):
        row = _EMB[q % 5]
        return (s + np.max(np.sum(row, axis=-1)) + np.min(row, axis=0).sum() + np.var(row) + np.std(row, axis=1).sum()
                + np.mean(row, axis=(0, 1)) + np.max(row, axis=-1, keepdims=True).sum() + jnp.var(row, ddof=1)
                + jnp.max(jnp.sum(row, axis=0)) + torch.var(row) + torch.max(s * 0.0) + np.max(row, 0).sum())

    got = score_mod(fn)(np.zeros((7, 9)), 0, 0, q, kv)
    r = e[q % 5]          # [7, 1, 4, 3]
    want = (r.sum(-1).max(-1) + r.min(-2).sum(-1) + r.var(axis=(-2, -1)) + r.std(axis=-1).sum(-1)
            + r.mean(axis=(-2, -1)) + r.max(-1).sum(-1) + r.var(axis=(-2, -1), ddof=1)
            + r.sum(-2).max(-1) + r.var(axis=(-2, -1), ddof=1) + r.max(-2).sum(-1))
    np.testing.assert_allclose(np.broadcast_to(got, (7, 9)), np.broadcast_to(want, (7, 9)), rtol=1e-6, atol=1e-6)
    with pytest.raises(TraceError, match="where="):
        score_mod(lambda s, b, h, q, kv: s + jnp.sum(_EMB[q % 5], where=True))


def test_max_along_a_dim_asks_for_amax():
    with pytest.raises(TraceError, match="torch.amax"):
        score_mod(lambda s, b, h, q, kv: s + torch.max(_EMB[q % 5], 0).values.sum())


def test_in_place_changes_to_captured_tensors_are_refused():
    bias = torch.zeros(9)
    with pytest.raises(TraceError, match="captured array"):
        score_mod(lambda s, b, h, q, kv: s + bias.add_(1)[kv])
