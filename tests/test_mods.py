"""Mod values: combinators, immutability, and every built-in against brute-force numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flexattn.mods import (
    MaskMod, ScoreMod, alibi, alibi_slopes, as_mask, as_score, bias, causal, document,
    document_from_lengths, document_from_offsets, document_ids_from_offsets, full, mask_mod,
    prefix_lm, relative_bias, score_mod, sliding_window, softcap,
)
from flexattn.mods import ir

B, H, QL, KVL = 2, 3, 17, 19


def grid():
    return (np.arange(B).reshape(B, 1, 1, 1), np.arange(H).reshape(1, H, 1, 1),
            np.arange(QL).reshape(1, 1, QL, 1), np.arange(KVL).reshape(1, 1, 1, KVL))


def mask_values(m):
    return np.broadcast_to(m(*grid()), (B, H, QL, KVL))


def score_values(m, s):
    return np.broadcast_to(m(s, *grid()), (B, H, QL, KVL))


@pytest.fixture
def scores():
    return np.random.default_rng(7).normal(size=(B, H, QL, KVL)) * 3


# --- combinators -------------------------------------------------------------------------------

MASK_FNS = [
    lambda b, h, q, kv: q >= kv,
    lambda b, h, q, kv: (q - kv) % 3 == 0,
    lambda b, h, q, kv: (kv + h) % 4 < 2,
    lambda b, h, q, kv: (q // 5) == (kv // 5) | (b == 1),
]


@pytest.mark.parametrize("i", range(len(MASK_FNS)))
@pytest.mark.parametrize("j", range(len(MASK_FNS)))
def test_mask_combinators_match_composed_functions(i, j):
    f, g = MASK_FNS[i], MASK_FNS[j]
    mf, mg = mask_mod(f), mask_mod(g)
    F = np.broadcast_to(f(*grid()), (B, H, QL, KVL))
    G = np.broadcast_to(g(*grid()), (B, H, QL, KVL))
    np.testing.assert_array_equal(mask_values(mf & mg), F & G)
    np.testing.assert_array_equal(mask_values(mf | mg), F | G)
    np.testing.assert_array_equal(mask_values(mf ^ mg), F ^ G)
    np.testing.assert_array_equal(mask_values(~mf), ~F)
    np.testing.assert_array_equal(mask_values(~(mf & ~mg) | mf), ~(F & ~G) | F)
    # plain functions on either side are traced
    np.testing.assert_array_equal(mask_values(mf & g), F & G)
    np.testing.assert_array_equal(mask_values(f | mg), F | G)
    np.testing.assert_array_equal(mask_values(f ^ mg), F ^ G)
    np.testing.assert_array_equal(mask_values(f & mg), F & G)


def test_mask_combinators_with_bools():
    c = causal()
    C = mask_values(c)
    np.testing.assert_array_equal(mask_values(True & c), C)
    np.testing.assert_array_equal(mask_values(c & False), np.zeros_like(C))
    np.testing.assert_array_equal(mask_values(False | c), C)
    np.testing.assert_array_equal(mask_values(c | True), np.ones_like(C))
    np.testing.assert_array_equal(mask_values(True ^ c), ~C)
    np.testing.assert_array_equal(mask_values(c ^ True), ~C)
    assert (c & True).expr == c.expr
    assert as_mask(True).name == "full" and as_mask(False).name == "empty"


SCORE_FNS = [
    lambda s, b, h, q, kv: s * 2 + 1,
    lambda s, b, h, q, kv: torch.tanh(s / 4) * 4,
    lambda s, b, h, q, kv: s + (kv - q) * 0.1 * (h + 1),
    lambda s, b, h, q, kv: torch.where(q >= kv, s, s - 3.0),
]


@pytest.mark.parametrize("i", range(len(SCORE_FNS)))
@pytest.mark.parametrize("j", range(len(SCORE_FNS)))
def test_score_chaining_matches_composition(i, j, scores):
    f, g = SCORE_FNS[i], SCORE_FNS[j]
    args = [torch.from_numpy(np.broadcast_to(x, (B, H, QL, KVL)).copy()) for x in grid()]
    s = torch.from_numpy(scores)
    want = g(f(s, *args), *args).numpy()
    np.testing.assert_allclose(score_values(score_mod(f) >> score_mod(g), scores), want, rtol=1e-5, atol=1e-5)  # torch: int * float is float32
    np.testing.assert_allclose(score_values(score_mod(f) >> g, scores), want, rtol=1e-5, atol=1e-5)  # torch: int * float is float32
    np.testing.assert_allclose(score_values(f >> score_mod(g), scores), want, rtol=1e-5, atol=1e-5)  # torch: int * float is float32


def test_chaining_is_associative_and_ordered(scores):
    a, b, c = softcap(5.0), alibi(num_heads=H), score_mod(lambda s, b_, h, q, kv: s * 3)
    l, r = (a >> b) >> c, a >> (b >> c)
    np.testing.assert_allclose(score_values(l, scores), score_values(r, scores), rtol=1e-12)
    assert not np.allclose(score_values(a >> c, scores), score_values(c >> a, scores))


def test_captures_merged_by_identity():
    ids = np.array([0] * 8 + [1] * 11, dtype=np.int32)
    d1, d2 = document(ids), document(ids)
    both = d1 & d2
    assert len(both.captures) == 1 and both.captures[0] is ids
    other = document(ids.copy())
    assert len((d1 & other).captures) == 2
    # numbers are never merged: equal windows still get two slots (structure is value-free)
    s = sliding_window(3, 3) & causal(3)
    assert len(s.captures) == 3
    assert s.structure_key == (sliding_window(7, 2) & causal(1)).structure_key
    # the combined expression reads every capture, by canonical slots 0..n-1
    for m in (both, d1 & other, s, ~(d1 | other)):
        assert m.expr.slots() == set(range(len(m.captures)))


def test_combined_slots_are_canonical():
    t1 = torch.tensor([0, 1] * 10)
    t2 = torch.tensor([1.0] * H)
    m1 = mask_mod(lambda b, h, q, kv: t1[q] == t1[kv])
    m2 = score_mod(lambda s, b, h, q, kv: s * t2[h])
    m3 = score_mod(lambda s, b, h, q, kv: s + t2[h] + t1[kv])
    chained = m2 >> m3
    assert len(chained.captures) == 2 and chained.captures[0] is t2 and chained.captures[1] is t1
    first = next(n for n in chained.expr.walk() if n.op == "load")
    assert first.attr.slot == 0
    # same structure whatever the values are
    u1, u2 = torch.tensor([5, 6] * 10), torch.tensor([2.0] * H)
    n2 = score_mod(lambda s, b, h, q, kv: s * u2[h])
    n3 = score_mod(lambda s, b, h, q, kv: s + u2[h] + u1[kv])
    assert (n2 >> n3).structure_key == chained.structure_key
    assert (m1 & m1).structure_key == m1.structure_key or len((m1 & m1).captures) == 1


def test_structure_key_of_compositions_ignores_values():
    a = document(np.array([0, 0, 1]), ) & sliding_window(4)
    b = document(np.array([3, 4, 5])) & sliding_window(9)
    assert a.structure_key == b.structure_key
    assert a.structure_key != (document(np.array([0, 0, 1])) | sliding_window(4)).structure_key
    assert causal().structure_key != causal(2).structure_key  # offset 0 is special-cased
    assert causal(2).structure_key == causal(-5).structure_key


def test_mods_are_immutable():
    m = causal()
    for attr in ("expr", "captures", "name", "other"):
        with pytest.raises(AttributeError):
            setattr(m, attr, None)
    with pytest.raises(AttributeError):
        del m.expr
    assert isinstance(m.captures, tuple)
    s = softcap(2.0)
    s2 = s.with_captures((4.0, 0.25))
    assert s.captures == (2.0, 0.5) and s2.captures == (4.0, 0.25) and s2.expr is s.expr
    np.testing.assert_allclose(s2(np.array(8.0), 0, 0, 0, 0), 4 * math.tanh(2))
    with pytest.raises(ValueError):
        s.with_captures(())


def test_no_truth_value():
    a, b = causal(), sliding_window(2)
    with pytest.raises(TypeError, match="& | ~"):
        bool(a)
    with pytest.raises(TypeError):
        a and b  # noqa
    with pytest.raises(TypeError):
        not a  # noqa
    with pytest.raises(TypeError):
        if softcap(1.0):
            pass


def test_mixing_kinds_raises():
    m, s = causal(), softcap(2.0)
    for bad in (lambda: m & s, lambda: m | s, lambda: m ^ s, lambda: s & m, lambda: s >> m,
                lambda: m >> s, lambda: s & s, lambda: ~s, lambda: m & 3, lambda: m | "x",
                lambda: s >> 2.0, lambda: as_mask(s), lambda: as_score(m), lambda: as_score(3)):
        with pytest.raises(TypeError):
            bad()


def test_names_repr_depends_on():
    c = causal()
    assert c.name == "causal" and (c & full()).name == "causal & full"
    assert (~c).name == "~causal"
    assert (softcap(2.0) >> alibi(num_heads=2)).name == "softcap(2) >> alibi"
    assert "MaskMod(causal: (b, h, q_idx, kv_idx) -> (q >= kv))" == repr(c)
    assert "1 captured" in repr(sliding_window(3, None))
    assert c.depends_on == {"q", "kv"}
    assert full().depends_on == frozenset()
    assert prefix_lm(np.array([1, 2])).depends_on == {"b", "q", "kv"}
    assert alibi(num_heads=4).depends_on == {"score", "h", "q", "kv"}


# --- built-ins vs brute force ----------------------------------------------------------------------

Qg, KVg = np.arange(QL)[:, None], np.arange(KVL)[None, :]


def test_full():
    assert mask_values(full()).all()
    assert full().captures == ()


@pytest.mark.parametrize("offset", [0, 3, -2, KVL - QL])
def test_causal(offset):
    np.testing.assert_array_equal(mask_values(causal(offset))[0, 0], Qg + offset >= KVg)


@pytest.mark.parametrize("left, right", [(3, 0), (0, 0), (2, 5), (None, 0), (None, 2), (4, None), (0, None),
                                         (np.int64(2), 1)])
def test_sliding_window(left, right):
    want = np.ones((QL, KVL), bool)
    if left is not None:
        want &= Qg - KVg <= left
    if right is not None:
        want &= KVg - Qg <= right
    np.testing.assert_array_equal(mask_values(sliding_window(left, right))[1, 2], want)


def test_sliding_window_defaults_and_errors():
    np.testing.assert_array_equal(mask_values(sliding_window(2))[0, 0], (Qg - KVg <= 2) & (Qg >= KVg))
    assert mask_values(sliding_window(None, None)).all()
    for bad in [(-1, 0), (1, -1), (1.5, 0), ("3", 0), (2, 0.5)]:
        with pytest.raises(ValueError, match="left|right"):
            sliding_window(*bad)


def _random_ids(rng, n, docs):
    cuts = np.sort(rng.choice(np.arange(1, n), size=docs - 1, replace=False))
    return np.searchsorted(cuts, np.arange(n), side="right")


@pytest.mark.parametrize("seed", [0, 1])
def test_document_1d(seed):
    rng = np.random.default_rng(seed)
    ids = _random_ids(rng, 40, 5)
    np.testing.assert_array_equal(mask_values(document(ids))[0, 0], ids[:QL, None] == ids[None, :KVL])
    t = torch.from_numpy(rng.integers(0, 3, size=40))  # unsorted, torch
    np.testing.assert_array_equal(mask_values(document(t))[1, 1], t.numpy()[:QL, None] == t.numpy()[None, :KVL])
    kv_ids = rng.integers(0, 3, size=KVL)
    np.testing.assert_array_equal(mask_values(document(ids, kv_ids))[0, 2], ids[:QL, None] == kv_ids[None, :])


def test_document_batched_and_mixed():
    rng = np.random.default_rng(3)
    ids = np.stack([_random_ids(rng, 20, 3), _random_ids(rng, 20, 4)])  # [B, S]
    got = mask_values(document(torch.from_numpy(ids)))
    for b in range(B):
        for h in range(H):
            np.testing.assert_array_equal(got[b, h], ids[b, :QL, None] == ids[b, None, :KVL])
    q_ids = rng.integers(0, 3, size=QL)
    got = mask_values(document(q_ids, ids))  # [S] queries, [B, S] keys
    for b in range(B):
        np.testing.assert_array_equal(got[b, 0], q_ids[:, None] == ids[b, None, :KVL])
    kv_ids = rng.integers(0, 3, size=KVL)
    got = mask_values(document(ids, kv_ids))  # [B, S] queries, [S] keys
    for b in range(B):
        np.testing.assert_array_equal(got[b, 2], ids[b, :QL, None] == kv_ids[None, :])
    assert len(document(ids).captures) == 1


def test_document_errors():
    with pytest.raises(ValueError, match="rank"):
        document(np.zeros((2, 2, 2), int))
    with pytest.raises(TypeError):
        document([0, 0, 1])
    with pytest.raises(ValueError, match="rank"):
        document(np.zeros(4, int), np.zeros((1, 1, 4), int))


def test_document_ids_from_offsets():
    np.testing.assert_array_equal(document_ids_from_offsets([0, 3, 3, 7], 9), [0, 0, 0, 2, 2, 2, 2, -1, -1])
    ids = document_ids_from_offsets(torch.tensor([0, 2, 5]))
    assert ids.dtype == np.int32 and ids.tolist() == [0, 0, 1, 1, 1]
    for bad, length in [([1, 3], None), ([0, 3, 2], None), ([0], None), ([0, 5], 4)]:
        with pytest.raises(ValueError):
            document_ids_from_offsets(bad, length)


def test_document_from_offsets_and_lengths():
    offsets = [0, 4, 9, 15]
    m = document_from_offsets(offsets, QL)
    ids = document_ids_from_offsets(offsets, QL)
    want = (ids[:, None] == ids[None, :]) & (ids[:, None] >= 0)
    np.testing.assert_array_equal(m(0, 0, np.arange(QL)[:, None], np.arange(QL)[None, :]), want)
    # padding tokens (id -1) attend to nothing and nobody attends to them
    got = m(0, 0, np.arange(QL)[:, None], np.arange(QL)[None, :])
    assert not got[15:].any() and not got[:, 15:].any()
    assert got[:15, :15].sum() == 16 + 25 + 36
    m2 = document_from_lengths([4, 5, 6], QL)
    np.testing.assert_array_equal(m2(0, 0, np.arange(QL)[:, None], np.arange(QL)[None, :]), want)
    m3 = document_from_lengths(np.array([3, 0, 2]))  # an empty document
    got3 = m3(0, 0, np.arange(5)[:, None], np.arange(5)[None, :])
    want3 = np.zeros((5, 5), bool)
    want3[:3, :3] = want3[3:, 3:] = True
    np.testing.assert_array_equal(got3, want3)
    with pytest.raises(ValueError, match="non-negative"):
        document_from_lengths([3, -1])


@pytest.mark.parametrize("prefix", [0, 5, KVL])
def test_prefix_lm_int(prefix):
    np.testing.assert_array_equal(mask_values(prefix_lm(prefix))[1, 1], (KVg < prefix) | (Qg >= KVg))


def test_prefix_lm_per_batch():
    p = torch.tensor([3, 11])
    got = mask_values(prefix_lm(p))
    for b in range(B):
        np.testing.assert_array_equal(got[b, 0], (KVg < int(p[b])) | (Qg >= KVg))
    assert prefix_lm(4).structure_key == prefix_lm(9).structure_key
    with pytest.raises(ValueError, match="rank"):
        prefix_lm(np.zeros((2, 2), int))
    with pytest.raises(TypeError):
        prefix_lm(2.5)


def _paper_slopes(n):
    """ALiBi reference implementation (ofirpress/attention_with_linear_biases)."""
    def get_slopes_power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        ratio = start
        return [start * ratio ** i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return get_slopes_power_of_2(closest) + _paper_slopes(2 * closest)[0::2][: n - closest]


@pytest.mark.parametrize("n", [1, 2, 3, 6, 8, 12, 16, 24, 40])
def test_alibi_slopes_match_paper(n):
    s = alibi_slopes(n)
    assert s.dtype == np.float32 and s.shape == (n,)
    np.testing.assert_allclose(s, _paper_slopes(n), rtol=1e-6)


def test_alibi_slopes_closed_forms():
    np.testing.assert_allclose(alibi_slopes(8), [2.0 ** -(i + 1) for i in range(8)], rtol=1e-7)
    want12 = [2.0 ** -(i + 1) for i in range(8)] + [2.0 ** -(0.5 + i) for i in range(4)]
    np.testing.assert_allclose(alibi_slopes(12), want12, rtol=1e-6)
    for bad in (0, -1, 2.5, "8", None):
        with pytest.raises(ValueError):
            alibi_slopes(bad)


def test_alibi(scores):
    slopes = torch.tensor([0.5, -0.25, 2.0])
    got = score_values(alibi(slopes), scores)
    want = scores + slopes.numpy()[None, :, None, None] * (KVg - Qg)[None, None]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    sl = alibi_slopes(H)
    want = scores + sl[None, :, None, None].astype(np.float64) * (KVg - Qg)[None, None]
    np.testing.assert_allclose(score_values(alibi(num_heads=H), scores), want, rtol=1e-12)
    np.testing.assert_allclose(score_values(alibi(H), scores), want, rtol=1e-12)
    assert alibi(num_heads=H).structure_key == alibi(slopes).structure_key
    with pytest.raises(ValueError, match="slopes or num_heads"):
        alibi()
    with pytest.raises(ValueError, match="rank"):
        alibi(np.ones((2, 2), np.float32))
    with pytest.raises(ValueError):
        alibi(num_heads=0)


@pytest.mark.parametrize("cap", [0.5, 5.0, 30])
def test_softcap(cap, scores):
    np.testing.assert_allclose(score_values(softcap(cap), scores), cap * np.tanh(scores / cap), rtol=1e-12)
    assert softcap(cap).structure_key == softcap(1.0).structure_key
    assert softcap(cap).captures == (float(cap), 1.0 / float(cap))


def test_softcap_errors():
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError):
            softcap(bad)


@pytest.mark.parametrize("d", [0, 2, 5, 30])
def test_relative_bias(d, scores):
    rng = np.random.default_rng(d)
    table = rng.normal(size=(H, 2 * d + 1)).astype(np.float32)
    dist = np.clip(Qg - KVg, -d, d) + d
    want = scores + table[:, dist][None].astype(np.float64)
    np.testing.assert_allclose(score_values(relative_bias(table), scores), want, rtol=1e-12)
    shared = torch.from_numpy(rng.normal(size=2 * d + 1))
    want = scores + shared.numpy()[dist][None, None]
    np.testing.assert_allclose(score_values(relative_bias(shared), scores), want, rtol=1e-12)


def test_relative_bias_errors():
    with pytest.raises(ValueError, match="odd"):
        relative_bias(np.zeros((H, 4)))
    with pytest.raises(ValueError, match="rank"):
        relative_bias(np.zeros((1, H, 5)))
    with pytest.raises(TypeError):
        relative_bias([0.0, 1.0, 2.0])


@pytest.mark.parametrize(
    "shape",
    [(QL, KVL), (1, KVL), (QL, 1), (H, QL, KVL), (1, QL, KVL), (H, 1, KVL), (H, QL, 1),
     (B, H, QL, KVL), (1, H, 1, KVL), (B, 1, QL, 1), (1, 1, 1, 1), (B, 1, 1, KVL)],
)
def test_bias_broadcasting(shape, scores):
    t = np.random.default_rng(len(shape)).normal(size=shape).astype(np.float32)
    want = scores + np.broadcast_to(t.reshape((1,) * (4 - len(shape)) + shape), (B, H, QL, KVL))
    np.testing.assert_allclose(score_values(bias(torch.from_numpy(t)), scores), want, rtol=1e-12)
    m = bias(t)
    assert m.depends_on == {"score"} | {v for v, n in zip(("b", "h", "q", "kv")[4 - len(shape):], shape) if n != 1}


def test_bias_errors():
    for bad in (np.zeros(3), np.zeros((1, 1, 1, 1, 1))):
        with pytest.raises(ValueError, match="rank"):
            bias(bad)
    with pytest.raises(TypeError):
        bias(3.0)


def test_builtins_compose_and_evaluate():
    ids = np.repeat(np.arange(4), 5)[:KVL]
    m = (document(ids) & causal()) | prefix_lm(2)
    want = (ids[:QL, None] == ids[None, :]) & (Qg >= KVg) | ((KVg < 2) | (Qg >= KVg))
    np.testing.assert_array_equal(mask_values(m)[0, 0], want)
    s = softcap(10.0) >> relative_bias(np.zeros(5, np.float32)) >> alibi(num_heads=H)
    assert isinstance(s, ScoreMod) and len(s.captures) == 5  # cap, 1/cap, D, table, slopes
    assert isinstance(m, MaskMod)


def test_builtin_structure_is_ir():
    assert causal().expr == ir.binary("ge", ir.var("q"), ir.var("kv"))
    assert full().expr == ir.const(True)
