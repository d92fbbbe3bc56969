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

Masks compare such an index with constants (``abs(q - kv) <= 512``, ``(q - kv) % 2 == 0``,
``kv < 1000``): ``base + offset <= c`` is ``base <= c - offset``, one compare of the base
with an immediate per element instead of an add and a compare; ``|base + offset| <= c`` is
two such compares (no add, no absolute value); ``(base + offset) mod 2**k == r`` is
``base mod 2**k == (r - offset) mod 2**k``: the base's residue once per row, one compare per
element, and at 2**k = 2 two predicates per row in all. ``IndexMagnitude`` and
``IndexResidue`` carry ``abs`` and ``mod`` to the compare; anything else takes the plain
value, emitted as without this. Exact while ``base + offset`` and ``c - offset`` stay in
int32 (offsets are within a tile; constants whose shifted value would leave int32 keep the
plain form).

A float index times a row constant (ALiBi's ``slope[h] * float(kv - q)``) can go one step
further (``AffineIndex(..., scaled=True)``, `IRModHook`'s ``scaled_indices``; planned for
every forward, ``FLEXATTN_SCALED_INDICES=0`` turns it off; the backward's q is clamped, so
it keeps the plain form): ``float(base) + offset`` is kept as a ``FloatAffine``, and its
product with a row constant ``x`` is ``offset * x + base * x``, ``base * x`` once per row,
then one FFMA with an immediate per element instead of a FADD and a FMUL. Rounding: ``x * (base +
offset)`` rounds once; ``fma(offset, x, fl(base * x))`` rounds ``base * x`` and then the
sum: within 1 ulp of the product's magnitude (a relative 2^-23 of the bias, where the
score's bf16 inputs carry 2^-8).

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
from cutlass import Float32, Int32
from cutlass._mlir_helpers import arith as cutlass_arith

from flexattn.mods import ir


_INT32_MIN, _INT32_MAX = -(2 ** 31), 2 ** 31 - 1

# a compare with its operands swapped (c OP x is x _FLIPPED[OP] c), and its negation
_FLIPPED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}
_NEGATED = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt", "eq": "ne", "ne": "eq"}
_CMP = {
    "lt": lambda x, y: x < y, "le": lambda x, y: x <= y, "gt": lambda x, y: x > y,
    "ge": lambda x, y: x >= y, "eq": lambda x, y: x == y, "ne": lambda x, y: x != y,
}


class IndexForm:
    """An integer kept in a cheaper form while a mod is emitted; ``value()`` is the plain
    integer, emitted at most once."""

    __slots__ = ()

    def value(self):
        raise NotImplementedError

    def compare(self, op: str, c: int):
        """``self OP c`` for a Python int ``c`` in this form's cheap route, or None."""
        return None


class AffineIndex(IndexForm):
    """``clamp(base + offsets, lo, hi)``: ``base`` an Int32 (runtime), ``offsets`` a Python
    int (one element) or a tuple of them with the row's ``shape`` (a fragment row: a
    vector), ``lo`` / ``hi`` None or Int32 bounds constant along the row (the backward's
    hooks see q clamped to Q_LEN - 1). A clamp commutes with the conversion (both are
    monotone and exact below 2**24), so it stays one float min / max per element."""

    __slots__ = ("base", "offsets", "shape", "lo", "hi", "scaled", "_plain")

    def __init__(self, base, offsets, shape=None, lo=None, hi=None, scaled: bool = False):
        self.base, self.offsets, self.shape, self.lo, self.hi = base, offsets, shape, lo, hi
        self.scaled = scaled   # to_float keeps a FloatAffine (a product with a row constant folds)
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
        return AffineIndex(shift(self.base), self.offsets, self.shape, shift(self.lo), shift(self.hi), self.scaled)

    def subtracted_from(self, other) -> "AffineIndex":
        """``other - self`` (a clamp from above becomes one from below)."""
        def flip(x):
            return None if x is None else other - x
        return AffineIndex(other - self.base, _negated(self.offsets), self.shape, flip(self.hi), flip(self.lo),
                           self.scaled)

    def negated(self) -> "AffineIndex":
        def flip(x):
            return None if x is None else -x
        return AffineIndex(-self.base, _negated(self.offsets), self.shape, flip(self.hi), flip(self.lo), self.scaled)

    @property
    def plain_compares(self) -> bool:
        """Whether compares take the cheap route: one element (a compile-time offset), no
        clamp (a clamp would need its bound's compare too)."""
        return not self.is_row and self.lo is None and self.hi is None

    def compare(self, op: str, c: int):
        """``base + offset OP c`` as ``base OP c - offset``: the shifted constant an
        immediate."""
        t = c - self.offsets if self.plain_compares else None
        if t is None or not _INT32_MIN <= t <= _INT32_MAX:
            return None
        return _CMP[op](self.base, Int32(t))

    def to_float(self):
        """``float(clamp(base + offsets, lo, hi))``: one conversion of the base (and of each
        bound) per row, a float add (and min / max) per element; unclamped and ``scaled``,
        a ``FloatAffine`` (the add left for its ``value()``)."""
        form = FloatAffine(Float32(self.base), self.offsets, self.shape)
        if self.scaled and self.lo is None and self.hi is None:
            return form
        x = form.value()
        lo = None if self.lo is None else Float32(self.lo)
        hi = None if self.hi is None else Float32(self.hi)
        if not self.is_row:   # one FMNMX each (a compare and a select through cutlass.max)
            x = x if lo is None else cute.arch.fmax(x, lo)
            return x if hi is None else cute.arch.fmin(x, hi)
        return _clamped(x, lo, hi, True)


