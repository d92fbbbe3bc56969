"""Mods written with jax.numpy, jax.nn and jax.lax (mods/namespaces.py): traced with JAX's
names and semantics, compared with JAX evaluating the same function on index grids."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import jax.scipy.special  # noqa: E402,F401
from jax import lax  # noqa: E402
from jax.numpy import where as imported_where  # noqa: E402

from flexattn.mods import TraceError, mask_mod, score_mod  # noqa: E402

QL, KVL = 9, 11
_rng = np.random.default_rng(7)
SCORE = np.concatenate([_rng.normal(size=(QL, KVL - 3)) * 4, np.tile([[-2.5, 0.5, 3.5]], (QL, 1))], axis=1)
TABLE = jnp.asarray(_rng.normal(size=(4, QL)).astype(np.float32))


def _compare(fn, kind="score", atol=2e-6):
    q, kv = np.arange(QL)[:, None], np.arange(KVL)[None, :]
    if kind == "score":
        got = score_mod(fn)(SCORE, 1, 2, q, kv)
        want = fn(jnp.asarray(SCORE, jnp.float32), jnp.int32(1), jnp.int32(2), jnp.asarray(q), jnp.asarray(kv))
    else:
        got = mask_mod(fn)(1, 2, q, kv)
        want = fn(jnp.int32(1), jnp.int32(2), jnp.asarray(q), jnp.asarray(kv))
    want = np.broadcast_to(np.asarray(want, dtype=np.float64), (QL, KVL))
    np.testing.assert_allclose(np.broadcast_to(got, (QL, KVL)), want, rtol=2e-6, atol=atol)


SCORES = {
    "where_inf": lambda s, b, h, q, kv: jnp.where(q >= kv, s, -jnp.inf),
    "softcap": lambda s, b, h, q, kv: 30.0 * jnp.tanh(s / 30.0),
    "numpy_names": lambda s, b, h, q, kv: (jnp.arctan2(s, (q - kv).astype(jnp.float32)) + jnp.exp2(s / 8)
                                           + jnp.log1p(jnp.abs(s)) + jnp.maximum(s, 0.5) + jnp.sign(s)),
    "clip_both_spellings": lambda s, b, h, q, kv: jnp.clip(s, -1.0, 2.0) + jnp.clip(s, min=0.0) * 0.5,
    "round_half_even": lambda s, b, h, q, kv: jnp.round(s) + jnp.round(s * 0.1, 1),
    "select": lambda s, b, h, q, kv: jnp.select([q > kv + 2, q > kv], [s, s * 2], default=-s),
    "asarray_power_floor_divide": lambda s, b, h, q, kv: (jnp.asarray(q - kv, dtype=jnp.float32) ** 2 * 0.01
                                                          + jnp.power(2.0, -(h + 1) / 2.0) + (q // 3)),
    "table_read": lambda s, b, h, q, kv: s + TABLE[h, q],
    "nn": lambda s, b, h, q, kv: (jax.nn.gelu(s) + jax.nn.gelu(s, approximate=False) + jax.nn.softplus(s)
                                  + jax.nn.relu(s) + jax.nn.silu(s) + jax.nn.elu(s, 0.5)
                                  + jax.nn.leaky_relu(s, 0.2) + jax.nn.log_sigmoid(s) + jax.nn.hard_tanh(s)
                                  + jax.nn.mish(s) + jax.nn.selu(s) + jax.nn.celu(s) + jax.nn.soft_sign(s)
                                  + jax.nn.hard_sigmoid(s) + jax.nn.hard_swish(s) + jax.nn.relu6(s)),
    "lax": lambda s, b, h, q, kv: (lax.select(q >= kv, s, -s) + lax.max(s, 1.0) + lax.min(s, -1.0)
                                   + lax.clamp(-2.0, s, 2.0) + lax.logistic(s) + lax.atan2(s, 2.0)
                                   + lax.integer_pow(s, 3) * 0.01 + lax.erf(s)
                                   + lax.convert_element_type(q - kv, jnp.float32)),
    "lax_truncating_division": lambda s, b, h, q, kv: (lax.div(q - kv, 3) + lax.rem(q - kv, 4)).astype(jnp.float32)
                                                      + lax.div(s, 4.0) + lax.rem(s, 1.5),
    "scalar_type_casts": lambda s, b, h, q, kv: s + jnp.float32(q - kv) * 0.1 + jnp.int32(s * 2),
    "lax_round": lambda s, b, h, q, kv: lax.round(s) + lax.round(s, lax.RoundingMethod.TO_NEAREST_EVEN) * 2,
    "imported_function": lambda s, b, h, q, kv: imported_where(q >= kv, s, 0.0),
    "scipy_special": lambda s, b, h, q, kv: (jax.scipy.special.erf(s * 0.5) + jax.scipy.special.expit(s)
                                             + jax.scipy.special.ndtr(s) + jax.scipy.special.xlogy(jnp.abs(s), 2.0)),
}


@pytest.mark.parametrize("name", sorted(SCORES))
def test_score_written_with_jax_matches_jax(name):
    _compare(SCORES[name])


def test_masks_written_with_jax_match_jax():
    _compare(lambda b, h, q, kv: jnp.logical_and(q >= kv, q - kv < 4), kind="mask")
    _compare(lambda b, h, q, kv: jnp.where(q < 3, True, (q % 2) == (kv % 2)), kind="mask")
    _compare(lambda b, h, q, kv: lax.bitwise_and(q, 3) == lax.shift_right_arithmetic(kv, 1), kind="mask")


def test_jax_numpy_imported_inside_the_defining_function():
    def make():
        import jax.numpy as np_in_closure
        return lambda s, b, h, q, kv: np_in_closure.where(q >= kv, s, np_in_closure.exp(-s))

    _compare(make())


@pytest.mark.parametrize("fn, words", [
    (lambda s, b, h, q, kv: jnp.cumsum(s), ["jax.numpy.cumsum"]),
    (lambda s, b, h, q, kv: jax.nn.softmax(s), ["jax.nn.softmax"]),
    (lambda s, b, h, q, kv: lax.cumsum(s), ["jax.lax.cumsum"]),
])
def test_unsupported_jax_functions_are_named(fn, words):
    with pytest.raises(TraceError) as e:
        score_mod(fn)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_flex_attention_with_jax_written_mods_matches_a_plain_jax_computation():
    import flexattn.jax as fj

    B, H, S, D = 1, 2, 24, 16
    key = jax.random.PRNGKey(0)
    q, k, v = (jax.random.normal(kk, (B, H, S, D), jnp.float32) for kk in jax.random.split(key, 3))

    def score(s, b, h, q_idx, kv_idx):
        return 20.0 * jnp.tanh(s / 20.0) - 0.1 * jax.nn.relu(q_idx - kv_idx).astype(jnp.float32)

    def causal(b, h, q_idx, kv_idx):
        return jnp.greater_equal(q_idx, kv_idx)

    out = fj.flex_attention(q, k, v, score_mod=score, mask=causal)
    i = jnp.arange(S)
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(D)
    s = score(s, 0, 0, i[:, None], i[None, :])
    s = jnp.where(causal(0, 0, i[:, None], i[None, :]), s, -jnp.inf)
    want = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_functions_imported_from_jax_keep_the_trace_cache():
    """jax.numpy's jitted functions and jax.nn's custom_jvp ones are library code: keyed by
    identity, so a mod reading them is traced once, not on every call."""
    from jax.numpy import exp

    from flexattn.mods import trace_cache

    def fn(s, b, h, q, kv):
        return imported_where(q >= kv, jax.nn.gelu(s), exp(s))

    first, second = trace_cache.fingerprint(fn), trace_cache.fingerprint(fn)
    assert first is not None and first.key == second.key


def test_cupy_resolves_numpy_names_the_same_way():
    """cupy follows numpy's names: a module named cupy (a stand-in here: the GPU test
    runs the real one) answers with the tracer's functions, refusing the rest by name."""
    import types

    stand_in = types.ModuleType("cupy")
    stand_in.where, stand_in.tanh, stand_in.clip, stand_in.cumsum = jnp.where, jnp.tanh, jnp.clip, jnp.cumsum

    def fn(s, b, h, q, kv):
        return stand_in.where(q >= kv, stand_in.tanh(s), stand_in.clip(s, -1.0, 1.0))

    _compare(fn)
    with pytest.raises(TraceError, match="cupy.cumsum"):
        score_mod(lambda s, b, h, q, kv: stand_in.cumsum(s))
