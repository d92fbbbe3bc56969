"""The optimizing pass over mod IR (flexattn/mods/optimize.py), against the numpy
evaluator on random inputs: floats within the stated 1 ulp, integers and booleans exact."""

import numpy as np
import pytest

from flexattn import mods
from flexattn.mods import ir
from flexattn.mods.evaluate import evaluate
from flexattn.mods.optimize import divisor_shift, nonnegative, optimize

RNG = np.random.default_rng(0)


def _ulps(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    ia, ib = a.view(np.int32).astype(np.int64), b.view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, np.int64(-(2 ** 31)) - ia, ia)   # monotone integer order of floats
    ib = np.where(ib < 0, np.int64(-(2 ** 31)) - ib, ib)
    return np.abs(ia - ib)


@pytest.mark.parametrize("divisor", [30.0, 3.0, 7.0, 0.1, 1e-3, 12345.678, -2.5, 4.0, 0.125])
def test_division_by_a_constant_is_a_reciprocal_multiply_within_one_ulp(divisor):
    s = ir.var("score")
    expr = ir.binary("truediv", s, divisor)
    opt = optimize(expr)
    assert opt.op == "mul" and opt.args[1].op == "const"
    x = np.concatenate([RNG.standard_normal(100_000) * 50, RNG.uniform(-1e30, 1e30, 1000)]).astype(np.float32)
    exact = evaluate(expr, {"score": x}, float_dtype=np.float32)
    fast = evaluate(opt, {"score": x}, float_dtype=np.float32)
    assert _ulps(exact, fast).max() <= 1
    if np.log2(abs(divisor)).is_integer():
        np.testing.assert_array_equal(exact, fast)   # powers of two: exact


@pytest.mark.parametrize("divisor", [0.0, 1e-40, 1e39, float("inf")])
def test_no_reciprocal_that_would_overflow_or_flush(divisor):
    expr = ir.binary("truediv", ir.var("score"), divisor)
    assert optimize(expr).op == "truediv"


def test_softcap_as_torch_users_write_it_becomes_the_builtins_form():
    user = mods.score_mod(lambda score, b, h, q, kv: 30.0 * (score / 30.0).tanh())
    opt = optimize(user.expr)
    assert "truediv" not in {n.op for n in opt.walk()}
    s = RNG.standard_normal(10_000).astype(np.float32) * 100
    want = evaluate(user.expr, {"score": s}, float_dtype=np.float64)
    got = evaluate(opt, {"score": s}, float_dtype=np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-5)


def test_common_subexpressions_become_one_object():
    q, kv = ir.var("q"), ir.var("kv")
    d1 = ir.binary("sub", q, kv)
    d2 = ir.binary("sub", q, kv)
    expr = ir.binary("and", ir.binary("le", ir.unary("abs", d1), 512),
                     ir.binary("eq", ir.binary("mod", d2, 2), 0))
    opt = optimize(expr)
    subs = [n for n in opt.walk() if n.op == "sub"]
    assert len(subs) == 1
    assert optimize(expr) is opt                         # memoized


