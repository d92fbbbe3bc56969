"""Tracing plain Python/torch/numpy functions into mods.

The key property: tracing preserves meaning. Every traced mod is evaluated with numpy on
index grids and compared with calling the original function eagerly on real tensors.
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np
import pytest
import torch

from flexattn.mods import MaskMod, ScoreMod, TraceError, causal, mask_mod, ops, score_mod, sliding_window
from flexattn.mods import ir

QL, KVL, NH = 11, 13, 3
B_VAL, H_VAL = 1, 2
HERE = os.path.basename(__file__)

_rng = np.random.default_rng(1234)
SCORE = _rng.normal(size=(QL, KVL)) * 2.0
DOC = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3])  # [KVL], sorted
OFFSETS = torch.tensor([0, 3, 5, 9])
PREFIX = torch.tensor([2, 7])  # [B]
BIAS = torch.from_numpy(_rng.normal(size=(NH, QL)).astype(np.float32))  # [H, Q]
BIAS_QK = torch.from_numpy(_rng.normal(size=(QL, KVL)).astype(np.float32))
D = 3
TABLE = torch.from_numpy(_rng.normal(size=(NH, 2 * D + 1)).astype(np.float32))
SLOPES = torch.tensor([0.5, 0.25, 0.125])
BOOLMASK = torch.from_numpy(_rng.random((QL, KVL)) < 0.5)
W = 4
NP_ARR = _rng.normal(size=QL)
NP_DOC = DOC.numpy().copy()
NP_BIAS = BIAS.numpy().astype(np.float64)


def torch_args(kind):
    b, h = torch.tensor(B_VAL), torch.tensor(H_VAL)
    q, kv = torch.arange(QL)[:, None], torch.arange(KVL)[None, :]
    return (torch.from_numpy(SCORE), b, h, q, kv) if kind == "score" else (b, h, q, kv)


def numpy_args(kind):
    b, h = np.int64(B_VAL), np.int64(H_VAL)
    q, kv = np.arange(QL)[:, None], np.arange(KVL)[None, :]
    return (SCORE, b, h, q, kv) if kind == "score" else (b, h, q, kv)


def as_np(x):
    if isinstance(x, torch.Tensor):
        x = x.numpy()
    return np.broadcast_to(np.asarray(x, dtype=np.float64), (QL, KVL))


def check(fn, kind, eager="torch"):
    """Trace ``fn``, evaluate the mod on grids, compare with ``fn`` called eagerly."""
    mod = (mask_mod if kind == "mask" else score_mod)(fn)
    assert isinstance(mod, MaskMod if kind == "mask" else ScoreMod)
    got = mod(*numpy_args(kind))
    want = fn(*(torch_args(kind) if eager == "torch" else numpy_args(kind)))
    if kind == "mask":
        assert got.dtype == np.bool_
        np.testing.assert_array_equal(np.broadcast_to(got, (QL, KVL)), as_np(want) != 0)
    else:
        np.testing.assert_allclose(np.broadcast_to(got, (QL, KVL)), as_np(want), rtol=1e-6, atol=1e-6)
    return mod


# --- masks with torch -------------------------------------------------------------------------

TORCH_MASKS = {
    "causal": lambda b, h, q, kv: q >= kv,
    "abs_method": lambda b, h, q, kv: (q - kv).abs() <= 3,
    "torch_abs_closure": lambda b, h, q, kv: torch.abs(q - kv) < W,
    "abs_builtin": lambda b, h, q, kv: abs(q - kv) < 2,
    "where_mod": lambda b, h, q, kv: torch.where(q > kv, q - kv, kv - q) % 3 == 0,
    "where_kwargs": lambda b, h, q, kv: torch.where(q > kv, input=q, other=kv) % 2 == 0,
    "where_all_kwargs": lambda b, h, q, kv: torch.where(condition=q > kv, input=q, other=kv) > 6,
    "where_method": lambda b, h, q, kv: (q - kv).where(q > kv, kv - q) < 3,
    "bitand_parity": lambda b, h, q, kv: (q & 1) == (kv & 1),
    "bitxor": lambda b, h, q, kv: (q ^ kv) < 4,
    "bitor": lambda b, h, q, kv: (q | kv) > 9,
    "invert_bool": lambda b, h, q, kv: ~(q > kv),
    "invert_int": lambda b, h, q, kv: (~q + kv) > -5,
    "bool_logic": lambda b, h, q, kv: (q > 2) | (kv < 1) ^ (h == 2) & (q != kv),
    "floordiv_blocks": lambda b, h, q, kv: q // 4 == kv // 4,
    "neg_floordiv": lambda b, h, q, kv: (kv - q) // 3 == -2,
    "neg_mod": lambda b, h, q, kv: -q % 5 == kv % 5,
    "remainder": lambda b, h, q, kv: torch.remainder(q - kv, 4) == 1,
    "logical_and_ints": lambda b, h, q, kv: torch.logical_and(q % 3, kv % 2),
    "logical_not_xor": lambda b, h, q, kv: torch.logical_not(q - kv) | torch.logical_xor(q > 5, kv > 5),
    "logical_or": lambda b, h, q, kv: torch.logical_or(q % 4, kv % 3),
    "bitwise_fns": lambda b, h, q, kv: (torch.bitwise_and(q, kv) > 0) ^ (torch.bitwise_or(q, 2) == kv),
    "bitwise_not": lambda b, h, q, kv: torch.bitwise_not(q) < -kv,
    "div_floor": lambda b, h, q, kv: torch.div(q, 3, rounding_mode="floor") == torch.div(kv, 3, rounding_mode="floor"),
    "floor_divide": lambda b, h, q, kv: torch.floor_divide(q, 2) >= torch.floor_divide(kv, 3),
    "doc": lambda b, h, q, kv: DOC[q] == DOC[kv],
    "nested_offsets": lambda b, h, q, kv: (OFFSETS[DOC[q]] <= kv) & (kv <= q),
    "minmax": lambda b, h, q, kv: torch.minimum(q, kv) > torch.maximum(q - 5, kv - 7),
    "min_max_2arg": lambda b, h, q, kv: torch.min(q, kv) + torch.max(q, kv) > 12,
    "clamp_kw": lambda b, h, q, kv: (q - kv).clamp(min=-2, max=2) == torch.clamp(kv - q, -2, 2) * -1,
    "clamp_one_side": lambda b, h, q, kv: torch.clamp(q - kv, min=0) == torch.clamp(kv - q, max=0) * -1,
    "float_int_casts": lambda b, h, q, kv: (q.float() / 3.0).int() == (kv.float() / 3.0).long(),
    "to_dtype": lambda b, h, q, kv: q.to(torch.float32) * 0.5 >= kv.to(dtype=torch.float32) * 0.25,
    "type_double": lambda b, h, q, kv: q.double() / 2 > kv.type(torch.float32) / 3,
    "square": lambda b, h, q, kv: (q - kv) ** 2 < 10,
    "pow_method": lambda b, h, q, kv: (q - kv).pow(2) + torch.pow(kv, 1) < 20,
    "batch_head": lambda b, h, q, kv: (b + h + q) % 3 != kv % 3,
    "prefix_per_batch": lambda b, h, q, kv: (kv < PREFIX[b]) | (q >= kv),
    "compare_fns": lambda b, h, q, kv: torch.eq(q, kv) | torch.gt(q - 3, kv) | torch.le(kv, 1) & torch.ne(q, 4),
    "compare_fns2": lambda b, h, q, kv: torch.lt(q, kv) ^ torch.ge(kv, 7),
    "sign": lambda b, h, q, kv: torch.sign(q - kv) >= 0,
    "bool_buffer": lambda b, h, q, kv: BOOLMASK[q, kv] | (q == kv),
    "float_buffer": lambda b, h, q, kv: BIAS[h, q] > 0.0,
    "partial_index": lambda b, h, q, kv: TABLE[h][(q - kv).clamp(-D, D) + D] > 0,
    "negative_const_index": lambda b, h, q, kv: DOC[q] == DOC[-1],
    "int_return": lambda b, h, q, kv: (q - kv) % 3,  # nonzero means True
    "rsub_radd": lambda b, h, q, kv: 10 - q + (2 + kv) * 1 > 7,
    "sub_add_fns": lambda b, h, q, kv: torch.sub(q, kv) == torch.add(kv, -4) - torch.mul(kv, 2),
    "bool_arith": lambda b, h, q, kv: (q > kv) + (q > 3) * 2 == 2,
    "constant_true": lambda b, h, q, kv: True,
    "tensor_inside": lambda b, h, q, kv: q * torch.tensor(2) > kv,
}


@pytest.mark.parametrize("name", list(TORCH_MASKS))
def test_torch_masks_preserve_meaning(name):
    check(TORCH_MASKS[name], "mask")


# --- scores with torch --------------------------------------------------------------------------

TORCH_SCORES = {
    "affine": lambda s, b, h, q, kv: s * 2.0 + 1,
    "exp2": lambda s, b, h, q, kv: torch.exp2(s) * 0.5,
    "tanh_softcap": lambda s, b, h, q, kv: torch.tanh(s / 3.0) * 3.0,
    "sigmoid": lambda s, b, h, q, kv: torch.sigmoid(s),
    "minimum_tensor": lambda s, b, h, q, kv: torch.minimum(s, torch.tensor(1.0)),
    "clamp_method_kw": lambda s, b, h, q, kv: s.clamp(min=-1.0, max=1.0),
    "clamp_min_only": lambda s, b, h, q, kv: torch.clamp(s, min=0.0),
    "clamp_positional": lambda s, b, h, q, kv: s.clamp(-0.5, 0.5),
    "clip": lambda s, b, h, q, kv: torch.clip(s, -0.3, 0.4),
    "int_trunc": lambda s, b, h, q, kv: (s * 4).int(),
    "long_float": lambda s, b, h, q, kv: (s * 4).long().float() / 4,
    "square": lambda s, b, h, q, kv: s ** 2,
    "cube": lambda s, b, h, q, kv: s ** 3,
    "inv_square": lambda s, b, h, q, kv: (s.abs() + 1) ** -2,
    "pow_zero": lambda s, b, h, q, kv: s ** 0 + s,
    "sqrt_pow": lambda s, b, h, q, kv: s.abs() ** 0.5,
    "rsqrt_pow": lambda s, b, h, q, kv: (s.abs() + 1) ** -0.5,
    "int_pow_float": lambda s, b, h, q, kv: s + (q - kv) ** 2.0 / 7,
    "pow_method": lambda s, b, h, q, kv: s.pow(2) + torch.square(s),
    "manual_sigmoid": lambda s, b, h, q, kv: torch.exp(s) / (1 + torch.exp(s)),
    "logs": lambda s, b, h, q, kv: torch.log(s.abs() + 1) + torch.log2(s.abs() + 2),
    "roots": lambda s, b, h, q, kv: torch.sqrt(s.abs()) + torch.rsqrt(s.abs() + 1),
    "floor_ceil": lambda s, b, h, q, kv: torch.floor(s * 3) + torch.ceil(s * 2),
    "floor_method": lambda s, b, h, q, kv: (s * 5).floor() - (s * 5).ceil(),
    "sign": lambda s, b, h, q, kv: torch.sign(s) * s,
    "divs": lambda s, b, h, q, kv: torch.div(s, 2) + torch.true_divide(s, 4) + torch.divide(s, 8),
    "rpow": lambda s, b, h, q, kv: 2 ** s,
    "rpow_e": lambda s, b, h, q, kv: math.e ** (s / 4),
    "where_kwargs": lambda s, b, h, q, kv: torch.where(q > kv, input=s, other=-s),
    "bias_2d": lambda s, b, h, q, kv: s + BIAS[h, q] + BIAS_QK[q, kv],
    "relative_table": lambda s, b, h, q, kv: s + TABLE[h][(q - kv).clamp(-D, D) + D],
    "maximum_buffer": lambda s, b, h, q, kv: torch.maximum(s, BIAS[h, kv % QL]),
    "alibi_like": lambda s, b, h, q, kv: s - torch.abs(q - kv) * SLOPES[h],
    "leaky": lambda s, b, h, q, kv: torch.where(s > 0, s, s * 0.1),
    "likes": lambda s, b, h, q, kv: s * torch.ones_like(s) + torch.zeros_like(s) + torch.full_like(s, 2.0),
    "neg_pos": lambda s, b, h, q, kv: -s + (+s) * 3 - torch.neg(s) + torch.negative(s),
    "exp_log_methods": lambda s, b, h, q, kv: s.exp().log() + s.exp2().log2(),
    "sigmoid_tanh_methods": lambda s, b, h, q, kv: s.sigmoid() * s.tanh() + s.rsqrt().abs() * 0,
    "add_sub_mul_fns": lambda s, b, h, q, kv: torch.mul(s, 3) - torch.sub(s, 1) + torch.add(s, q),
    "rsub_fn": lambda s, b, h, q, kv: torch.rsub(s, 1),
    "div_by_index": lambda s, b, h, q, kv: s / (q - kv + 0.5),
    "times_bool": lambda s, b, h, q, kv: s * (q >= kv),
    "neg_inf": lambda s, b, h, q, kv: torch.where(q >= kv, s, -float("inf")),
    "float_floordiv": lambda s, b, h, q, kv: s // 0.5,
    "float_mod": lambda s, b, h, q, kv: s % 0.7 + torch.remainder(s, -0.3),
    "bool_to_float": lambda s, b, h, q, kv: (s > 0).float() * s + (s < 0).to(torch.float32),
    "double": lambda s, b, h, q, kv: s.double() * 2,
    "to_device_and_dtype": lambda s, b, h, q, kv: s.to("cpu") + (q > kv).to("cpu", torch.float64) + (q - kv).to(torch.float64),
    "int_index_math": lambda s, b, h, q, kv: s + (q * 2 - kv) // 3 + (q % 4),
    "head_batch": lambda s, b, h, q, kv: s * (h + 1) - b,
    "fmax_fmin": lambda s, b, h, q, kv: torch.fmax(s, torch.tensor(0.1)) + torch.fmin(s, torch.tensor(-0.1)),
}


@pytest.mark.parametrize("name", list(TORCH_SCORES))
def test_torch_scores_preserve_meaning(name):
    check(TORCH_SCORES[name], "score")


# --- numpy ufuncs and functions ----------------------------------------------------------------

NUMPY_MASKS = {
    "abs": lambda b, h, q, kv: np.abs(q - kv) <= 2,
    "logical_and": lambda b, h, q, kv: np.logical_and(q > 1, kv > 1),
    "logical_ints": lambda b, h, q, kv: np.logical_or(q % 2, kv % 3) & np.logical_not(q == 9),
    "floor_divide": lambda b, h, q, kv: np.floor_divide(q, 3) == np.floor_divide(kv, 3),
    "mod": lambda b, h, q, kv: np.mod(q - kv, 3) == 0,
    "not_equal": lambda b, h, q, kv: np.logical_not(np.equal(q, kv)) & np.less(q, kv + 5),
    "bitwise": lambda b, h, q, kv: np.bitwise_and(q, kv) > np.bitwise_xor(q, 1),
    "doc": lambda b, h, q, kv: NP_DOC[q] == NP_DOC[kv],
    "where": lambda b, h, q, kv: np.where(q > kv, q, kv) < 8,
    "minmax": lambda b, h, q, kv: np.minimum(q, kv) * 2 > np.maximum(q, kv),
    "greater": lambda b, h, q, kv: np.greater_equal(q, kv) ^ np.greater(kv, 10),
    "astype": lambda b, h, q, kv: (q % 3).astype(bool) & (kv - q).astype(np.float32).astype(np.bool_),
}

NUMPY_SCORES = {
    "where": lambda s, b, h, q, kv: np.where(q > kv, s, -s),
    "clip": lambda s, b, h, q, kv: np.clip(s, -1, 1),
    "clip_kw": lambda s, b, h, q, kv: np.clip(s, min=-0.5, max=0.7),
    "clip_a_kw": lambda s, b, h, q, kv: np.clip(s, a_min=-0.2, a_max=None),
    "exps": lambda s, b, h, q, kv: np.exp(s) + np.exp2(s),
    "tanh_abs": lambda s, b, h, q, kv: np.tanh(s) * np.abs(s),
    "sqrt": lambda s, b, h, q, kv: np.sqrt(np.abs(s)),
    "minmax_const": lambda s, b, h, q, kv: np.minimum(s, 0.5) + np.maximum(s, -0.5),
    "captured_array": lambda s, b, h, q, kv: s + NP_ARR[q],
    "captured_2d": lambda s, b, h, q, kv: s * NP_BIAS[h, q],
    "powers": lambda s, b, h, q, kv: np.power(s, 2) + np.square(s) + np.negative(s),
    "logs": lambda s, b, h, q, kv: np.log(np.abs(s) + 1) + np.log2(np.abs(s) + 1),
    "sign_floor": lambda s, b, h, q, kv: np.sign(s) * s + np.floor(s) + np.ceil(s),
    "numpy_scalar": lambda s, b, h, q, kv: np.float32(2.0) * s + np.int64(3),
    "divide": lambda s, b, h, q, kv: np.divide(s, 3) + np.true_divide(s, q + 1) + np.subtract(s, 1),
    "multiply_add": lambda s, b, h, q, kv: np.multiply(s, kv) + np.add(s, q),
    "fmin_fmax": lambda s, b, h, q, kv: np.fmin(s, 0.0) + np.fmax(s, 0.0),
    "remainder": lambda s, b, h, q, kv: np.remainder(s, 0.5),
}


@pytest.mark.parametrize("name", list(NUMPY_MASKS))
def test_numpy_masks_preserve_meaning(name):
    check(NUMPY_MASKS[name], "mask", eager="numpy")


@pytest.mark.parametrize("name", list(NUMPY_SCORES))
def test_numpy_scores_preserve_meaning(name):
    check(NUMPY_SCORES[name], "score", eager="numpy")


# --- flexattn.mods.ops ----------------------------------------------------------------------------

class Holder:
    def __init__(self):
        self.arr = BIAS.numpy()


HOLDER = Holder()

OPS_SCORES = {
    "where": lambda s, b, h, q, kv: ops.where(q > kv, s, -s),
    "clamp": lambda s, b, h, q, kv: ops.clamp(s, -1, 1) + ops.clamp(s, min=0),
    "exps": lambda s, b, h, q, kv: ops.exp(s) + ops.exp2(s) + ops.log(ops.abs(s) + 1) + ops.log2(ops.abs(s) + 1),
    "tanh_sigmoid": lambda s, b, h, q, kv: ops.tanh(s) + ops.sigmoid(s),
    "roots": lambda s, b, h, q, kv: ops.sqrt(ops.abs(s)) + ops.rsqrt(ops.abs(s) + 1),
    "minmax": lambda s, b, h, q, kv: ops.minimum(s, 0.2) + ops.maximum(s, kv * 0.1),
    "floor_sign": lambda s, b, h, q, kv: ops.floor(s * 3) + ops.sign(s),
    "cast_int": lambda s, b, h, q, kv: ops.cast(s * 3, "int32"),
    "cast_float": lambda s, b, h, q, kv: ops.cast(q > kv, "float32") * s,
    "load_attr": lambda s, b, h, q, kv: s + ops.load(HOLDER.arr, h, q),
}


@pytest.mark.parametrize("name", list(OPS_SCORES))
def test_ops_scores_preserve_meaning(name):
    check(OPS_SCORES[name], "score", eager="numpy")


def test_ops_cast_bool_mask():
    check(lambda b, h, q, kv: ops.cast(q % 3, "bool") & ops.cast(kv % 2, "bool"), "mask", eager="numpy")


def test_ops_eager_on_numbers():
    assert ops.exp(0.0) == 1.0 and ops.sigmoid(0.0) == 0.5 and ops.rsqrt(4.0) == 0.5
    assert ops.cast(-2.7, "int32") == -2 and ops.cast(np.array([0.0, 2.0]), "bool").tolist() == [False, True]
    assert ops.clamp(5, 0, 3) == 3 and ops.where(True, 1, 2) == 1
    assert ops.load(np.arange(5), 3) == 3


# --- callable objects, partials, inlined mods ----------------------------------------------------------

class ObjectMask:
    def __init__(self, ids):
        self.ids = ids

    def __call__(self, b, h, q, kv):
        return self.ids[q] == self.ids[kv]


def test_callable_object_with_tensor_attribute():
    m = check(ObjectMask(DOC), "mask")
    assert len(m.captures) == 1 and m.captures[0] is DOC


def test_partial():
    def f(b, h, q, kv, w):
        return q - kv <= w

    check(functools.partial(f, w=3), "mask")


def test_inlined_mods_inside_functions():
    c = causal()
    sw = sliding_window(3)
    m = check(lambda b, h, q, kv: c(b, h, q, kv) & (kv >= 2), "mask", eager="numpy")
    assert m.captures == ()
    m2 = mask_mod(lambda b, h, q, kv: sw(b, h, q, kv) | (q == 0))
    want = ((np.arange(QL)[:, None] - np.arange(KVL)) <= 3) & (np.arange(QL)[:, None] >= np.arange(KVL)) | (np.arange(QL)[:, None] == 0)
    np.testing.assert_array_equal(m2(0, 0, np.arange(QL)[:, None], np.arange(KVL)[None, :]), want)
    assert m2.captures == (3, 0)  # sliding_window(3) is (left=3, right=0)


def test_star_args_function():
    m = mask_mod(lambda *a: a[2] >= a[3])
    assert m.expr == ir.binary("ge", ir.var("q"), ir.var("kv"))


# --- captures are runtime inputs, not constants -------------------------------------------------

def _window(w):
    return mask_mod(lambda b, h, q, kv: (q - kv <= w) & (q >= kv))


def _two_windows(left, right):
    return mask_mod(lambda b, h, q, kv: (q - kv <= left) & (kv - q <= right))


def _doc_mask(ids):
    return mask_mod(lambda b, h, q, kv: ids[q] == ids[kv])


def test_closure_numbers_are_slots():
    a, b = _window(3), _window(100)
    assert a.structure_key == b.structure_key
    assert a.captures == (3,) and b.captures == (100,)
    assert a.expr.slots() == {0}
    q, kv = np.arange(QL)[:, None], np.arange(KVL)[None, :]
    np.testing.assert_array_equal(b(0, 0, q, kv), q >= kv)
    # different captured values but the same variables: same structure, even when the
    # values happen to be equal (CPython shares small ints between variables)
    assert _two_windows(3, 3).structure_key == _two_windows(3, 4).structure_key == _two_windows(500, 7).structure_key
    assert len(_two_windows(3, 3).captures) == 2


def test_float_closure_and_numpy_scalars():
    def make(c):
        return score_mod(lambda s, b, h, q, kv: s * c)

    assert make(0.5).structure_key == make(0.25).structure_key
    m = make(np.float32(0.5))
    assert m.captures == (0.5,) and type(m.captures[0]) is float
    m = _window(np.int64(7))
    assert m.captures == (7,) and type(m.captures[0]) is int
    # an int and a float capture are computed in different types: different structures
    assert make(2).structure_key != make(2.0).structure_key


def test_tensor_contents_do_not_change_structure():
    a = _doc_mask(torch.tensor([0, 0, 1, 1]))
    b = _doc_mask(torch.tensor([5, 6, 7, 8]))
    assert a.structure_key == b.structure_key
    assert a.captures[0] is not b.captures[0]
    np_ids = np.array([0, 0, 1, 1], dtype=np.int64)
    assert _doc_mask(np_ids).structure_key == a.structure_key  # int64 storage either way
    assert _doc_mask(torch.tensor([0, 1], dtype=torch.int32)).structure_key != a.structure_key
    assert _doc_mask(np.array([0, 1], dtype=np.int32)).structure_key != a.structure_key


def test_rank_changes_structure():
    ids1 = torch.tensor([0, 0, 1, 1])
    ids2 = ids1[None]
    a = _doc_mask(ids1)
    b = mask_mod(lambda b_, h, q, kv: ids2[0, q] == ids2[0, kv])
    assert a.structure_key != b.structure_key


def test_globals_and_defaults_are_captures():
    m = mask_mod(_global_mask)
    assert m.captures == (GLOBAL_W,)
    assert m.expr.slots() == {0}

    def with_default(b, h, q, kv, w=5):
        return q - kv <= w

    def with_kwdefault(b, h, q, kv, *, w=6):
        return q - kv <= w

    md, mk = mask_mod(with_default), mask_mod(with_kwdefault)
    assert md.captures == (5,) and mk.captures == (6,)
    assert md.structure_key == mk.structure_key == _window_only(2).structure_key
    m = score_mod(_global_table_score)
    assert len(m.captures) == 1 and m.captures[0] is GLOBAL_TABLE
    check(_global_table_score, "score", eager="numpy")


GLOBAL_W = 9
GLOBAL_TABLE = np.linspace(-1, 1, QL)


def _global_mask(b, h, q, kv):
    return q - kv <= GLOBAL_W


def _global_table_score(s, b, h, q, kv):
    return s + GLOBAL_TABLE[q]


def _window_only(w):
    return mask_mod(lambda b, h, q, kv: q - kv <= w)


def test_same_tensor_one_slot_equal_tensors_two():
    t = torch.tensor([0, 1, 1, 2])
    alias = t
    m = mask_mod(lambda b, h, q, kv: t[q] == alias[kv])
    assert len(m.captures) == 1 and m.captures[0] is t
    u = t.clone()
    m2 = mask_mod(lambda b, h, q, kv: t[q] == u[kv])
    assert len(m2.captures) == 2
    assert m.structure_key != m2.structure_key


def test_slots_numbered_by_first_use_and_unused_dropped():
    t1, t2, unused = torch.tensor([1, 2]), torch.tensor([3.0, 4.0]), torch.tensor([9])
    w = 3

    def f(s, b, h, q, kv):
        if False:
            return unused[q]
        return s * t2[q] + t1[kv] + w

    m = score_mod(f)
    assert len(m.captures) == 3
    assert all(any(c is x for c in m.captures) for x in (t1, t2))
    assert [c for c in m.captures if isinstance(c, int)] == [3]
    assert not any(c is unused for c in m.captures)
    loads = [n for n in m.expr.walk() if n.op == "load"]
    slots = sorted(n.attr.slot for n in loads) + [n.attr for n in m.expr.walk() if n.op == "scalar"]
    assert sorted(slots) == [0, 1, 2]
    # canonical: the walk meets slot 0 first
    first = next(n for n in m.expr.walk() if n.op in ("load", "scalar"))
    assert (first.attr.slot if first.op == "load" else first.attr) == 0


def test_control_flow_bakes_captured_scalars():
    def make(w):
        def m(b, h, q, kv):
            if w > 0:
                return (q - kv <= w) & (q >= kv)
            return q >= kv

        return mask_mod(m)

    a, b, c = make(3), make(4), make(0)
    assert a.captures == () and b.captures == ()
    assert a.structure_key != b.structure_key
    q, kv = np.arange(QL)[:, None], np.arange(KVL)[None, :]
    np.testing.assert_array_equal(a(0, 0, q, kv), (q - kv <= 3) & (q >= kv))
    np.testing.assert_array_equal(c(0, 0, q, kv), q >= kv)

    def make_loop(n):
        def m(b, h, q, kv):
            acc = q == kv
            for i in range(n):
                acc = acc | (q - kv == i + 1)
            return acc

        return mask_mod(m)

    m2, m3 = make_loop(2), make_loop(3)
    assert m2.structure_key != m3.structure_key and m2.captures == ()
    np.testing.assert_array_equal(m3(0, 0, q, kv), (q - kv >= 0) & (q - kv <= 3))

    def make_pow(p):
        return score_mod(lambda s, b, h, q, kv: s ** p)

    assert make_pow(2).captures == () and make_pow(2).structure_key != make_pow(3).structure_key
    np.testing.assert_allclose(make_pow(3)(SCORE, 0, 0, 0, 0), SCORE ** 3)


def test_bool_closure_stays_python():
    def make(flag):
        return mask_mod(lambda b, h, q, kv: (q >= kv) if flag else (q <= kv))

    assert make(True).captures == () and make(True).structure_key != make(False).structure_key


# --- errors -------------------------------------------------------------------------------------------

def _raises_at(fn, kind, *words):
    with pytest.raises(TraceError) as e:
        (mask_mod if kind == "mask" else score_mod)(fn)
    msg = str(e.value)
    assert f"{HERE}:" in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


def test_unsupported_torch_function():
    msg = _raises_at(lambda s, b, h, q, kv: torch.lgamma(s), "score", "lgamma", "torch.lgamma(s)")
    assert "not supported" in msg


def test_math_function_on_proxy():
    _raises_at(lambda s, b, h, q, kv: math.sin(s), "score", "math.sin(s)", "float()")


def test_python_if_on_traced_value():
    def f(b, h, q, kv):
        if q > kv:  # noqa
            return True
        return False

    msg = _raises_at(f, "mask", "bool()", "if q > kv:", "torch.where")
    line = f.__code__.co_firstlineno + 1
    assert f"{HERE}:{line}:" in msg


# torch functions written with the IR's own ops (trace.py): each against torch on a grid
# where q - kv takes both signs, integers bit-exact, floats within float32's rounding.
REWRITTEN = {
    "div_trunc_int": lambda s, b, h, q, kv: s + torch.div(q - kv, 3, rounding_mode="trunc"),
    "div_trunc_neg_divisor": lambda s, b, h, q, kv: s + torch.div(q - 2 * kv, -4, rounding_mode="trunc"),
    "div_trunc_float": lambda s, b, h, q, kv: torch.div(s * 3.0, 1.7, rounding_mode="trunc"),
    "trunc": lambda s, b, h, q, kv: torch.trunc(s * 2.5) + torch.fix(s),
    "fmod_int": lambda s, b, h, q, kv: s + torch.fmod(q - kv, 4) + torch.fmod(kv - q, -3),
    "fmod_float": lambda s, b, h, q, kv: torch.fmod(s * 5.0, 1.5),
    "isnan_isinf": lambda s, b, h, q, kv: torch.where(torch.isnan(s / (q - kv)) | torch.isinf(1.0 / (q - kv)),
                                                      -s, s),
    "isfinite": lambda s, b, h, q, kv: torch.where(torch.isfinite(s / (q - kv)), s, 0.0),
    "isnan_int": lambda s, b, h, q, kv: torch.where(torch.isnan(q - kv) | ~torch.isfinite(q), 1.0, s),
    "log1p_expm1": lambda s, b, h, q, kv: s + torch.log1p((q - kv).abs() * 0.5) - torch.expm1(-(s * s)),
    "logaddexp": lambda s, b, h, q, kv: torch.logaddexp(s, (q - kv) * 0.3),
    "logaddexp_infinite": lambda s, b, h, q, kv: torch.logaddexp(torch.where(q > kv, s, -float("inf")),
                                                                 torch.where(q > kv + 3, s, -float("inf"))),
    "new_tensor": lambda s, b, h, q, kv: s * s.new_tensor(0.5) + q.new_tensor(2),
    "sin_cos": lambda s, b, h, q, kv: s + torch.sin((q - kv) * 0.7) * torch.cos(s) + (q * 0.1).sin().cos(),
    "erf_erfc_tan": lambda s, b, h, q, kv: torch.erf(s) + (s * 0.5).erfc() + torch.tan((q - kv) * 0.1),
}


@pytest.mark.parametrize("name", sorted(REWRITTEN))
def test_rewritten_torch_functions_match_torch(name):
    fn = REWRITTEN[name]
    mod = score_mod(fn)
    got = np.broadcast_to(mod(*numpy_args("score")), (QL, KVL))
    with np.errstate(divide="ignore", invalid="ignore"):
        want = as_np(fn(*torch_args("score")))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)
    if "int" in name and "float" not in name:
        np.testing.assert_array_equal(got - SCORE if name != "isnan_int" else got, want - SCORE
                                      if name != "isnan_int" else want)


def test_return_type_errors_name_the_user_code_not_ours():
    """An error found after tracing (the function's frames are gone) names where the
    function is defined and the user's call, never a frame inside flexattn (the block-mask
    builder, the adapters)."""
    import flexattn
    from flexattn.blockmask import create_block_mask

    def distance(b, h, q, kv):
        return (q - kv) * 1.0

    with pytest.raises(TraceError) as e:
        create_block_mask(distance, None, None, 64, 64)
    msg = str(e.value)
    assert f"{HERE}:{distance.__code__.co_firstlineno})" in msg, msg   # defined at
    assert "create_block_mask(distance" in msg, msg                      # the call's line
    assert os.path.dirname(os.path.abspath(flexattn.__file__)) + os.sep not in msg, msg
    with pytest.raises(TraceError, match=f"{HERE}:") as e:
        score_mod(lambda s, b, h, q, kv: q > kv)
    assert "returns a boolean" in str(e.value)


@pytest.mark.parametrize(
    "fn, words",
    [
        (lambda s, b, h, q, kv: torch.sin(s) + torch.lgamma(s), ["lgamma"]),
        (lambda s, b, h, q, kv: np.spacing(s), ["numpy.spacing"]),
        (lambda s, b, h, q, kv: np.add.reduce(s), ["reduce"]),
        (lambda s, b, h, q, kv: s[0], ["indexing a traced scalar"]),
        (lambda s, b, h, q, kv: sum(x for x in s), ["iterating"]),
        (lambda s, b, h, q, kv: float(q) + s, ["float()"]),
        (lambda s, b, h, q, kv: s + range(q)[0], ["int()"]),
        (lambda s, b, h, q, kv: s + BIAS[h, s], ["float"]),
        (lambda s, b, h, q, kv: s + BIAS[h, 1.5], ["unsupported index"]),
        (lambda s, b, h, q, kv: s + BIAS[h, 0:2], ["unsupported index"]),
        (lambda s, b, h, q, kv: s + BIAS[h, q, kv], ["too many indices"]),
        (lambda s, b, h, q, kv: s + BIAS[h], ["index it"]),
        (lambda s, b, h, q, kv: s & q, ["&"]),
        (lambda s, b, h, q, kv: torch.div(s, 2, rounding_mode="round"), ["rounding_mode='round'"]),
        (lambda s, b, h, q, kv: torch.max(s, 0), ["torch.max(x, dim)", "indices", "amax"]),
        (lambda s, b, h, q, kv: s.to(torch.complex64), ["cast"]),
        (lambda s, b, h, q, kv: s.to("cpu", torch.complex64), ["cast"]),
        (lambda s, b, h, q, kv: s.astype(np.complex64), ["cast"]),
        (lambda s, b, h, q, kv: torch.exp(~s), ["~"]),
        (lambda s, b, h, q, kv: torch.where(s, q, kv), ["condition"]),
        (lambda s, b, h, q, kv: s + torch.arange(3), ["shape (3,)"]),
        (lambda s, b, h, q, kv: "text", ["str"]),
        (lambda s, b, h, q, kv: s > 0, ["returns a boolean"]),
    ],
)
def test_score_trace_errors(fn, words):
    _raises_at(fn, "score", *words)


def test_mask_returning_float():
    _raises_at(lambda b, h, q, kv: q * 0.5, "mask", "returns a float")


def test_unsupported_buffer_dtype():
    t = torch.tensor([1 + 2j, 3j])
    _raises_at(lambda b, h, q, kv: t[q].abs() > 1, "mask", "complex")


def test_wrong_arity():
    with pytest.raises(TypeError, match="mask function"):
        mask_mod(lambda q, kv: q >= kv)
    with pytest.raises(TypeError, match="score function"):
        score_mod(lambda b, h, q, kv: q)
    with pytest.raises(TypeError, match="score function"):
        score_mod(lambda s, b, h, q, kv, extra: s)
    with pytest.raises(TypeError):
        mask_mod(3)
    m = mask_mod(lambda b, h, q, kv: q >= kv)
    with pytest.raises(TypeError, match="4 arguments"):
        m(0, 0, 1)


def test_decorator_forms_and_names():
    @mask_mod
    def my_mask(b, h, q, kv):
        return q >= kv

    @score_mod(name="twice")
    def s2(s, b, h, q, kv):
        return s * 2

    assert isinstance(my_mask, MaskMod) and my_mask.name == "my_mask"
    assert isinstance(s2, ScoreMod) and s2.name == "twice"
    assert "my_mask" in repr(my_mask) and "q_idx" in repr(my_mask)


def test_trace_is_reentrant_and_leaves_no_context():
    from flexattn.mods.trace import active_context

    inner = []

    def f(b, h, q, kv):
        inner.append(mask_mod(lambda b2, h2, q2, kv2: q2 > kv2))  # a trace inside a trace
        return q >= kv

    mask_mod(f)
    assert active_context() is None
    assert inner[0].expr == ir.binary("gt", ir.var("q"), ir.var("kv"))
    with pytest.raises(TraceError):
        mask_mod(lambda b, h, q, kv: torch.lgamma(q) > 0)
    assert active_context() is None


def test_integer_divisors_from_captured_numbers_are_baked():
    """``q_idx // width`` with a captured int: the divisor becomes a constant (the kernels
    lower it to shifts / multiply-high); other uses of captured numbers stay runtime inputs."""
    import numpy as np
    from flexattn import mods

    width, radius = 64, 8

    def neighborhood(b, h, q_idx, kv_idx):
        return (((q_idx // width) - (kv_idx // width)).abs() <= radius) & (((q_idx % width) - (kv_idx % width)).abs() <= radius)

    mask = mods.mask_mod(neighborhood)
    divisors = [n.args[1] for n in mask.expr.walk() if n.op in ("floordiv", "mod")]
    assert divisors and all(d.op == "const" and d.attr == 64 for d in divisors)
    assert mask.captures == (radius,)   # the radius stays a runtime input
    q, kv = np.arange(256)[:, None], np.arange(256)[None, :]
    want = (np.abs(q // 64 - kv // 64) <= 8) & (np.abs(q % 64 - kv % 64) <= 8)
    np.testing.assert_array_equal(np.broadcast_to(mask(0, 0, q, kv), want.shape), want)
    scaled = mods.score_mod(lambda s, b, h, q_idx, kv_idx: s + (q_idx - kv_idx) // (2 * width))
    assert [n.args[1].attr for n in scaled.expr.walk() if n.op == "floordiv"] == [128]


def test_bit_shifts_trace_as_torch_computes_them():
    """``>>`` / ``<<`` on traced indices are shifts (arithmetic on negatives, as torch's),
    as are torch.bitwise_right_shift / bitwise_left_shift and a number shifted by an index;
    floats refuse."""
    import numpy as np
    import torch

    from flexattn import mods
    from flexattn.mods.evaluate import evaluate

    def fn(b, h, q, kv):
        return (((q - kv) >> 2) + torch.bitwise_left_shift(kv, 3) - (64 >> (kv % 4))
                + torch.bitwise_right_shift(q, 1) + (1 << (q % 5)))

    traced = mods.score_mod(lambda s, b, h, q, kv: s + fn(b, h, q, kv).float())
    q, kv = torch.arange(-40, 40)[:, None], torch.arange(0, 70)[None, :]
    got = evaluate(traced.expr, {"score": 0.0, "b": 0, "h": 0, "q": q.numpy(), "kv": kv.numpy()}, traced.captures)
    np.testing.assert_array_equal(got, fn(0, 0, q, kv).double().numpy())
    assert ">>" in str(traced.expr) and "<<" in str(traced.expr)
    with pytest.raises(TraceError, match="integers"):
        mods.score_mod(lambda s, b, h, q, kv: s >> 1)


def test_torch_mask_combinators_trace():
    """torch's and_masks / or_masks / noop_mask start from ``b.new_ones((), dtype=torch.bool)``
    (and pass ``device=b.device``): they trace to the conjunction / disjunction itself."""
    import numpy as np
    import torch
    from torch.nn.attention.flex_attention import and_masks, noop_mask, or_masks

    from flexattn import mods

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def near(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= 5

    q, kv = np.arange(40)[:, None], np.arange(40)[None, :]
    both = mods.as_mask(and_masks(causal, near))
    either = mods.as_mask(or_masks(causal, near))
    np.testing.assert_array_equal(np.broadcast_to(both(0, 0, q, kv), (40, 40)), (q >= kv) & (q - kv <= 5))
    np.testing.assert_array_equal(np.broadcast_to(either(0, 0, q, kv), (40, 40)), (q >= kv) | (q - kv <= 5))
    assert mods.as_mask(noop_mask).expr.op == "const"
    ones = mods.score_mod(lambda s, b, h, q_idx, kv_idx: s * q_idx.new_ones(()) + kv_idx.new_zeros(()) +
                          b.new_full((), 2.5, dtype=torch.float32))
    assert ones(1.0, 0, 0, 3, 4) == 3.5
    with pytest.raises(TraceError, match="scalar size"):
        mods.mask_mod(lambda b, h, q_idx, kv_idx: q_idx.new_ones((2, 2)).sum() > 0)
