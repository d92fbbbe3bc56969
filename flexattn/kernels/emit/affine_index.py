"""An integer index kept as ``base + offset`` while a mod is emitted, so that its
conversion to float costs one conversion per row instead of one per element.

A score mod such as ALiBi's ``score + slope[h] * (kv - q)`` converts ``kv - q`` to float
for every element of the S tile: an integer add and an ``I2FP`` each, and ``I2FP`` runs
on the XU pipe beside the softmax's ``MUFU.EX2`` (16 per clock and SM each: ALiBi's
forward read 14% slower than causal's on the H200). But a thread's ``kv`` along a
fragment row is a runtime base (tile, thread) plus compile-time column offsets, and
``q`` is constant along the row. So ``kv - q`` is ``(base - q) + offset``, and
``float(kv - q) = float(base - q) + float(offset)``: one conversion per row, then a float
add of an immediate per element.

``AffineIndex`` carries that form through ``var``, ``+``, ``-`` (with an integer that is
constant along the row) and unary ``-``; a ``cast`` to float takes the cheap route;
anything else uses the index as the plain integer (``value()``, built the way the kernels
build ``kv`` without this). The forward passes ``kv`` so (unclamped: where its hooks read
a buffer at kv they get the clamped plain index), the backward ``q`` (its fragment
columns), clamped to ``Q_LEN - 1`` as its hooks see it: the clamp stays a float min / max
of the converted values. Kernels ask the hook first (``ModHook.affine_index``): only mods
that convert such an index to float take this form, so every other kernel's code is
unchanged (SASS-identical, benchmarks/compile_time.py --compare).

Rounding: the plain conversion rounds ``kv - q`` once; this one converts ``base - q``
(exact while ``|base - q| < 2**24``, and ``|base - q| <= |kv - q| + tile width``) and adds
the offset (exact while the sum stays below ``2**24``); a bound converts exactly below
``2**24``. So the result is bit-identical while ``|kv - q|`` stays below ``2**24 - 256``
(positions up to ~16.7M tokens apart), and within 1 ulp beyond.
"""

from __future__ import annotations

import array

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass._mlir_helpers import arith as cutlass_arith

from flexattn.mods import ir


class AffineIndex:
    """``clamp(base + offsets, lo, hi)``: ``base`` an Int32 (runtime), ``offsets`` a Python
    int (one element) or a tuple of them with the row's ``shape`` (a fragment row: a
    vector), ``lo`` / ``hi`` None or Int32 bounds constant along the row (the backward's
    hooks see q clamped to Q_LEN - 1). A clamp commutes with the conversion (both are
    monotone and exact below 2**24), so it stays one float min / max per element."""

    __slots__ = ("base", "offsets", "shape", "lo", "hi", "_plain")

    def __init__(self, base, offsets, shape=None, lo=None, hi=None):
        self.base, self.offsets, self.shape, self.lo, self.hi = base, offsets, shape, lo, hi
        self._plain = None

    @property
    def is_row(self) -> bool:
        return self.shape is not None

    def value(self):
        """The index as the kernels build it without this (Int32, or an Int32 vector),
        emitted once per AffineIndex however many nodes use it."""
        if self._plain is None:
            if self.is_row:
                x = _int32_vector(self.offsets, self.shape) + self.base
            else:
                x = self.base + self.offsets
            self._plain = _clamped(x, self.lo, self.hi, self.is_row)
        return self._plain

    def plus(self, other, sign: int = 1) -> "AffineIndex":
        """``self + other`` (sign 1) or ``self - other`` (sign -1), ``other`` constant along
        the row."""
        def shift(x):
            return None if x is None else (x + other if sign > 0 else x - other)
        return AffineIndex(shift(self.base), self.offsets, self.shape, shift(self.lo), shift(self.hi))

    def subtracted_from(self, other) -> "AffineIndex":
        """``other - self`` (a clamp from above becomes one from below)."""
        def flip(x):
            return None if x is None else other - x
        return AffineIndex(other - self.base, _negated(self.offsets), self.shape, flip(self.hi), flip(self.lo))

    def negated(self) -> "AffineIndex":
        def flip(x):
            return None if x is None else -x
        return AffineIndex(-self.base, _negated(self.offsets), self.shape, flip(self.hi), flip(self.lo))

    def to_float(self):
        """``float(clamp(base + offsets, lo, hi))``: one conversion of the base (and of each
        bound) per row, a float add (and min / max) per element."""
        base = Float32(self.base)
        if self.is_row:
            x = _float32_vector(self.offsets, self.shape) + base
        else:
            x = base + Float32(float(self.offsets))
        lo = None if self.lo is None else Float32(self.lo)
        hi = None if self.hi is None else Float32(self.hi)
        if not self.is_row:   # one FMNMX each (a compare and a select through cutlass.max)
            x = x if lo is None else cute.arch.fmax(x, lo)
            return x if hi is None else cute.arch.fmin(x, hi)
        return _clamped(x, lo, hi, True)