class FloatAffine(IndexForm):
    """``(base + offsets) * scale`` in float (``scale`` None: 1), kept as ``base`` (Float32,
    the product ``base * scale`` once per row) and the compile-time ``offsets``: its value
    is ``offsets * scale + base``, one FFMA with an immediate per element (a FADD where
    nothing scaled it). A product with a row constant or a negation stays in the form."""

    __slots__ = ("base", "offsets", "shape", "scale", "_plain")

    def __init__(self, base, offsets, shape=None, scale=None):
        self.base, self.offsets, self.shape, self.scale = base, offsets, shape, scale
        self._plain = None

    def value(self):
        if self._plain is None:
            if self.shape is None:   # one element
                offset = Float32(float(self.offsets))
                self._plain = self.base + offset if self.scale is None else offset * self.scale + self.base
            else:
                offsets = _float32_vector(self.offsets, self.shape)
                self._plain = offsets + self.base if self.scale is None else offsets * self.scale + self.base
        return self._plain

    def times(self, x) -> "FloatAffine":
        """``self * x``, ``x`` a float constant along the row."""
        return FloatAffine(self.base * x, self.offsets, self.shape, x if self.scale is None else self.scale * x)

    def negated(self) -> "FloatAffine":
        if self.scale is None:
            return FloatAffine(-self.base, _negated(self.offsets), self.shape)
        return FloatAffine(-self.base, self.offsets, self.shape, -self.scale)


class _OfAffineIndex(IndexForm):
    """A form of an ``AffineIndex`` that compares cheaply; its plain value is the node
    emitted on the plain operands (``emit_plain()``), when something else asks for it."""

    __slots__ = ("index", "_emit_plain", "_plain")

    def __init__(self, index: AffineIndex, emit_plain):
        self.index, self._emit_plain, self._plain = index, emit_plain, None

    def value(self):
        if self._plain is None:
            self._plain = self._emit_plain()
        return self._plain


class IndexMagnitude(_OfAffineIndex):
    """``abs(index)``: against a constant, two compares of the index's base (``|x| <= c``:
    ``-c <= x`` and ``x <= c``)."""

    __slots__ = ()

    def compare(self, op: str, c: int):
        if op in ("eq", "ne"):
            return None
        if op in ("ge", "gt"):   # |x| >= c is not |x| < c
            inside = self.compare(_NEGATED[op], c)
            return None if inside is None else inside == cutlass.Boolean(False)
        low = self.index.compare("ge" if op == "le" else "gt", -c)
        high = self.index.compare(op, c)
        return None if low is None or high is None else low & high


