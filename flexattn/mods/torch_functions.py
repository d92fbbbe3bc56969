"""torch and numpy functions written with the IR's own operations.

The tracer (``trace.py``) looks every function a mod calls up by name in one table; the
ones here have no IR node of their own. Each is composed of existing nodes, exactly as if
the user had written the formula, so the kernels, the interval analysis and the
derivatives take them unchanged: a function added here needs no GPU emission code, and
its gradient (a score mod with ``gelu`` that trains) comes from the nodes it is made of.

Accuracy, as the kernels compute them (float32 scores): integers and booleans exact;
floats within a few float32 roundings of the formula, *absolute* near zero for the
forms built from exp / log (sinh, asinh, log1p: errors ~1e-7 beside the score, not
relative to a tiny result). erf and atan are IR nodes of their own (on the GPU: atan
libdevice's; erf Abramowitz & Stegun 7.1.26 under the kernels' fast math, |error| < 1.5e-7,
else libdevice's; exact derivatives): gelu, ndtr, erfc and asin / acos / atan2 are built on them.
Powers with an integer exponent multiply (exact as float32 products); other powers are
exp2(p log2 |x|) with torch's signs, NaNs and zeros.

Every name is reachable the way torch users spell it: ``torch.f``, ``x.f()``, ``x.f_()``
in place, ``torch.special.f`` and ``torch.nn.functional.f`` (``inplace=True`` and in-place
methods rebind the traced value, as the in-place op would change the tensor), and numpy's
ufunc names where numpy has them. Tensor idioms (``masked_fill``, ``alpha=``, ``clone``,
``type_as``, ``torch.finfo`` of a traced dtype) live here too.
"""

from __future__ import annotations

import math

import numpy as np

from . import ir
from . import trace as _t
from .vectors import elementwise, is_vector

_PI = math.pi
_LN2 = math.log(2.0)
_BIG = 2.0 ** 28   # above it, x^2 + 1 == x^2 in float32 (and x^2 overflows near 1.8e19)
_F32_MAX = float(np.finfo(np.float32).max)   # nan_to_num's infinities: the kernels' score type


# --- operands -------------------------------------------------------------------------------

def _v(x):
    """An operand as a proxy, so the formulas below can use operators on it (numbers,
    0-d tensors and scalar captures become traced constants or loads)."""
    return x if isinstance(x, _t.Sym) else _t.Sym(_t._to_node(x))


def _is_float(x) -> bool:
    return _t._to_node(x).dtype == ir.FLOAT


def _float(x):
    return _t._cast_to("float32")(_v(x))


def _const(value):
    return _t.Sym(ir.const(value))


where = _t._where
_floor = _t._floor


def _abs(x):
    return _t._unary("abs")(x)


def _exp(x):
    return _t._unary("exp")(x)


def _log(x):
    return _t._unary("log")(x)


def _sqrt(x):
    return _t._unary("sqrt")(x)


def _neg_where(negative, magnitude):
    return where(negative, -magnitude, magnitude)


def _odd(x, magnitude):
    """An odd function's value from its magnitude at |x|: x's sign, and zeros as they came
    (f(-0.0) = -0.0, as torch's)."""
    return where(x < 0, -magnitude, where(x == 0, x, magnitude))


# --- rounding and division ------------------------------------------------------------------

def divide(a, b, rounding_mode=None):
    if rounding_mode is None:
        return _t._binary("truediv")(a, b)
    if rounding_mode == "floor":
        return _t._binary("floordiv")(a, b)
    if rounding_mode == "trunc":
        return trunc_divide(a, b)
    raise _t.TraceError(f"division with rounding_mode={rounding_mode!r}: torch takes None, 'floor' or 'trunc'")


def trunc(x):
    """torch.trunc / fix: toward zero (integers are whole already)."""
    x = _v(x)
    return where(x < 0, -_floor(-x), _floor(x)) if _is_float(x) else x


def trunc_divide(a, b):
    """div(rounding_mode="trunc"): integers exactly (floor division, plus one where the
    signs differ and a remainder is left); floats as the true quotient truncated."""
    a, b = _v(a), _v(b)
    if _is_float(a) or _is_float(b):
        return trunc(a / b)
    quotient, remainder = a // b, a % b
    signs_differ = (a < 0) != (b < 0)
    return where((remainder != 0) & signs_differ, quotient + 1, quotient)