def test_unchanged_expressions_come_back_as_themselves():
    expr = mods.causal().expr
    assert optimize(expr) is expr
    blocks = mods.mask_mod(lambda b, h, q, kv: (q // 64) == (kv // 32) + (kv % 7)).expr   # // and %: none to take out
    assert optimize(blocks) is blocks


def test_divisor_shift():
    assert [divisor_shift(ir.const(c)) for c in (1, 2, 3, 4, 64, 96, -4)] == [None, 1, None, 2, 6, None, None]
    assert divisor_shift(ir.const(4.0)) is None


def _random_int_expr(depth):
    leaves = [ir.var("q"), ir.var("kv"), ir.var("h"), ir.const(int(RNG.integers(-9, 9)))]
    if depth == 0:
        return leaves[RNG.integers(len(leaves))]
    op = ["add", "sub", "mul", "floordiv", "mod", "minimum", "maximum", "abs", "neg"][RNG.integers(9)]
    a = _random_int_expr(depth - 1)
    if op in ("abs", "neg"):
        return ir.unary(op, a)
    if op in ("floordiv", "mod"):
        return ir.binary(op, a, int(RNG.choice([2, 3, 4, 7, 64, -3])))
    return ir.binary(op, a, _random_int_expr(depth - 1))


def test_nonnegative_is_sound_on_random_expressions():
    q = np.arange(0, 300)[:, None]
    kv = np.arange(0, 300)[None, :]
    checked = 0
    for _ in range(400):
        expr = _random_int_expr(3)
        if nonnegative(expr):
            value = evaluate(expr, {"q": q, "kv": kv, "h": np.int64(3)})
            assert np.all(value >= 0), ir.format_node(expr)
            checked += 1
    assert checked > 50


def test_lowering_identities_the_emitters_rely_on():
    """Two's complement: an arithmetic shift is floor division by 2**k and a mask is
    Python's modulo, for every sign; truncating division equals floor division only for
    non-negative dividends (why the emitters ask ``nonnegative``)."""
    x = RNG.integers(-(2 ** 31), 2 ** 31 - 1, 100_000, dtype=np.int64).astype(np.int32)
    for k in (1, 3, 6, 11):
        np.testing.assert_array_equal(x >> k, x.astype(np.int64) // 2 ** k)
        np.testing.assert_array_equal(x & (2 ** k - 1), x.astype(np.int64) % 2 ** k)
    nonneg = np.abs(x[x > np.iinfo(np.int32).min]).astype(np.int64)
    np.testing.assert_array_equal(np.trunc(nonneg / 7).astype(np.int64), nonneg // 7)


def test_division_by_a_runtime_number_hoists_its_reciprocal():
    expr = ir.binary("truediv", ir.var("score"), ir.scalar(0, ir.FLOAT))
    opt = optimize(expr)
    assert opt.op == "mul" and opt.args[1].op == "truediv" and opt.args[1].free_vars() == frozenset()
    x = (RNG.standard_normal(50_000) * 40).astype(np.float32)
    for s in (30.0, 7.0, -0.3, 1e-3):
        exact = evaluate(expr, {"score": x}, [s], float_dtype=np.float32)
        fast = evaluate(opt, {"score": x}, [s], float_dtype=np.float32)
        assert _ulps(exact, fast).max() <= 1


def test_page_arithmetic_reads_back_the_page():
    """A key's page read back from its physical position (torch's PagedAttention mask over
    a walk's table) is the table entry itself: the key enters only through ``kv // 128``."""
    kv = ir.var("kv")
    table = ir.BufferRef(0, "int32", 2)
    page = ir.load(table, (ir.var("b"), ir.binary("floordiv", kv, 128)))
    physical = ir.binary("add", ir.binary("mul", page, 128), ir.binary("mod", kv, 128))
    assert optimize(ir.binary("floordiv", physical, 128)) == page
    assert optimize(ir.binary("mod", physical, 128)) == ir.binary("mod", kv, 128)
    assert optimize(ir.binary("floordiv", ir.binary("mod", kv, 64), 64)).op == "const"


@pytest.mark.parametrize("seed", range(4))
def test_multiples_taken_out_of_integer_division_are_exact(seed):
    rng = np.random.default_rng(seed)
    q = np.arange(-70, 70)[:, None]
    kv = np.arange(0, 300)[None, :]
    checked = 0
    for _ in range(150):
        c = int(rng.choice([2, 3, 4, 7, 64, 128]))
        x, y = _random_int_expr(2), _random_int_expr(2)
        factor = c * int(rng.integers(-3, 4)) or c
        terms = [ir.binary("mul", x, factor), y if rng.random() < 0.5 else ir.binary("mod", y, c)]
        if rng.random() < 0.5:
            terms.reverse()
        for op in ("floordiv", "mod"):
            expr = ir.binary(op, ir.binary("add", *terms), c)
            opt = optimize(expr)
            env = {"q": q, "kv": kv, "h": np.int64(3)}
            np.testing.assert_array_equal(np.broadcast_to(evaluate(opt, env), (140, 300)),
                                          np.broadcast_to(evaluate(expr, env), (140, 300)), err_msg=ir.format_node(expr))
            checked += opt is not expr
    assert checked > 200
