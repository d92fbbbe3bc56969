"""The mod IR: typing, promotion, folding, simplification, structural identity, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flexattn.mods import ir
from flexattn.mods.evaluate import evaluate
from flexattn.mods.ir import BOOL, FLOAT, INT, IRTypeError

Q, KV, S = ir.var("q"), ir.var("kv"), ir.var("score")


def leaf(dtype):
    """A non-constant node of the given type."""
    return {INT: Q, FLOAT: S, BOOL: ir.binary("lt", Q, KV)}[dtype]


def ev(node, **env):
    return evaluate(node, env)


# --- leaves ------------------------------------------------------------------------------------

def test_var_types():
    for v in ir.INDEX_VARS:
        assert ir.var(v).dtype == INT and ir.var(v).op == "var" and ir.var(v).attr == v
    assert ir.var("score").dtype == FLOAT
    with pytest.raises(ValueError, match="unknown variable"):
        ir.var("x")


@pytest.mark.parametrize(
    "value, dtype, attr",
    [
        (True, BOOL, True), (False, BOOL, False), (1, INT, 1), (-7, INT, -7), (1.0, FLOAT, 1.0),
        (np.int64(3), INT, 3), (np.int8(-2), INT, -2), (np.float32(0.5), FLOAT, 0.5),
        (np.float64(2.25), FLOAT, 2.25), (np.bool_(True), BOOL, True),
    ],
)
def test_const_types(value, dtype, attr):
    c = ir.const(value)
    assert c.op == "const" and c.dtype == dtype
    assert c.attr == attr and type(c.attr) is type(attr)


def test_const_explicit_dtype_and_errors():
    assert ir.const(2.7, INT).attr == 2 and ir.const(2.7, INT).dtype == INT
    assert ir.const(3, FLOAT).attr == 3.0 and isinstance(ir.const(3, FLOAT).attr, float)
    assert ir.const(0, BOOL).attr is False
    assert ir.const(Q) is Q  # nodes pass through
    for bad in ("a", None, [1], 1j):
        with pytest.raises(IRTypeError):
            ir.const(bad)


def test_scalar_and_buffer_types():
    assert ir.scalar(0, INT).dtype == INT and ir.scalar(3, FLOAT).attr == 3
    with pytest.raises(IRTypeError):
        ir.scalar(0, BOOL)
    for storage, compute in [("int64", INT), ("int32", INT), ("uint8", INT), ("int8", INT),
                             ("float16", FLOAT), ("bfloat16", FLOAT), ("float64", FLOAT),
                             ("float8_e4m3fn", FLOAT), ("bool", BOOL)]:
        assert ir.compute_dtype(storage) == compute
        assert ir.load(ir.BufferRef(0, storage, 1), (Q,)).dtype == compute
    for bad in ("complex64", "object", "str"):
        with pytest.raises(IRTypeError):
            ir.compute_dtype(bad)


def test_load_index_rules():
    buf2 = ir.BufferRef(0, "float32", 2)
    n = ir.load(buf2, (ir.var("h"), Q))
    assert n.op == "load" and n.args == (ir.var("h"), Q) and n.attr == buf2
    with pytest.raises(IRTypeError, match="rank 2"):
        ir.load(buf2, (Q,))
    with pytest.raises(IRTypeError, match="rank 2"):
        ir.load(buf2, (Q, KV, Q))
    with pytest.raises(IRTypeError, match="float"):
        ir.load(buf2, (Q, S))
    with pytest.raises(IRTypeError, match="float"):
        ir.load(buf2, (Q, 1.0))
    # bool indices are cast to int; int constants stay
    b = ir.load(buf2, (ir.binary("lt", Q, KV), 3))
    assert b.args[0].op == "cast" and b.args[0].dtype == INT and b.args[1] == ir.const(3)
    assert ir.load(ir.BufferRef(1, "int64", 0), ()).args == ()


# --- structural identity -------------------------------------------------------------------

def test_constants_of_different_types_are_distinct():
    one_i, one_f, one_b = ir.const(1), ir.const(1.0), ir.const(True)
    assert len({one_i, one_f, one_b}) == 3
    assert one_i != one_f and one_f != one_b and one_i != one_b
    assert len({one_i.key, one_f.key, one_b.key}) == 3
    zero_i, zero_b = ir.const(0), ir.const(False)
    assert zero_i != zero_b
    # and inside larger expressions too (where operands are not promoted to one another)
    c = leaf(BOOL)
    assert ir.where(c, True, False) != ir.where(c, 1, 0) != ir.where(c, 1.0, 0.0)
    # ... but a comparison promotes True to the int 1: same structure
    assert ir.binary("eq", Q, 1) == ir.binary("eq", Q, True)


def test_nan_and_signed_zero_keys():
    assert ir.const(float("nan")) == ir.const(float("nan"))
    assert hash(ir.const(float("nan"))) == hash(ir.const(float("nan")))
    assert ir.const(0.0) != ir.const(-0.0)  # 1/x differs
    assert ir.const(float("inf")) != ir.const(float("-inf"))
    # where() must not merge the branches: 1 / where(c, 0.0, -0.0) is +-inf
    w = ir.where(leaf(BOOL), 0.0, -0.0)
    assert w.op == "where"
    r = ev(ir.binary("truediv", 1.0, w), q=np.array([0, 2]), kv=np.array([1, 1]))
    assert list(r) == [np.inf, -np.inf]


def test_structural_equality_and_hash():
    a = ir.binary("add", ir.binary("mul", Q, 2), KV)
    b = ir.binary("add", ir.binary("mul", ir.var("q"), ir.const(2)), ir.var("kv"))
    assert a == b and hash(a) == hash(b) and a.key == b.key and a is not b
    assert {a: 1}[b] == 1
    assert a != ir.binary("add", KV, ir.binary("mul", Q, 2))  # not commutative-normalized
    assert a != ir.binary("add", ir.binary("mul", Q, 3), KV)
    assert ir.load(ir.BufferRef(0, "float32", 1), (Q,)) != ir.load(ir.BufferRef(1, "float32", 1), (Q,))
    assert ir.load(ir.BufferRef(0, "float32", 1), (Q,)) != ir.load(ir.BufferRef(0, "float16", 1), (Q,))
    assert ir.scalar(0, INT) != ir.scalar(0, FLOAT) and ir.scalar(0, INT) != ir.scalar(1, INT)
    assert a != "not a node" and (a == 3) is False


def test_walk_free_vars_slots():
    buf = ir.BufferRef(1, "int32", 1)
    shared = ir.binary("sub", Q, KV)
    e = ir.binary("add", ir.binary("mul", shared, shared), ir.load(buf, (ir.var("h"),)))
    e = ir.binary("lt", e, ir.scalar(4, INT))
    order = e.walk()
    assert order[-1] is e
    pos = {id(n): i for i, n in enumerate(order)}
    assert len(pos) == len(order)
    for n in order:
        for a in n.args:
            assert pos[id(a)] < pos[id(n)]
    assert sum(1 for n in order if n is shared) == 1
    assert e.free_vars() == {"q", "kv", "h"}
    assert e.slots() == {1, 4}
    assert ir.const(3).free_vars() == frozenset() and ir.const(3).slots() == frozenset()


# --- typing and promotion ---------------------------------------------------------------------

DTYPES = (INT, FLOAT, BOOL)


@pytest.mark.parametrize("op", ir.BINARY_ARITH)
@pytest.mark.parametrize("ta", DTYPES)
@pytest.mark.parametrize("tb", DTYPES)
def test_arith_promotion(op, ta, tb):
    n = ir.binary(op, leaf(ta), leaf(tb))
    expected = FLOAT if op == "truediv" or FLOAT in (ta, tb) else INT
    assert n.dtype == expected
    assert all(a.dtype == expected for a in n.args)


@pytest.mark.parametrize("op", ir.COMPARE)
@pytest.mark.parametrize("ta", DTYPES)
@pytest.mark.parametrize("tb", DTYPES)
def test_compare_typing(op, ta, tb):
    n = ir.binary(op, leaf(ta), leaf(tb))
    assert n.dtype == BOOL
    operand = BOOL if ta == tb == BOOL else FLOAT if FLOAT in (ta, tb) else INT
    assert all(a.dtype == operand for a in n.args)


@pytest.mark.parametrize("op", ir.LOGIC)
def test_logic_typing(op):
    assert ir.binary(op, leaf(BOOL), leaf(BOOL)).dtype == BOOL
    assert ir.binary(op, leaf(INT), leaf(INT)).dtype == INT
    mixed = ir.binary(op, leaf(BOOL), leaf(INT))
    assert mixed.dtype == INT and all(a.dtype == INT for a in mixed.args)
    for ta, tb in ((FLOAT, INT), (INT, FLOAT), (BOOL, FLOAT), (FLOAT, FLOAT)):
        with pytest.raises(IRTypeError, match=r"\%s" % ir._SYMBOL[op]):
            ir.binary(op, leaf(ta), leaf(tb))
    with pytest.raises(IRTypeError):
        ir.binary(op, Q, 1.5)


@pytest.mark.parametrize("op", ir.UNARY_FLOAT)
def test_unary_float_typing(op):
    assert ir.unary(op, S).dtype == FLOAT
    n = ir.unary(op, Q)
    assert n.dtype == FLOAT and n.args[0].op == "cast" and n.args[0].dtype == FLOAT
    with pytest.raises(IRTypeError, match=op):
        ir.unary(op, leaf(BOOL))


def test_unary_same_and_not_typing():
    for op in ir.UNARY_SAME:
        assert ir.unary(op, Q).dtype == INT and ir.unary(op, S).dtype == FLOAT
        with pytest.raises(IRTypeError, match="~"):
            ir.unary(op, leaf(BOOL))
    assert ir.unary("not", leaf(BOOL)).dtype == BOOL
    assert ir.unary("not", Q).dtype == INT
    with pytest.raises(IRTypeError, match="float"):
        ir.unary("not", S)
    with pytest.raises(ValueError):
        ir.unary("lgamma", S)
    with pytest.raises(ValueError):
        ir.binary("pow", S, 2)


def test_where_typing():
    c = leaf(BOOL)
    assert ir.where(c, 1, 2).dtype == INT
    assert ir.where(c, 1, 2.0).dtype == FLOAT
    assert ir.where(c, S, Q).dtype == FLOAT
    assert ir.where(c, True, False).dtype == BOOL
    w = ir.where(c, True, 2)
    assert w.dtype == INT and w.args[1] == ir.const(1)
    wi = ir.where(Q, S, 0.0)  # an integer condition means "nonzero"
    assert wi.args[0].op == "cast" and wi.args[0].dtype == BOOL
    assert list(ev(wi, q=np.array([0, 3, -1]), score=np.array([5.0, 6.0, 7.0]))) == [0.0, 6.0, 7.0]
    with pytest.raises(IRTypeError, match="condition"):
        ir.where(S, 1, 2)


def test_cast_rules():
    assert ir.cast(Q, INT) is Q
    for src in DTYPES:
        for dst in DTYPES:
            n = ir.cast(leaf(src), dst)
            assert n.dtype == dst
            assert (n.op == "cast") == (src != dst)
    with pytest.raises(IRTypeError):
        ir.cast(Q, "int64")
    # constants cast at construction; float -> int truncates toward zero
    assert ir.cast(2.9, INT) == ir.const(2) and ir.cast(-2.9, INT) == ir.const(-2)
    assert ir.cast(3, FLOAT) == ir.const(3.0)
    assert ir.cast(0.0, BOOL) == ir.const(False) and ir.cast(-0.5, BOOL) == ir.const(True)
    assert ir.cast(True, INT) == ir.const(1)


def test_cast_evaluation_matches_torch():
    x = np.array([-2.7, -0.5, 0.0, 0.4, 2.5, 3.9])
    got = ev(ir.cast(S, INT), score=x)
    np.testing.assert_array_equal(got, torch.from_numpy(x).int().numpy())
    got = ev(ir.cast(S, BOOL), score=x)
    np.testing.assert_array_equal(got, torch.from_numpy(x).bool().numpy())


# --- numeric semantics of every op --------------------------------------------------------------

_RNG = np.random.default_rng(0)
_QA = _RNG.integers(-20, 21, size=64)
_KA = _RNG.integers(-7, 8, size=64)
_KA[_KA == 0] = 3  # no division by zero in the reference
_FA = _RNG.normal(size=64) * 3
_FB = _RNG.normal(size=64) * 3

_INT_REF = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "truediv": lambda a, b: a / b, "floordiv": lambda a, b: a // b, "mod": lambda a, b: a % b,
    "minimum": min, "maximum": max,
    "lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b, "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
    "and": lambda a, b: a & b, "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b,
}


@pytest.mark.parametrize("op", list(_INT_REF))
def test_int_ops_follow_python_semantics(op):
    got = ev(ir.binary(op, Q, KV), q=_QA, kv=_KA)
    want = [_INT_REF[op](int(a), int(b)) for a, b in zip(_QA, _KA)]
    np.testing.assert_allclose(got, np.array(want, dtype=np.float64))
    # torch agrees too (floor division / remainder round towards -inf)
    if op in ("floordiv", "mod"):
        ta, tb = torch.from_numpy(_QA), torch.from_numpy(_KA)
        t = torch.div(ta, tb, rounding_mode="floor") if op == "floordiv" else torch.remainder(ta, tb)
        np.testing.assert_array_equal(got, t.numpy())


@pytest.mark.parametrize("op", ["add", "sub", "mul", "truediv", "floordiv", "mod", "minimum", "maximum",
                                "lt", "le", "gt", "ge", "eq", "ne"])
def test_float_ops_follow_torch(op):
    other = ir.load(ir.BufferRef(0, "float64", 1), (Q,))  # a second float operand
    e = ir.binary(op, S, other)
    assert e.dtype == (BOOL if op in ir.COMPARE else FLOAT)
    b = _FB.copy()
    b[::7] = _FA[::7]  # some ties
    got = evaluate(e, {"score": _FA, "q": np.arange(_FA.size)}, [b])
    ta, tb = torch.from_numpy(_FA), torch.from_numpy(b)
    ref = {
        "add": ta + tb, "sub": ta - tb, "mul": ta * tb, "truediv": ta / tb,
        "floordiv": torch.div(ta, tb, rounding_mode="floor"), "mod": torch.remainder(ta, tb),
        "minimum": torch.minimum(ta, tb), "maximum": torch.maximum(ta, tb),
        "lt": ta < tb, "le": ta <= tb, "gt": ta > tb, "ge": ta >= tb, "eq": ta == tb, "ne": ta != tb,
    }[op]
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), ref.double().numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op", ir.UNARY_FLOAT + ir.UNARY_SAME)
def test_unary_ops_follow_torch(op):
    x = np.abs(_FA) + 0.1 if op in ("log", "log2", "sqrt", "rsqrt") else _FA
    got = ev(ir.unary(op, S), score=x)
    t = torch.from_numpy(x)
    ref = {"exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "log2": torch.log2,
           "tanh": torch.tanh, "sigmoid": torch.sigmoid, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
           "neg": torch.neg, "abs": torch.abs, "sin": torch.sin, "cos": torch.cos, "erf": torch.erf,
           "atan": torch.atan}[op](t)
    np.testing.assert_allclose(got, ref.numpy(), rtol=1e-12)
    if op in ir.UNARY_SAME:
        np.testing.assert_array_equal(ev(ir.unary(op, Q), q=_QA), {"neg": -_QA, "abs": np.abs(_QA)}[op])


def test_sigmoid_does_not_overflow():
    got = ev(ir.unary("sigmoid", S), score=np.array([-1000.0, 0.0, 1000.0]))
    np.testing.assert_allclose(got, [0.0, 0.5, 1.0])


def test_not_and_logic_evaluation():
    c1, c2 = ir.binary("lt", Q, 0), ir.binary("gt", KV, 2)
    q, kv = _QA, _KA
    np.testing.assert_array_equal(ev(ir.unary("not", c1), q=q), ~(q < 0))
    np.testing.assert_array_equal(ev(ir.binary("and", c1, c2), q=q, kv=kv), (q < 0) & (kv > 2))
    np.testing.assert_array_equal(ev(ir.binary("or", c1, c2), q=q, kv=kv), (q < 0) | (kv > 2))
    np.testing.assert_array_equal(ev(ir.binary("xor", c1, c2), q=q, kv=kv), (q < 0) ^ (kv > 2))
    np.testing.assert_array_equal(ev(ir.unary("not", Q), q=q), ~q)  # bitwise on ints
    mixed = ir.binary("and", c1, Q)  # bool & int: bitwise on ints
    np.testing.assert_array_equal(ev(mixed, q=q), (q < 0).astype(np.int64) & q)


def test_where_clamp_minmax_evaluation():
    q, kv = _QA, _KA
    np.testing.assert_array_equal(ev(ir.where(ir.binary("gt", Q, KV), Q, KV), q=q, kv=kv), np.maximum(q, kv))
    np.testing.assert_array_equal(ev(ir.clamp(Q, -3, 5), q=q), np.clip(q, -3, 5))
    np.testing.assert_array_equal(ev(ir.clamp(Q, lo=-3), q=q), np.maximum(q, -3))
    np.testing.assert_array_equal(ev(ir.clamp(Q, hi=4), q=q), np.minimum(q, 4))
    assert ir.clamp(Q) is Q
    # torch.clamp semantics when lo > hi: hi wins
    np.testing.assert_array_equal(ev(ir.clamp(Q, 5, 2), q=q), torch.clamp(torch.from_numpy(q), 5, 2).numpy())
    assert ir.minimum(Q, 2.0).dtype == FLOAT and ir.maximum(Q, KV).dtype == INT


# --- constant folding -----------------------------------------------------------------------------

@pytest.mark.parametrize("op", list(_INT_REF))
@pytest.mark.parametrize("a, b", [(7, 2), (-7, 2), (7, -2), (-7, -3), (0, 5), (6, 3)])
def test_constant_folding_ints(op, a, b):
    n = ir.binary(op, a, b)
    assert n.op == "const"
    want = _INT_REF[op](a, b)
    assert n.dtype == {bool: BOOL, int: INT, float: FLOAT}[type(want)] and type(n.attr) is type(want)
    if op == "truediv":  # folded in float32, the kernels' compute type
        assert math.isclose(n.attr, want, rel_tol=1e-6)
    else:
        assert n.attr == want


@pytest.mark.parametrize("op", ["add", "sub", "mul", "truediv", "floordiv", "mod", "minimum", "maximum"])
def test_constant_folding_floats(op):
    a, b = 2.5, -0.75
    ref = {"add": a + b, "sub": a - b, "mul": a * b, "truediv": a / b, "floordiv": a // b,
           "mod": a % b, "minimum": min(a, b), "maximum": max(a, b)}[op]
    n = ir.binary(op, a, b)
    assert n.op == "const" and n.dtype == FLOAT and isinstance(n.attr, float)
    assert math.isclose(n.attr, ref, rel_tol=1e-6)


def test_constant_folding_unary_logic_where():
    assert ir.unary("neg", 3) == ir.const(-3)
    assert ir.unary("abs", -3.5) == ir.const(3.5)
    assert ir.unary("not", True) == ir.const(False)
    assert ir.unary("not", 5) == ir.const(-6)
    assert ir.unary("exp", 0) == ir.const(1.0)
    assert ir.unary("exp2", 3) == ir.const(8.0)
    assert ir.unary("log2", 8.0) == ir.const(3.0)
    assert ir.unary("sqrt", 4) == ir.const(2.0)
    assert ir.unary("rsqrt", 4.0) == ir.const(0.5)
    assert ir.unary("sigmoid", 0.0) == ir.const(0.5)
    assert ir.unary("tanh", 0.0) == ir.const(0.0)
    assert ir.binary("and", True, False) == ir.const(False)
    assert ir.binary("xor", True, True) == ir.const(False)
    assert ir.binary("or", 6, 3) == ir.const(7)
    assert ir.binary("lt", 1, 2.5) == ir.const(True)
    assert ir.binary("eq", True, 1) == ir.const(True)
    assert ir.where(True, Q, KV) is Q
    assert ir.where(False, Q, KV) is KV
    assert ir.where(0, 1.0, S) is S  # int condition constant
    assert ir.where(ir.binary("lt", 1, 2), Q, KV) is Q  # folded condition
    assert ir.clamp(10, 0, 5) == ir.const(5)
    # folding goes through casts, nested
    e = ir.binary("mul", ir.binary("add", 1, 2), ir.cast(2.9, INT))
    assert e == ir.const(6)


# --- simplifications --------------------------------------------------------------------------------

def test_arith_identities():
    assert ir.binary("add", Q, 0) is Q and ir.binary("add", 0, Q) is Q
    assert ir.binary("sub", Q, 0) is Q
    assert ir.binary("mul", Q, 1) is Q and ir.binary("mul", 1, Q) is Q
    assert ir.binary("mul", Q, 0) == ir.const(0) and ir.binary("mul", 0, Q) == ir.const(0)
    assert ir.binary("floordiv", Q, 1) is Q
    assert ir.binary("add", S, 0) is S and ir.binary("mul", S, 1) is S
    assert ir.binary("truediv", S, 1) is S
    assert ir.binary("truediv", Q, 1) == ir.cast(Q, FLOAT)
    # not simplified: float x*0 (inf*0 is nan), 0 - x, x - x
    assert ir.binary("mul", S, 0).op == "mul"
    assert ir.binary("sub", 0, Q).op == "sub"
    # a bool True is not the number 1: (q<kv) * True stays a product of ints? no: cast to 1
    assert ir.binary("mul", Q, True) is Q


def test_float_floordiv_by_one_is_floor():
    n = ir.binary("floordiv", S, 1.0)
    assert n.op == "floordiv"
    np.testing.assert_array_equal(ev(n, score=np.array([-1.5, 0.5, 2.0])), [-2.0, 0.0, 2.0])


def test_double_negation_and_logic_identities():
    c, d = leaf(BOOL), ir.binary("gt", KV, 3)
    assert ir.unary("neg", ir.unary("neg", Q)) is Q
    assert ir.unary("not", ir.unary("not", c)) is c
    assert ir.unary("not", ir.unary("not", Q)) is Q
    assert ir.binary("and", c, True) is c and ir.binary("and", True, c) is c
    assert ir.binary("and", c, False) == ir.const(False)
    assert ir.binary("or", c, False) is c and ir.binary("or", False, c) is c
    assert ir.binary("or", c, True) == ir.const(True)
    assert ir.binary("xor", c, False) is c
    assert ir.binary("xor", True, c) == ir.unary("not", c)
    assert ir.binary("and", c, d).op == "and"
    # integer logic is bitwise: x & 0 is not simplified to "False"
    assert ir.binary("and", Q, 0).dtype == INT


def test_where_identical_branches():
    c = leaf(BOOL)
    assert ir.where(c, Q, Q) is Q
    assert ir.where(c, ir.binary("add", Q, 1), ir.binary("add", Q, 1)) == ir.binary("add", Q, 1)
    assert ir.where(c, 1, 1.0) == ir.const(1.0)


# --- substitute / rebuild / format -------------------------------------------------------------------

def test_substitute_vars_and_refolding():
    e = ir.binary("lt", ir.binary("sub", Q, KV), 3)
    same = ir.substitute(e, lambda n: None)
    assert same == e
    e2 = ir.substitute(e, lambda n: ir.binary("add", KV, 1) if n == Q else None)
    assert e2 == ir.binary("lt", ir.binary("sub", ir.binary("add", KV, 1), KV), 3)
    folded = ir.substitute(e, lambda n: ir.const(10) if n.op == "var" and n.attr == "q"
                           else ir.const(4) if n.op == "var" else None)
    assert folded == ir.const(False)
    # type changes propagate through the constructors: kv -> score makes the sub float
    e3 = ir.substitute(e, lambda n: S if n == KV else None)
    assert e3.args[0].dtype == FLOAT and e3.args[0].args[0].op == "cast"


def test_substitute_renames_slots_and_keeps_load_args():
    buf = ir.BufferRef(0, "float32", 2)
    e = ir.binary("add", ir.load(buf, (ir.var("h"), Q)), ir.scalar(1, FLOAT))

    def rename(n):
        if n.op == "load":
            return ir.Node("load", n.dtype, n.args, ir.BufferRef(5, *n.attr[1:]))
        if n.op == "scalar":
            return ir.scalar(7, n.dtype)
        if n == Q:
            return KV
        return None

    out = ir.substitute(e, rename)
    assert out.slots() == {5, 7}
    ld = out.args[0]
    assert ld.op == "load" and ld.attr == ir.BufferRef(5, "float32", 2) and ld.args == (ir.var("h"), KV)
    # a 0-d buffer read (a load without args) is also renamed
    z = ir.load(ir.BufferRef(0, "float32", 0), ())
    assert ir.substitute(z, rename).attr.slot == 5


@pytest.mark.parametrize("op", ir.UNARY_FLOAT + ir.UNARY_SAME + ("not",))
def test_rebuild_unary(op):
    x = leaf(BOOL) if op == "not" else S
    n = ir.unary(op, x)
    assert ir.rebuild(n, n.args) == n


@pytest.mark.parametrize("op", ir.BINARY_ARITH + ir.COMPARE + ir.LOGIC)
def test_rebuild_binary(op):
    a, b = (Q, KV)
    n = ir.binary(op, a, b)
    assert ir.rebuild(n, n.args) == n
    assert ir.rebuild(n, (ir.const(6), ir.const(3))).op == "const"


def test_rebuild_where_cast_load():
    w = ir.where(leaf(BOOL), Q, KV)
    assert ir.rebuild(w, w.args) == w
    c = ir.cast(Q, FLOAT)
    assert ir.rebuild(c, c.args) == c
    ld = ir.load(ir.BufferRef(0, "int32", 1), (Q,))
    assert ir.rebuild(ld, (KV,)) == ir.load(ir.BufferRef(0, "int32", 1), (KV,))


def test_format_node():
    buf = ir.BufferRef(2, "float32", 2)
    e = ir.binary("add", S, ir.binary("mul", ir.load(buf, (ir.var("h"), Q)), ir.scalar(0, FLOAT)))
    assert ir.format_node(e) == "(score + (buf2[h, q] * $0))"
    assert repr(e) == ir.format_node(e)
    assert ir.format_node(ir.unary("neg", Q)) == "-q"
    assert ir.format_node(ir.unary("not", leaf(BOOL))) == "~(q < kv)"
    assert ir.format_node(ir.cast(Q, FLOAT)) == "float32(q)"
    assert ir.format_node(ir.where(leaf(BOOL), 1, 2)) == "where((q < kv), 1, 2)"
    assert ir.format_node(ir.unary("exp2", S)) == "exp2(score)"
    assert ir.format_node(ir.minimum(Q, KV)) == "minimum(q, kv)"
    assert ir.format_node(ir.binary("floordiv", Q, 2)) == "(q // 2)"
    assert ir.format_node(ir.binary("ne", Q, True)) == "(q != 1)"
    assert ir.format_node(ir.const(True)) == "True" and ir.format_node(ir.const(1.0)) == "1.0"
    for op, sym in ir._SYMBOL.items():
        a, b = (leaf(BOOL), leaf(BOOL)) if op in ir.LOGIC else (Q, KV)
        assert f" {sym} " in ir.format_node(ir.binary(op, a, b))


def test_nodes_have_no_instance_dict():
    with pytest.raises(AttributeError):
        Q.extra = 1  # __slots__