def fmod(a, b):
    """torch.fmod: the remainder with the dividend's sign, a - b * trunc(a / b) (integers
    exactly; floats within the rounding of that product)."""
    a, b = _v(a), _v(b)
    return a - b * trunc_divide(a, b)


def round_half_even(x, decimals=0):
    """torch.round (half to even, as torch and numpy): from the floor and the exact
    fraction x - floor(x), so no rounding of x + 0.5 can move a value across a half.
    ``decimals`` scales as torch does (multiply by 10^d for d > 0, divide for d < 0)."""
    x = _v(x)
    if not _is_float(x):
        return x
    if decimals:
        scale = 10.0 ** abs(int(decimals))
        if decimals > 0:
            return round_half_even(x * scale) / scale
        return round_half_even(x / scale) * scale
    f = _floor(x)
    fraction = x - f
    odd = (f - 2.0 * _floor(f * 0.5)) != 0
    up = (fraction > 0.5) | ((fraction == 0.5) & odd)
    r = where(up, f + 1.0, f)
    return where(r == 0, x * 0.0, r)   # -0.4 rounds to -0.0


def frac(x):
    x = _v(x)
    return x - trunc(x)


def reciprocal(x):
    return 1.0 / _v(x)


# --- signs and classes ------------------------------------------------------------------------

def isnan(x):
    # (!= is unordered on the GPU too: NaN != NaN, as in Python)
    x = _v(x)
    return x != x if _is_float(x) else _const(False)


def isinf(x):
    x = _v(x)
    return _abs(x) == float("inf") if _is_float(x) else _const(False)


def isfinite(x):
    x = _v(x)
    return (x == x) & (_abs(x) != float("inf")) if _is_float(x) else _const(True)


def signbit(x):
    """True for negative values and -0.0 (1 / -0.0 is -inf on the GPU as in IEEE)."""
    x = _v(x)
    if not _is_float(x):
        return x < 0
    return (x < 0) | ((x == 0) & (1.0 / x < 0))


def copysign(magnitude, sign):
    """|magnitude| with sign's sign bit (a float, as torch's)."""
    m = _abs(_float(magnitude))
    return _neg_where(signbit(sign), m)


def heaviside(x, values):
    x = _v(x)
    step = where(x > 0, _t._full_like(x, 1), _t._full_like(x, 0))
    return where(x == 0, values, step)


def nan_to_num(x, nan=0.0, posinf=None, neginf=None):
    x = _v(x)
    if not _is_float(x):
        return x
    hi = _F32_MAX if posinf is None else posinf
    lo = -_F32_MAX if neginf is None else neginf
    return where(x != x, nan, where(x == float("inf"), hi, where(x == -float("inf"), lo, x)))


def clamp_min(x, min):
    return _t._clamp(x, min=min)


def clamp_max(x, max):
    return _t._clamp(x, max=max)


# --- exponentials, logarithms, powers -------------------------------------------------------

def log1p(x):
    # log(1 + x) / exp(x) - 1: within float32's rounding of 1 + x (absolute error ~6e-8
    # near 0, where torch's are exact: no matter beside a score)
    return _log(1.0 + _v(x))


def expm1(x):
    return _exp(_v(x)) - 1.0


def log10(x):
    return _t._unary("log2")(x) * math.log10(2.0)


def logaddexp(a, b):
    """log(exp(a) + exp(b)) as max + log(1 + exp(-|a - b|)); where the max is infinite, the max."""
    a, b = _v(a), _v(b)
    top = _t._binary("maximum")(a, b)
    return where(isinf(top), top, top + log1p(_exp(-_abs(a - b))))


def logaddexp2(a, b):
    a, b = _v(a), _v(b)
    top = _t._binary("maximum")(a, b)
    rest = _t._unary("log2")(1.0 + _t._unary("exp2")(-_abs(a - b)))
    return where(isinf(top), top, top + rest)


def xlogy(x, y):
    """x * log(y), 0 where x == 0 (unless y is NaN), as torch.special.xlogy."""
    x, y = _float(x), _float(y)
    return where((x == 0) & (y == y), 0.0, x * _log(y))


def xlog1py(x, y):
    x, y = _float(x), _float(y)
    return where((x == 0) & (y == y), 0.0, x * log1p(y))


def entr(x):
    """-x log x for x > 0, 0 at 0, -inf below (torch.special.entr)."""
    x = _float(x)
    return where(x > 0, -x * _log(x), where(x == 0, 0.0, where(x != x, x, -float("inf"))))