def _clamped(x, lo, hi, vector: bool):
    """``min(max(x, lo), hi)``, either bound None: a scalar's as ``cutlass.min`` / ``max``
    (the kernels' own integer clamps), a vector's element by element."""
    if lo is not None:
        x = x.apply_op(cutlass_arith._max, lo) if vector else cutlass.max(x, lo)
    if hi is not None:
        x = x.apply_op(cutlass_arith._min, hi) if vector else cutlass.min(x, hi)
    return x


def _negated(offsets):
    return tuple(-o for o in offsets) if isinstance(offsets, tuple) else -offsets


def _int32_vector(values, shape) -> cute.TensorSSA:
    from flexattn.kernels.emit.mod_hook import int32_vector

    return int32_vector(list(values), shape)


def _float32_vector(values, shape) -> cute.TensorSSA:
    """Python numbers as a Float32 vector constant of shape ``shape``."""
    from cutlass._mlir import ir as mlir_ir
    from cutlass._mlir.dialects import arith

    ty = mlir_ir.VectorType.get([len(values)], Float32.mlir_type)
    attr = mlir_ir.DenseElementsAttr.get(array.array("f", [float(v) for v in values]), type=ty)
    return cute.TensorSSA(arith.constant(ty, attr), shape, Float32)


def _row_constant(x) -> bool:
    """An integer operand that does not vary along the row: not a vector, not an index."""
    return not isinstance(x, (AffineIndex, cute.TensorSSA))


def emit_affine(n: ir.Node, a: list):
    """Node ``n``'s value when an operand is an ``AffineIndex`` and the form survives it
    (the result may be another ``AffineIndex``, or the float of one); None otherwise (the
    caller then uses every operand's ``value()``)."""
    op = n.op
    if op == "cast" and n.dtype == ir.FLOAT:
        return a[0].to_float()
    if op == "neg":
        return a[0].negated()
    if op in ("add", "sub") and n.dtype == ir.INT:
        x, y = a
        if isinstance(x, AffineIndex) and _row_constant(y):
            return x.plus(y, 1 if op == "add" else -1)
        if isinstance(y, AffineIndex) and _row_constant(x):
            return y.plus(x) if op == "add" else y.subtracted_from(x)
    return None


def plain_value(x):
    """``x``, or its plain integer if it is an ``AffineIndex``."""
    return x.value() if isinstance(x, AffineIndex) else x


def plain(values: list) -> list:
    """``values`` with every ``AffineIndex`` as its plain integer."""
    return [plain_value(x) for x in values]


def casts_index_affinely(expr: ir.Node, var: str = "kv") -> bool:
    """Whether ``expr`` converts to float an integer built from ``var`` by ``+`` / ``-``
    with terms that do not read ``var`` (``float(kv - q)``): where an ``AffineIndex`` pays."""
    for n in expr.walk():
        if n.op == "cast" and n.dtype == ir.FLOAT and _affine_in(n.args[0], var):
            return True
    return False


def _affine_in(n: ir.Node, var: str) -> bool:
    if n.op == "var":
        return n.attr == var
    if n.op == "neg":
        return _affine_in(n.args[0], var)
    if n.op in ("add", "sub") and n.dtype == ir.INT:
        left, right = (var in a.free_vars() for a in n.args)
        if left and right:
            return False
        return _affine_in(n.args[0] if left else n.args[1], var)
    return False