class IndexResidue(_OfAffineIndex):
    """``index mod 2**k`` (floor: in [0, 2**k) for any sign, as ``& (2**k - 1)``): ``== r``
    compares the base's residue (the same value for the whole row, so emitted once) with
    ``(r - offset) mod 2**k``."""

    __slots__ = ("modulus",)

    def __init__(self, index: AffineIndex, modulus: int, emit_plain):
        super().__init__(index, emit_plain)
        self.modulus = modulus

    def compare(self, op: str, c: int):
        if op not in ("eq", "ne"):
            return None
        if not 0 <= c < self.modulus:   # a residue never equals it
            return cutlass.Boolean(op == "ne")
        residue = self.index.base & Int32(self.modulus - 1)
        return _CMP[op](residue, Int32((c - self.index.offsets) % self.modulus))


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
    """An integer operand that does not vary along the row: not a vector, not an index
    (nor a form of one: its element's offset varies)."""
    return not isinstance(x, (IndexForm, cute.TensorSSA))


def emit_affine(n: ir.Node, a: list, emit_plain):
    """Node ``n``'s value when an operand is an ``IndexForm`` and a form survives it (the
    result may be another ``AffineIndex``, ``IndexMagnitude`` or ``IndexResidue``, the
    float of one, or a compare's Boolean); None otherwise (the caller then uses every
    operand's ``value()``). ``emit_plain()``: ``n`` emitted on the plain operands (what a
    form's ``value()`` stands for)."""
    op = n.op
    x = a[0]
    if n.dtype == ir.FLOAT and any(isinstance(v, FloatAffine) for v in a):
        if op == "neg":
            return x.negated()
        if op == "mul":
            form, other = (x, a[1]) if isinstance(x, FloatAffine) else (a[1], x)
            if _row_constant(other):
                return form.times(other)
        return None
    if op in ("add", "sub") and n.dtype == ir.INT:
        y = a[1]
        if isinstance(x, AffineIndex) and _row_constant(y):
            return x.plus(y, 1 if op == "add" else -1)
        if isinstance(y, AffineIndex) and _row_constant(x):
            return y.plus(x) if op == "add" else y.subtracted_from(x)
        return None
    if isinstance(x, AffineIndex):
        if op == "cast" and n.dtype == ir.FLOAT:
            return x.to_float()
        if op == "neg":
            return x.negated()
        modulus = _power_of_two_modulus(n)
        if op == "abs" and n.dtype == ir.INT and x.plain_compares:
            return IndexMagnitude(x, emit_plain)
        if modulus is not None and x.plain_compares:
            return IndexResidue(x, modulus, emit_plain)
    if op in _CMP:
        for form, other, form_op in ((a[0], n.args[1], op), (a[1], n.args[0], _FLIPPED[op])):
            if isinstance(form, IndexForm) and other.op == "const" and other.dtype == ir.INT:
                return form.compare(form_op, int(other.attr))
    return None


def _power_of_two_modulus(n: ir.Node) -> int | None:
    """``m`` where ``n`` is ``x % m`` or ``x & (m - 1)`` on integers, ``m`` a constant power of two."""
    if n.dtype != ir.INT or n.op not in ("mod", "and") or n.args[1].op != "const":
        return None
    m = int(n.args[1].attr) + (1 if n.op == "and" else 0)
    return m if m > 0 and m & (m - 1) == 0 else None


def plain_value(x):
    """``x``, or its plain integer if it is an ``IndexForm``."""
    return x.value() if isinstance(x, IndexForm) else x


def plain(values: list) -> list:
    """``values`` with every ``IndexForm`` as its plain integer."""
    return [plain_value(x) for x in values]


def casts_index_affinely(expr: ir.Node, var: str = "kv") -> bool:
    """Whether ``expr`` converts to float an integer built from ``var`` by ``+`` / ``-``
    with terms that do not read ``var`` (``float(kv - q)``), or compares such an integer
    (or its ``abs``, or its residue modulo a power of two) with a constant: where an
    ``AffineIndex`` pays."""
    for n in expr.walk():
        if n.op == "cast" and n.dtype == ir.FLOAT and _affine_in(n.args[0], var):
            return True
        if n.op in _CMP and any(_compared_affinely(x, var) and y.op == "const" and y.dtype == ir.INT
                                for x, y in (n.args, n.args[::-1])):
            return True
    return False


def _compared_affinely(n: ir.Node, var: str) -> bool:
    if n.op == "abs" or _power_of_two_modulus(n) is not None:
        n = n.args[0]
    return n.dtype == ir.INT and _affine_in(n, var)


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