def logit(x, eps=None):
    x = _float(x)
    if eps is not None:
        x = _t._clamp(x, min=eps, max=1.0 - eps)
    return _log(x / (1.0 - x))


def _integer_power(x, n: int):
    """x ** n for an integer n >= 0 by repeated squaring (exact as products)."""
    result, base = None, x
    while n:
        if n & 1:
            result = base if result is None else result * base
        n >>= 1
        if n:
            base = base * base
    return result


_MAX_MULTIPLIED_EXPONENT = 64


def power(x, exponent):
    """x ** p as torch computes it. A constant (or captured number) integer exponent up to
    64 multiplies; 0.5 / -0.5 are sqrt / rsqrt; anything else, traced exponents included, is
    exp2(p log2|x|) with torch's special values: x ** 0 == 1 and 1 ** p == 1 (also NaN),
    a negative base gives a signed result for whole exponents and NaN otherwise."""
    p = exponent
    x_is_number = isinstance(x, (bool, int, float, np.bool_, np.number))
    p_node = _t._to_node(p)
    if p_node.op != "const":   # a captured number: bake it, as Python control flow does
        ctx = _t.active_context()
        value = ctx.concretize(p_node) if ctx is not None else None
        if value is not None:
            p_node = ir.const(value)
    if p_node.op == "const":
        return _constant_power(x, p_node)
    if x_is_number and not isinstance(x, (float, np.floating)) and not _is_float(p):
        return _integer_base_power(int(x), _v(p))
    if x_is_number and float(x) > 0:
        return _t._unary("exp2")(_float(p) * math.log2(float(x)))
    x, p = _v(x), _v(p)
    if not _is_float(x) and not _is_float(p):
        raise _t.TraceError("an integer to a traced integer power in a mod: write the base as a float"
                            " (x.float() ** p), exact below 2^24")
    return _general_power(_float(x), _float(p))


def _integer_base_power(base: int, p):
    """``base ** p`` for an integer base and a traced integer exponent, as torch computes it
    on integer tensors (``2 ** (-(h + 1))`` is 0 there): an integer, 0 for negative exponents
    unless |base| is 1; exact while |result| < 2^24."""
    if base == 1:
        return _t._full_like(p, 1)
    if base == -1:
        return where(p % 2 == 0, 1, -1)
    if base == 0:
        return where(p == 0, 1, 0)
    magnitude = _floor(_t._unary("exp2")(_float(p) * math.log2(abs(base))) + 0.5)
    if base < 0:
        magnitude = where(p % 2 == 0, magnitude, -magnitude)
    return _t._cast_to("int32")(where(p < 0, 0.0, magnitude))


def _constant_power(x, p_node):
    p = p_node.attr
    x = _v(x)
    if p_node.dtype == ir.FLOAT:  # int ** float is a float (torch, numpy)
        x = _float(x)
    if not _is_float(x) and p < 0:
        raise _t.TraceError(f"integers to negative integer powers are not allowed (x ** {p}), as in torch;"
                            " write the base as a float")
    if p == 0.5:
        return _sqrt(x)
    if p == -0.5:
        return _t._unary("rsqrt")(x)
    if float(p).is_integer() and abs(p) <= _MAX_MULTIPLIED_EXPONENT:
        n = int(abs(p))
        if n == 0:
            return _t._full_like(x, 1)
        result = _integer_power(x, n)
        return 1.0 / result if p < 0 else result
    return _general_power(_float(x), _const(float(p)))


def _general_power(x, p):
    magnitude = _t._unary("exp2")(p * _t._unary("log2")(_abs(x)))
    whole = p == _floor(p)
    odd = whole & (_abs(p) < 2.0 ** 24) & ((p - 2.0 * _floor(p * 0.5)) != 0)   # (larger floats are even)
    # a negative base: signed for whole exponents, NaN otherwise; -inf to any power is +-inf or +-0
    negative_base = where(whole | (x == -float("inf")), _neg_where(odd, magnitude), float("nan"))
    result = where(signbit(x) & ((x != 0) | odd), negative_base, magnitude)   # (-0.0) ** 3 is -0.0
    return where((p == 0) | (x == 1) | ((x == -1) & isinf(p)), 1.0, result)


def reverse_power(exponent, base):
    """``base ** x`` for a number base (``2 ** (-8 * (h + 1) / H)``, ALiBi's slopes)."""
    return power(base, exponent)


