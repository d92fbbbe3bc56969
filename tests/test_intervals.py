"""Interval analysis: soundness on random expressions and masks, precision on the classics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flexattn.mods import (
    causal, document, document_from_offsets, full, mask_mod, prefix_lm, sliding_window,
)
from flexattn.mods import ir
from flexattn.mods.evaluate import evaluate
from flexattn.mods.intervals import bounds, classify

B, H, QL, KVL = 2, 3, 37, 45
N_BUF = 23


def full_grid():
    return {"b": np.arange(B).reshape(B, 1, 1, 1), "h": np.arange(H).reshape(1, H, 1, 1),
            "q": np.arange(QL).reshape(1, 1, QL, 1), "kv": np.arange(KVL).reshape(1, 1, 1, KVL)}


def random_boxes(rng, n, odd_ends=True):
    """n random boxes (lo, hi per variable), including single points and boxes at the ends."""
    out = {}
    for v, size in (("b", B), ("h", H), ("q", QL), ("kv", KVL)):
        lo = rng.integers(0, size, n)
        hi = np.minimum(size - 1, lo + rng.integers(0, size, n) // rng.integers(1, 4, n))
        if odd_ends:  # some boxes end exactly at the last index, like clipped tiles
            at_end = rng.random(n) < 0.2
            hi = np.where(at_end, size - 1, hi)
        out[v] = (lo, hi)
    return out


def box_values(values, boxes, i):
    (b0, b1), (h0, h1), (q0, q1), (k0, k1) = (
        (boxes[v][0][i], boxes[v][1][i]) for v in ("b", "h", "q", "kv"))
    return values[b0:b1 + 1, h0:h1 + 1, q0:q1 + 1, k0:k1 + 1]


def check_sound(node, captures, rng, n_boxes=120):
    values = np.broadcast_to(evaluate(node, full_grid(), captures), (B, H, QL, KVL))
    boxes = random_boxes(rng, n_boxes)
    iv = bounds(node, boxes, captures)
    lo = np.broadcast_to(iv.lo, (n_boxes,))
    hi = np.broadcast_to(iv.hi, (n_boxes,))
    verdict = np.broadcast_to(classify(node, boxes, captures), (n_boxes,)) if node.dtype == ir.BOOL else None
    for i in range(n_boxes):
        v = box_values(values, boxes, i).astype(np.float64)
        v = v[~np.isnan(v)]
        if v.size == 0:
            continue
        assert lo[i] <= v.min() and hi[i] >= v.max(), (ir.format_node(node), i, lo[i], hi[i], v.min(), v.max())
        if verdict is not None:
            if verdict[i] == 1:
                assert v.all(), (ir.format_node(node), i)
            elif verdict[i] == 0:
                assert not v.any(), (ir.format_node(node), i)
    return values


# --- random expressions --------------------------------------------------------------------------

class Gen:
    """Random well-typed IR over the index variables and a few captured buffers."""

    def __init__(self, rng):
        self.rng = rng
        ids = np.sort(rng.integers(0, 5, N_BUF))
        self.captures = [
            rng.integers(-6, 7, N_BUF),  # 0: int buffer
            ids,  # 1: sorted ids
            rng.normal(size=N_BUF) * 3,  # 2: float buffer
            rng.random((H, N_BUF)) < 0.5,  # 3: bool [H, N]
            np.int64(rng.integers(-3, 4)),  # 4: 0-d buffer
        ]
        self.refs = [ir.BufferRef(0, "int64", 1), ir.BufferRef(1, "int64", 1), ir.BufferRef(2, "float64", 1),
                     ir.BufferRef(3, "bool", 2), ir.BufferRef(4, "int64", 0)]

    def choice(self, options):
        return options[self.rng.integers(len(options))]

    def index(self, d):
        e = self.int(d)
        if self.rng.random() < 0.5:
            return ir.clamp(e, 0, N_BUF - 1)
        return ir.binary("mod", e, N_BUF)

    def int(self, d):
        r = self.rng
        if d == 0 or r.random() < 0.2:
            k = r.integers(6)
            if k < 4:
                return ir.var(("b", "h", "q", "kv")[k])
            if k == 4:
                return ir.const(int(r.integers(-4, 5)))
            return ir.load(self.refs[4], ())
        op = self.choice(["add", "sub", "mul", "floordiv", "mod", "abs", "neg", "minimum", "maximum",
                          "where", "load", "load_ids", "cast", "not", "and", "or", "xor", "sum"])
        if op in ("add", "sub", "minimum", "maximum"):
            return ir.binary(op, self.int(d - 1), self.int(d - 1))
        if op == "sum":
            return ir.binary("add", ir.binary("sub", ir.var("q"), ir.var("kv")), self.int(d - 1))
        if op == "mul":
            return ir.binary("mul", self.int(d - 1), self.int(d - 1) if r.random() < 0.3 else int(r.integers(-3, 4)))
        if op in ("floordiv", "mod"):
            den = self.int(d - 1) if r.random() < 0.3 else self.choice([1, 2, 3, 5, 7, -2, -4, 16])
            return ir.binary(op, self.int(d - 1), den)
        if op in ("abs", "neg"):
            return ir.unary(op, self.int(d - 1))
        if op == "not":
            return ir.unary("not", self.int(d - 1))
        if op in ("and", "or", "xor"):
            return ir.binary(op, self.int(d - 1), self.int(d - 1))
        if op == "where":
            return ir.where(self.bool(d - 1), self.int(d - 1), self.int(d - 1))
        if op == "load":
            return ir.load(self.refs[0], (self.index(d - 1),))
        if op == "load_ids":
            return ir.load(self.refs[1], (self.index(d - 1),))
        return ir.cast(self.float(d - 1), ir.INT)

    def float(self, d):
        r = self.rng
        if d == 0 or r.random() < 0.2:
            return ir.cast(self.int(0), ir.FLOAT) if r.random() < 0.7 else ir.const(float(r.normal()))
        op = self.choice(["cast", "truediv", "mul", "add", "exp", "tanh", "sigmoid", "sqrt", "log", "rsqrt",
                          "exp2", "log2", "load", "minimum", "where", "floordiv", "mod", "sin", "cos", "erf",
                          "atan"])
        if op == "cast":
            return ir.cast(self.int(d - 1), ir.FLOAT)
        if op in ("truediv", "mul", "add", "minimum", "floordiv", "mod"):
            other = self.float(d - 1) if r.random() < 0.5 else float(self.choice([0.5, -1.5, 3.0, 0.1]))
            return ir.binary(op, self.float(d - 1), other)
        if op in ("exp", "exp2"):
            return ir.unary(op, ir.binary("truediv", self.float(d - 1), 8.0))
        if op in ("sqrt", "log", "rsqrt", "log2", "tanh", "sigmoid", "erf", "atan"):
            return ir.unary(op, self.float(d - 1))
        if op in ("sin", "cos"):   # narrow and wide arguments: endpoints, one extremum, many periods
            return ir.unary(op, ir.binary("mul", self.float(d - 1), float(self.choice([0.05, 0.3, 1.0, 7.0]))))
        if op == "load":
            return ir.load(self.refs[2], (self.index(d - 1),))
        return ir.where(self.bool(d - 1), self.float(d - 1), self.float(d - 1))

    def bool(self, d):
        r = self.rng
        if d == 0 or r.random() < 0.15:
            return ir.binary(self.choice(ir.COMPARE), self.int(0), self.int(0))
        op = self.choice(["cmp", "cmp", "fcmp", "and", "or", "xor", "not", "cast", "load", "where", "beq"])
        if op == "cmp":
            return ir.binary(self.choice(ir.COMPARE), self.int(d - 1), self.int(d - 1))
        if op == "fcmp":
            return ir.binary(self.choice(ir.COMPARE), self.float(d - 1), self.float(d - 1))
        if op in ("and", "or", "xor"):
            return ir.binary(op, self.bool(d - 1), self.bool(d - 1))
        if op == "not":
            return ir.unary("not", self.bool(d - 1))
        if op == "cast":
            return ir.cast(self.int(d - 1), ir.BOOL)
        if op == "load":
            return ir.load(self.refs[3], (ir.var("h"), self.index(d - 1)))
        if op == "beq":
            return ir.binary(self.choice(["eq", "ne", "lt", "le"]), self.bool(d - 1), self.bool(d - 1))
        return ir.where(self.bool(d - 1), self.bool(d - 1), self.bool(d - 1))


@pytest.mark.parametrize("seed", range(16))
def test_random_bool_expressions_are_sound(seed):
    rng = np.random.default_rng(seed)
    g = Gen(rng)
    decided = 0
    for _ in range(25):
        e = g.bool(int(rng.integers(1, 5)))
        check_sound(e, g.captures, rng, n_boxes=60)
        decided += int((classify(e, random_boxes(rng, 20), g.captures) != -1).sum())
    assert decided > 0  # the analysis is not vacuous


@pytest.mark.parametrize("seed", range(12))
def test_random_int_and_float_bounds_are_sound(seed):
    rng = np.random.default_rng(100 + seed)
    g = Gen(rng)
    for _ in range(25):
        check_sound(g.int(int(rng.integers(1, 5))), g.captures, rng, n_boxes=40)
        check_sound(g.float(int(rng.integers(1, 4))), g.captures, rng, n_boxes=40)


@pytest.mark.parametrize("seed", range(8))
def test_random_shifts_are_sound(seed):
    """Shifts of random integer expressions by constant or computed counts (in [0, 31], as
    the kernels' 32-bit shifts need), alone and compared."""
    rng = np.random.default_rng(500 + seed)
    g = Gen(rng)

    def shifted(d):
        x = g.int(d)
        count = ir.binary("mod", g.int(1), 4) if rng.random() < 0.3 else int(rng.integers(0, 5))
        return ir.binary(str(rng.choice(["shl", "shr"])), x, count)

    for _ in range(25):
        a = shifted(int(rng.integers(0, 3)))
        check_sound(a, g.captures, rng, n_boxes=40)
        b = ir.binary(str(rng.choice(ir.COMPARE)), a, shifted(int(rng.integers(0, 3))) if rng.random() < 0.5 else g.int(1))
        check_sound(b, g.captures, rng, n_boxes=40)


# --- random masks made of built-ins and traced functions -----------------------------------------

def _sorted_ids(rng, n, docs):
    cuts = np.sort(rng.choice(np.arange(1, n), size=docs - 1, replace=False))
    return np.searchsorted(cuts, np.arange(n), side="right")


def random_mask(rng, depth=2):
    S = max(QL, KVL)
    tbl = torch.from_numpy(rng.integers(0, 4, size=S))
    w = int(rng.integers(0, 9))
    k = int(rng.integers(1, 6))
    leaves = [
        lambda: causal(int(rng.integers(-5, 6))),
        lambda: sliding_window(int(rng.integers(0, 8)), int(rng.integers(0, 4))),
        lambda: sliding_window(None, int(rng.integers(0, 4))),
        lambda: sliding_window(int(rng.integers(0, 8)), None),
        lambda: document(_sorted_ids(rng, S, int(rng.integers(2, 6)))),
        lambda: document(rng.integers(0, 3, size=S)),
        lambda: document(np.stack([_sorted_ids(rng, S, 3) for _ in range(B)])),
        lambda: document_from_offsets(np.array([0, 7, 20, 31]), S),
        lambda: prefix_lm(int(rng.integers(0, KVL))),
        lambda: prefix_lm(torch.from_numpy(rng.integers(0, KVL, size=B))),
        lambda: full(),
        lambda: mask_mod(lambda b, h, q, kv: (q // k) == (kv // k)),
        lambda: mask_mod(lambda b, h, q, kv: (q - kv) % k == h % 2),
        lambda: mask_mod(lambda b, h, q, kv: torch.abs(q - kv * 2) <= w),
        lambda: mask_mod(lambda b, h, q, kv: torch.where(h == 1, q >= kv, kv < w + b)),
        lambda: mask_mod(lambda b, h, q, kv: tbl[q] <= tbl[kv] + b),
        lambda: mask_mod(lambda b, h, q, kv: tbl[torch.clamp(q - kv, 0, S - 1)] > 1),
        lambda: mask_mod(lambda b, h, q, kv: ((q * 3 + kv) // 7) % 3 != 0),
        lambda: mask_mod(lambda b, h, q, kv: (q.float() / (kv + 1)) > 0.5),
        lambda: mask_mod(lambda b, h, q, kv: (q >> 2) == (kv >> 2)),
        lambda: mask_mod(lambda b, h, q, kv: ((q - kv) >> 1) + (kv << 1) <= w * 2),
    ]
    if depth == 0 or rng.random() < 0.3:
        return leaves[rng.integers(len(leaves))]()
    a, b = random_mask(rng, depth - 1), random_mask(rng, depth - 1)
    op = rng.integers(4)
    return a & b if op == 0 else a | b if op == 1 else a ^ b if op == 2 else ~a


@pytest.mark.parametrize("seed", range(12))
def test_random_masks_are_sound(seed):
    rng = np.random.default_rng(1000 + seed)
    for _ in range(12):
        m = random_mask(rng)
        check_sound(m.expr, [c if not isinstance(c, torch.Tensor) else c.numpy() for c in m.captures], rng, 60)
        # torch tensors work as captures directly too
        check_sound(m.expr, m.captures, rng, 10)


# --- precision on tile grids ----------------------------------------------------------------------

def tile_ranges(Q, KV, qb, kvb):
    nq, nkv = -(-Q // qb), -(-KV // kvb)
    q_lo = np.arange(nq) * qb
    kv_lo = np.arange(nkv) * kvb
    q_hi = np.minimum(q_lo + qb, Q) - 1
    kv_hi = np.minimum(kv_lo + kvb, KV) - 1
    return {"b": (0, 0), "h": (0, 0), "q": (q_lo[:, None], q_hi[:, None]),
            "kv": (kv_lo[None, :], kv_hi[None, :])}, nq, nkv


def true_tile_states(dense, qb, kvb):
    Q, KV = dense.shape
    nq, nkv = -(-Q // qb), -(-KV // kvb)
    out = np.empty((nq, nkv), np.int8)
    for i in range(nq):
        for j in range(nkv):
            t = dense[i * qb:(i + 1) * qb, j * kvb:(j + 1) * kvb]
            out[i, j] = 1 if t.all() else 0 if not t.any() else -1
    return out


def check_precise(m, Q, KV, qb, kvb):
    ranges, nq, nkv = tile_ranges(Q, KV, qb, kvb)
    caps = list(m.captures)
    verdict = np.broadcast_to(classify(m.expr, ranges, caps), (nq, nkv))
    dense = np.broadcast_to(m(0, 0, np.arange(Q)[:, None], np.arange(KV)[None, :]), (Q, KV))
    truth = true_tile_states(dense, qb, kvb)
    # sound: every decided tile is right; precise: undecided only where truly mixed
    np.testing.assert_array_equal(verdict[verdict != -1], truth[verdict != -1])
    assert int((verdict == -1).sum()) == int((truth == -1).sum())
    np.testing.assert_array_equal(verdict, truth)


SHAPES = [(256, 256, 16, 16), (250, 301, 16, 32), (97, 131, 8, 8), (128, 200, 32, 16), (33, 70, 64, 16)]


@pytest.mark.parametrize("Q, KV, qb, kvb", SHAPES)
@pytest.mark.parametrize("offset", [0, 5, -17])
def test_causal_is_precise(Q, KV, qb, kvb, offset):
    check_precise(causal(offset), Q, KV, qb, kvb)


@pytest.mark.parametrize("Q, KV, qb, kvb", SHAPES)
@pytest.mark.parametrize("left, right", [(0, 0), (20, 0), (40, 7), (None, 3), (5, None)])
def test_sliding_window_is_precise(Q, KV, qb, kvb, left, right):
    check_precise(sliding_window(left, right), Q, KV, qb, kvb)


@pytest.mark.parametrize("Q, KV, qb, kvb", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_sorted_document_is_precise(Q, KV, qb, kvb, seed):
    rng = np.random.default_rng(seed)
    S = max(Q, KV)
    ids = _sorted_ids(rng, S, int(rng.integers(2, 9)))  # non-empty documents
    check_precise(document(ids), Q, KV, qb, kvb)
    check_precise(document(ids) & causal(), Q, KV, qb, kvb)


@pytest.mark.parametrize("Q, KV, qb, kvb", SHAPES)
@pytest.mark.parametrize("prefix", [0, 1, 40, 77])
def test_prefix_lm_is_precise(Q, KV, qb, kvb, prefix):
    check_precise(prefix_lm(prefix), Q, KV, qb, kvb)


def test_full_and_empty_decide_everything():
    ranges, nq, nkv = tile_ranges(100, 100, 16, 16)
    assert (classify(full().expr, ranges) == 1).all()
    assert (classify((~full()).expr, ranges) == 0).all()


@pytest.mark.parametrize("kind", ["int32", "int64", "float", "float_nan", "bool"])
def test_buffer_spans_are_exact_at_every_width(kind):
    """buf[q] over spans of every width (1 .. the whole buffer, narrow queries first, so the
    range tables grow deeper within one analysis): the exact min / max of the span, in the
    buffer's own dtype, and NaN where the span holds one."""
    rng = np.random.default_rng(11)
    n = 301
    arr = {"int32": rng.integers(-1000, 1000, n).astype(np.int32),
           "int64": rng.integers(-(1 << 40), 1 << 40, n),
           "float": rng.standard_normal(n), "float_nan": rng.standard_normal(n),
           "bool": rng.random(n) < 0.5}[kind]
    if kind == "float_nan":
        arr[[17, 150]] = np.nan
    dtype = {"bool": "bool", "int32": "int64", "int64": "int64"}.get(kind, "float64")
    node = ir.load(ir.BufferRef(0, dtype, 1), (ir.var("q"),))
    lo = rng.integers(0, n, 400)
    hi = np.minimum(n - 1, lo + np.sort(rng.integers(0, n, 400)))   # widths growing along the queries
    from flexattn.mods.intervals import _RangeTables

    tables = _RangeTables([arr])
    for part in np.array_split(np.arange(400), 4):   # four queries on one set of tables, widest last
        iv = tables.bound(node.attr, [bounds(ir.var("q"), {"q": (lo[part], hi[part])})])
        for j, i in enumerate(part):
            span = arr[lo[i]:hi[i] + 1].astype(np.float64)
            if np.isnan(span).any():
                assert iv.nan[j]
                continue
            assert (iv.lo[j], iv.hi[j]) == (span.min(), span.max()), (kind, lo[i], hi[i])


def test_bounds_of_simple_expressions():
    q, kv = ir.var("q"), ir.var("kv")
    r = {"q": (np.array(10), np.array(20)), "kv": (np.array(3), np.array(5))}
    iv = bounds(ir.binary("sub", q, kv), r)
    assert (iv.lo, iv.hi) == (5, 17)
    iv = bounds(ir.binary("mod", q, 7), r)  # spans a period: [0, 6]
    assert (iv.lo, iv.hi) == (0, 6)
    iv = bounds(ir.binary("mod", q, 32), r)  # within one period: exact
    assert (iv.lo, iv.hi) == (10, 20)
    iv = bounds(ir.binary("floordiv", q, kv), r)
    assert (iv.lo, iv.hi) == (2, 6)
    iv = bounds(ir.binary("floordiv", q, ir.binary("sub", kv, 4)), r)  # divisor spans 0
    assert np.isinf(iv.lo) and np.isinf(iv.hi)
    iv = bounds(ir.unary("abs", ir.binary("sub", kv, 4)), r)
    assert (iv.lo, iv.hi) == (0, 1)
    buf = ir.load(ir.BufferRef(0, "int64", 1), (q,))
    vals = [np.arange(30)[::-1].copy()]
    iv = bounds(buf, r, vals)
    assert (iv.lo, iv.hi) == (9, 19)


def _nan_cases():
    """Masks whose float parts are NaN somewhere: 0 / 0 on the diagonal, inf - inf, the
    log / sqrt of negatives, a NaN in a captured buffer, a NaN captured number."""
    q, kv = ir.var("q"), ir.var("kv")
    d = ir.cast(ir.binary("sub", q, kv), ir.FLOAT)
    ratio = ir.binary("truediv", d, d)                             # NaN where q == kv
    inf = ir.const(float("inf"))
    table = np.linspace(-3.0, 3.0, N_BUF)
    table[5] = np.nan
    ref = ir.BufferRef(0, "float64", 1)
    read = ir.load(ref, (ir.clamp(q, 0, N_BUF - 1),))
    return [
        (ir.binary("le", ir.binary("minimum", ratio, 0.0), 0.0), []),
        (ir.binary("lt", ir.binary("maximum", ratio, 2.0), 3.0), []),
        (ir.binary("le", ratio, inf), []),
        (ir.binary("ne", ir.binary("minimum", ratio, 0.0), 1.0), []),
        (ir.binary("le", ir.binary("sub", ir.binary("mul", d, inf), ir.binary("mul", d, inf)), inf), []),
        (ir.binary("le", ir.unary("sqrt", d), inf), []),
        (ir.binary("le", ir.unary("log", d), inf), []),
        (ir.binary("ge", ir.binary("maximum", read, -10.0), -10.0), [table]),
        (ir.cast(ir.binary("minimum", ratio, 0.0), ir.BOOL), []),
        (ir.binary("le", ir.binary("minimum", ir.binary("mul", d, ir.const(float("nan"))), 0.0), 0.0), []),
    ]


@pytest.mark.parametrize("case", range(10))
def test_masks_that_are_nan_somewhere_are_sound(case):
    """A comparison with NaN is false (!=: true): where a float operand may be NaN, the
    analysis never calls the comparison surely true (!=: surely false), and the verdicts
    agree with the numpy evaluator on every box (check_sound)."""
    node, captures = _nan_cases()[case]
    rng = np.random.default_rng(case)
    values = check_sound(node, captures, rng, n_boxes=200)
    # the NaNs are real: the mask is not all true (!=: NaN != 1 is true everywhere)
    assert np.all(values) if node.op == "ne" else not np.all(values)


@pytest.mark.parametrize("op", ["sin", "cos"])
def test_sin_cos_bounds_hold_every_value_and_tighten_between_extrema(op):
    """Bounds of sin / cos over random ranges (inside one monotone stretch, across one or
    two extrema, over many periods, far from 0): every sampled value inside them; a range
    without an extremum gets its endpoints' values (up to the GPU's rounding slack)."""
    from flexattn.mods.intervals import bounds

    rng = np.random.default_rng(7)
    f = {"sin": np.sin, "cos": np.cos}[op]
    tight = 0
    for _ in range(3000):
        lo = float(rng.choice([rng.uniform(-8, 8), rng.uniform(-1e4, 1e4)]))
        hi = lo + float(rng.choice([rng.uniform(0, 0.5), rng.uniform(0, 4), rng.uniform(0, 30)]))
        iv = bounds(ir.unary(op, ir.var("score")), {"score": (lo, hi)})
        xs = np.concatenate([[lo, hi], rng.uniform(lo, hi, 200)])
        assert iv.lo <= f(xs).min() + 1e-12 and f(xs).max() - 1e-12 <= iv.hi, (lo, hi, iv.lo, iv.hi)
        assert not iv.nan
        tight += bool(iv.hi - iv.lo < 1.0)
    assert tight > 300   # not vacuous
    unbounded = bounds(ir.unary(op, ir.var("score")), {"score": (0.0, np.inf)})
    assert unbounded.lo == -1.0 and unbounded.hi == 1.0 and unbounded.nan


# Masks through torch functions written with the IR's ops (mods/torch_functions.py): the
# analysis sees only those ops, so its verdicts stay sound (NaN branches included).
TORCH_FUNCTION_MASKS = {
    "atan": lambda b, h, q, kv: torch.atan((q - kv).float() * 0.3) > 0.5,
    "round": lambda b, h, q, kv: torch.round((q - kv) / 3.0) == 2,
    "gelu": lambda b, h, q, kv: F.gelu((q - kv).float() * 0.5) < 1.0,
    "number_to_traced_power": lambda b, h, q, kv: torch.pow(1.5, (kv - q).float()) > 0.5,
    "atan2": lambda b, h, q, kv: torch.atan2((q % 7).float() - 3, (kv % 5).float() - 2) > 1.0,
    "sinh_cosh": lambda b, h, q, kv: torch.sinh((q - kv).float() * 0.5) < torch.cosh(kv * 0.3),
    "acosh_asinh": lambda b, h, q, kv: torch.acosh(q.float() - 2) > torch.asinh(kv.float() * 0.5),
    "fractional_power_of_negatives": lambda b, h, q, kv: torch.pow((q - kv).float(), 1.5) > 3,
    "softplus_hypot": lambda b, h, q, kv: F.softplus((q - kv).float()) < torch.hypot(q.float(), kv * 0.5),
}


@pytest.mark.parametrize("name", sorted(TORCH_FUNCTION_MASKS))
def test_masks_through_torch_functions_are_sound(name):
    node = mask_mod(TORCH_FUNCTION_MASKS[name]).expr
    values = check_sound(node, [], np.random.default_rng(11), n_boxes=200)
    assert values.any() and not values.all(), name   # the mask is not trivial on the grid