def cbrt(x):
    x = _float(x)
    return _odd(x, _t._unary("exp2")(_t._unary("log2")(_abs(x)) * (1.0 / 3.0)))


def hypot(a, b):
    a, b = _float(a), _float(b)
    return where(isinf(a) | isinf(b), float("inf"), _sqrt(a * a + b * b))   # (also beside a NaN)


# --- trigonometric and hyperbolic -------------------------------------------------------------

def tan(x):
    return _t._unary("sin")(x) / _t._unary("cos")(x)


def atan(x):
    return _t._unary("atan")(x)   # an IR node: libdevice's atanf on the GPU, 1 / (1 + x^2) as its derivative


def asin(x):
    x = _float(x)
    return atan(x / _sqrt((1.0 - x) * (1.0 + x)))   # +-1: x / 0 = +-inf, atan = +-pi/2


def acos(x):
    x = _float(x)
    return 2.0 * atan(_sqrt((1.0 - x) / (1.0 + x)))   # accurate near 1 (no pi/2 - asin)


def atan2(y, x):
    """The angle of (x, y) in (-pi, pi], with torch's signed zeros and both-infinite cases."""
    y, x = _float(y), _float(x)
    both_infinite = isinf(x) & isinf(y)
    ratio = where(both_infinite, copysign(1.0, y) / copysign(1.0, x), y / x)
    a = atan(ratio)
    y_negative = signbit(y)
    on_axis = where(y > 0, _PI / 2, where(y < 0, -_PI / 2, where(signbit(x), _neg_where(y_negative, _PI), y)))
    angle = where(x > 0, a, where(x < 0, where(y_negative, a - _PI, a + _PI), on_axis))
    return where((x != x) | (y != y), x + y, angle)


def sinh(x):
    """(e^|x| - e^-|x|) / 2 with e = e^|x| / 2 computed directly, so it overflows where
    sinh does (|x| ~ 89.4), not where e^|x| does; absolute error ~1e-7 near 0."""
    x = _float(x)
    e = _exp(_abs(x) - _LN2)
    return _odd(x, e - 0.25 / e)


def cosh(x):
    e = _exp(_abs(_float(x)) - _LN2)
    return e + 0.25 / e


def asinh(x):
    x = _float(x)
    a = _abs(x)
    r = where(a > _BIG, _log(a) + _LN2, _log(a + _sqrt(a * a + 1.0)))
    return _odd(x, r)


def acosh(x):
    x = _float(x)
    r = where(x > _BIG, _log(x) + _LN2, _log(x + _sqrt((x - 1.0) * (x + 1.0))))
    return where(x < 1.0, float("nan"), r)   # (far below 1, (x - 1)(x + 1) overflows: not NaN)


def atanh(x):
    x = _float(x)
    return where(x == 0, x, 0.5 * _log((1.0 + x) / (1.0 - x)))


def sinc(x):
    x = _float(x)
    px = x * _PI
    return where(x == 0, 1.0, _t._unary("sin")(px) / px)


def deg2rad(x):
    return _float(x) * (_PI / 180.0)


def rad2deg(x):
    return _float(x) * (180.0 / _PI)


# --- error function and the normal distribution ---------------------------------------------

def erf(x):
    return _t._unary("erf")(x)   # an IR node: libdevice's erff on the GPU, 2/sqrt(pi) exp(-x^2) as its derivative


def erfc(x):
    return 1.0 - erf(x)


def ndtr(x):
    return 0.5 * (1.0 + erf(_float(x) * (1.0 / math.sqrt(2.0))))


# --- activations (torch.nn.functional) --------------------------------------------------------

def _activation(fn):
    """An F.* activation: ``inplace=True`` rebinds the traced value to the result, which is
    what the in-place op means for the rest of the function."""

    def apply(x, *args, inplace=False, **kwargs):
        result = fn(_v(x), *args, **kwargs)
        if inplace and isinstance(x, _t.Sym) and isinstance(result, _t.Sym):
            x.node = result.node
            return x
        return result

    apply.__name__ = fn.__name__
    return apply


def relu(x):
    return where(x < 0, _t._full_like(x, 0), x)   # NaN stays NaN, as torch's


def relu6(x):
    return hardtanh(x, 0.0, 6.0)


def hardtanh(x, min_val=-1.0, max_val=1.0):
    return _t._clamp(x, min=min_val, max=max_val)


def leaky_relu(x, negative_slope=0.01):
    return where(x > 0, x, x * negative_slope)


def elu(x, alpha=1.0):
    return where(x > 0, x, alpha * expm1(x))


_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def selu(x):
    return _SELU_SCALE * elu(x, _SELU_ALPHA)


def celu(x, alpha=1.0):
    return where(x > 0, x, alpha * expm1(x / alpha))


def gelu(x, approximate="none"):
    x = _float(x)
    if approximate == "tanh":
        inner = math.sqrt(2.0 / _PI) * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1.0 + _t._unary("tanh")(inner))
    if approximate != "none":
        raise _t.TraceError(f"gelu(approximate={approximate!r}): torch takes 'none' or 'tanh'")
    return x * ndtr(x)


def silu(x):
    return x * _t._unary("sigmoid")(x)


def softplus(x, beta=1.0, threshold=20.0):
    """log(1 + exp(beta x)) / beta, linear above the threshold (as torch)."""
    x = _float(x)
    return where(x * beta > threshold, x, log1p(_exp(x * beta)) / beta)


def mish(x):
    return x * _t._unary("tanh")(softplus(x))


def logsigmoid(x):
    x = _float(x)
    return _t._binary("minimum")(x, 0.0) - log1p(_exp(-_abs(x)))


def hardsigmoid(x):
    return relu6(_float(x) + 3.0) / 6.0


def hardswish(x):
    return _float(x) * hardsigmoid(x)


def softsign(x):
    return x / (1.0 + _abs(x))


def tanhshrink(x):
    return x - _t._unary("tanh")(x)


def threshold(x, threshold, value):
    return where(x <= threshold, value, x)   # NaN passes, as torch's


def hardshrink(x, lambd=0.5):
    return where((x >= -lambd) & (x <= lambd), _t._full_like(x, 0), x)


def softshrink(x, lambd=0.5):
    return where(x > lambd, x - lambd, where(x < -lambd, x + lambd, x * 0))   # (x * 0: NaN and -0.0 pass)


# --- blends -------------------------------------------------------------------------------------

def lerp(start, end, weight):
    """torch's two-sided form: start + w (end - start) for |w| < 0.5, else end - (end - start)(1 - w)."""
    start, end = _v(start), _v(end)
    diff = end - start
    return where(_abs(_v(weight)) < 0.5, start + weight * diff, end - diff * (1.0 - weight))


def addcmul(x, tensor1, tensor2, value=1):
    return _v(x) + value * _v(tensor1) * tensor2


def addcdiv(x, tensor1, tensor2, value=1):
    return _v(x) + value * (_v(tensor1) / tensor2)


# --- tensor idioms -------------------------------------------------------------------------------

def add(x, other, alpha=1):
    return _v(x) + (other if alpha == 1 else alpha * _v(other))


def sub(x, other, alpha=1):
    return _v(x) - (other if alpha == 1 else alpha * _v(other))


def rsub(x, other, alpha=1):
    return _v(other) - (x if alpha == 1 else alpha * _v(x))


def masked_fill(x, mask, value):
    """``score.masked_fill(q_idx < kv_idx, float("-inf"))``: value where mask holds."""
    return where(mask, value, x)


def identity(x, *_, **__):
    return x   # clone / detach / contiguous: a traced value is a value


def type_as(x, other):
    return _t._cast_to(_t._to_node(other).dtype)(_v(x))


def _torch_dtype(dtype):
    """A traced value's dtype name ("float32": a mod's floats) as torch's dtype."""
    import torch
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def finfo(*dtype):
    """torch.finfo of a traced value's dtype (``torch.finfo(score.dtype).min``)."""
    import torch
    return torch.finfo(*map(_torch_dtype, dtype))


def iinfo(dtype):
    import torch
    return torch.iinfo(_torch_dtype(dtype))


# --- the table ----------------------------------------------------------------------------------

_ACTIVATIONS = {f.__name__: _activation(f) for f in (
    relu, relu6, hardtanh, leaky_relu, elu, selu, celu, gelu, silu, softplus, mish, logsigmoid,
    hardsigmoid, hardswish, softsign, tanhshrink, threshold, hardshrink, softshrink)}

FUNCTIONS = {
    "div": divide, "divide": divide,
    "trunc": trunc, "fix": trunc, "fmod": fmod, "frac": frac,
    "round": round_half_even, "__round__": round_half_even, "rint": round_half_even, "around": round_half_even,
    "reciprocal": reciprocal,
    "isnan": isnan, "isinf": isinf, "isfinite": isfinite,
    "signbit": signbit, "copysign": copysign, "sgn": _t._sign, "heaviside": heaviside,
    "nan_to_num": nan_to_num, "clamp_min": clamp_min, "clamp_max": clamp_max,
    "log1p": log1p, "expm1": expm1, "log10": log10, "logaddexp": logaddexp, "logaddexp2": logaddexp2,
    "xlogy": xlogy, "xlog1py": xlog1py, "entr": entr, "logit": logit,
    "pow": power, "__pow__": power, "power": power, "float_power": power, "__rpow__": reverse_power,
    "square": lambda x: power(x, 2), "cbrt": cbrt, "hypot": hypot,
    "tan": tan, "atan": atan, "arctan": atan, "asin": asin, "arcsin": asin, "acos": acos, "arccos": acos,
    "atan2": atan2, "arctan2": atan2, "sinh": sinh, "cosh": cosh,
    "asinh": asinh, "arcsinh": asinh, "acosh": acosh, "arccosh": acosh, "atanh": atanh, "arctanh": atanh,
    "sinc": sinc, "deg2rad": deg2rad, "radians": deg2rad, "rad2deg": rad2deg, "degrees": rad2deg,
    "erf": erf, "erfc": erfc, "ndtr": ndtr,
    "expit": _t._unary("sigmoid"),
    **_ACTIVATIONS, "log_sigmoid": _ACTIVATIONS["logsigmoid"],
    "lerp": lerp, "addcmul": addcmul, "addcdiv": addcdiv,
    "add": add, "sub": sub, "subtract": sub, "rsub": rsub, "masked_fill": masked_fill,
    "clone": identity, "detach": identity, "contiguous": identity, "type_as": type_as,
}

def _elementwise(fn):
    """On a vector read (``torch.atan(emb[h, q_idx])``), the function element by element."""

    def apply(*args, **kwargs):
        if any(is_vector(a) for a in args):
            return elementwise(lambda *xs: fn(*xs, **kwargs), args)
        return fn(*args, **kwargs)

    return apply


FUNCTIONS = {name: _elementwise(fn) for name, fn in FUNCTIONS.items()}

# Names that are also tensor methods (x.atan(), x.relu(), x.clamp_min(0), ...)
TENSOR_METHODS = (
    "divide", "trunc", "fix", "fmod", "frac", "round", "reciprocal", "isnan", "isinf", "isfinite",
    "signbit", "copysign", "sgn", "heaviside", "nan_to_num", "clamp_min", "clamp_max", "log1p", "expm1",
    "log10", "logaddexp", "logaddexp2", "xlogy", "logit", "float_power", "hypot",
    "tan", "atan", "arctan", "asin", "arcsin", "acos", "arccos", "atan2", "arctan2", "sinh", "cosh",
    "asinh", "arcsinh", "acosh", "arccosh", "atanh", "arctanh", "sinc", "deg2rad", "rad2deg", "erf", "erfc",
    "relu", "hardshrink", "lerp", "addcmul", "addcdiv",
    "add", "sub", "subtract", "mul", "multiply", "true_divide", "floor_divide", "masked_fill",
    "clone", "detach", "contiguous", "type_as", "eq", "ne", "lt", "le", "gt", "ge", "less", "less_equal",
    "greater", "greater_equal", "equal", "not_equal", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not",
    "fmin", "fmax", "absolute", "negative",
)   # (div, pow, square, exp2, sigmoid, ...: trace._PROXY_METHODS)

# In-place tensor methods (``s.add_(b)``, ``s.clamp_(min=0)``, ``s.masked_fill_(m, v)``,
# ``s.fill_(v)``): the traced value is rebound to the result (trace.py), as the operation
# would change the tensor for the rest of the function.
INPLACE_METHODS = tuple(f"{n}_" for n in (
    "add", "sub", "mul", "div", "clamp", "clamp_min", "clamp_max", "masked_fill", "neg", "abs", "exp", "log",
    "tanh", "sigmoid", "relu", "pow", "floor", "ceil", "round", "trunc", "sqrt", "rsqrt", "sin", "cos",
    "fmod", "remainder", "reciprocal", "sign", "square", "lerp", "addcmul", "addcdiv", "nan_to_num",
    "logical_not", "logical_and", "logical_or", "bitwise_and", "bitwise_or", "bitwise_xor")) + ("fill_",)
