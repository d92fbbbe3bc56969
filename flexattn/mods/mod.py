"""Mod values: an IR expression plus the captured runtime inputs it reads.

``MaskMod``  — ``mask(b, h, q_idx, kv_idx) -> bool``; composes with ``& | ~ ^``.
``ScoreMod`` — ``score(score, b, h, q_idx, kv_idx) -> float``; chains with ``>>``
               (``a >> b`` applies ``a`` first, then ``b`` to its result).

Mods are immutable. ``structure_key`` (kind + IR, which includes buffer dtypes and ranks)
decides compilation; ``captures`` are values and never do. A mod is also callable: on
traced proxies it inlines itself (so built-ins compose inside user functions), on arrays
it evaluates with numpy.
"""

from __future__ import annotations

import functools
import weakref

from typing import Callable

import numpy as np

from . import ir
from .evaluate import evaluate
from .trace import Sym, TraceError, _is_number, active_context, canonicalize, trace
from .trace_cache import TraceCache

MASK_VARS = ("b", "h", "q", "kv")
SCORE_VARS = ("score", "b", "h", "q", "kv")


# Where a mod is made — a built-in's call (``built_in``), an operator, ``mask_mod`` /
# ``score_mod`` — an adapter may take over: ``MADE_ELSEWHERE(kind, name, args, kwargs)``
# returns the mod made some other way, or None to make it here. flexattn.torch uses it in
# code torch.compile's dynamo traces, which cannot trace the tracer: mods of constants are
# made in plain Python at compile time, the others refused with the way out.
MADE_ELSEWHERE = None

# name -> the undecorated built-in constructor (what an adapter's recipe calls)
BUILT_INS: dict = {}

# A mod called on a framework's arrays — eagerly, or while the framework traces a function
# that calls it (torch's flex HOP tracing a ``mask_mod`` that wraps our mod, as gpt-fast's
# position offset does) — is evaluated by that adapter's own ops, so the framework sees its
# arrays in and out: ``(accepts(x), evaluate(expr, env, captures))`` pairs, the first whose
# ``accepts`` takes an argument wins (flexattn.torch: torch tensors). Elsewhere: numpy.
ARRAY_EVALUATORS: list = []


def _handed_over(kind: str):
    """Decorator: calls of ``make`` (a constructor, ``kind`` "call", or an operator, "op") go
    through ``MADE_ELSEWHERE`` first."""
    def wrap(make):
        @functools.wraps(make)
        def call(*args, **kwargs):
            if MADE_ELSEWHERE is not None:
                mod = MADE_ELSEWHERE(kind, make.__name__, args, kwargs)
                if mod is not None:
                    return mod
            return make(*args, **kwargs)
        return call
    return wrap


def built_in(make):
    """Marks a public mod constructor (``causal``, ``alibi``...): its calls go through
    ``MADE_ELSEWHERE`` first, which may remake it by name (``BUILT_INS``)."""
    BUILT_INS[make.__name__] = make
    return _handed_over("call")(make)


# id -> live mod / block mask. Lets code that can only pass constants refer to one by id()
# (torch.compile: see flexattn/torch/__init__.py, _compiled_call). Weak: it keeps nothing alive.
LIVE_OBJECTS: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


class Mod:
    kind: str = ""
    var_names: tuple = ()

    __slots__ = ("expr", "captures", "name", "__weakref__")

    def __init__(self, expr: ir.Node, captures: tuple = (), name: str | None = None):
        object.__setattr__(self, "expr", expr)
        object.__setattr__(self, "captures", tuple(captures))
        object.__setattr__(self, "name", name)
        LIVE_OBJECTS[id(self)] = self

    def __setattr__(self, *_):
        raise AttributeError("mods are immutable; build a new one")

    def __delattr__(self, *_):
        raise AttributeError("mods are immutable; build a new one")

    @property
    def structure_key(self) -> tuple:
        """What a compiled kernel depends on: kind + IR (with buffer dtypes and ranks)."""
        return (self.kind, self.expr.key)

    def with_captures(self, captures) -> "Mod":
        """Same structure, other values (e.g. numpy copies of framework tensors)."""
        if len(captures) != len(self.captures):
            raise ValueError(f"expected {len(self.captures)} captured values, got {len(captures)}")
        return type(self)(self.expr, captures, self.name)

    @property
    def depends_on(self) -> frozenset:
        """Which variables the expression reads (e.g. a mask without 'b'/'h' broadcasts)."""
        return self.expr.free_vars()

    def __repr__(self):
        label = f"{self.name}: " if self.name else ""
        args = ", ".join("q_idx" if v == "q" else "kv_idx" if v == "kv" else v for v in self.var_names)
        caps = f", {len(self.captures)} captured" if self.captures else ""
        return f"{type(self).__name__}({label}({args}) -> {ir.format_node(self.expr)}{caps})"

    def __call__(self, *args):
        if len(args) != len(self.var_names):
            raise TypeError(f"{type(self).__name__} takes {len(self.var_names)} arguments ({', '.join(self.var_names)})")
        if any(isinstance(a, Sym) for a in args) or active_context() is not None:
            return Sym(self.inline([a.node if isinstance(a, Sym) else ir.as_node(a) for a in args]))
        for accepts, evaluate_with in ARRAY_EVALUATORS:
            if any(accepts(a) for a in args):
                return evaluate_with(self.expr, dict(zip(self.var_names, args)), self.captures)
        env = dict(zip(self.var_names, (np.asarray(a) for a in args)))
        return evaluate(self.expr, env, [_as_numpy(c) for c in self.captures])

    def inline(self, arg_nodes) -> ir.Node:
        """This mod's expression inside the active trace, variables replaced by ``arg_nodes``."""
        ctx = active_context()
        if ctx is None:
            raise TraceError("inline() outside a trace")
        slots = [ctx.capture(v) for v in self.captures]
        bound = dict(zip(self.var_names, arg_nodes))
        return ir.substitute(self.expr, _slot_and_var_mapping(slots, bound))

    def __bool__(self):
        raise TypeError(f"{type(self).__name__} has no truth value; combine mods with & | ~ (not and/or/not)")


def _slot_and_var_mapping(slots, bound):
    def mapping(n):
        if n.op == "var":
            return bound.get(n.attr)
        if n.op == "scalar":
            return ir.scalar(slots[n.attr], n.dtype)
        if n.op == "load":
            return ir.Node("load", n.dtype, n.args, ir.BufferRef(slots[n.attr.slot], *n.attr[1:]))
        return None

    return mapping


def _combine(cls, parts, build, name=None):
    """New mod of class ``cls`` from ``parts`` (mods), ``build(*exprs)`` joining their exprs."""
    values: list = []
    slot_of: dict[int, int] = {}
    exprs = []
    for part in parts:
        slots = []
        for v in part.captures:
            if _is_number(v):  # numbers by value-slot, never merged (see TraceContext.capture)
                values.append(v)
                slots.append(len(values) - 1)
                continue
            if id(v) not in slot_of:
                slot_of[id(v)] = len(values)
                values.append(v)
            slots.append(slot_of[id(v)])
        exprs.append(ir.substitute(part.expr, _slot_and_var_mapping(slots, {})))
    expr, captures = canonicalize(build(*exprs), values)
    return cls(expr, captures, name)


class MaskMod(Mod):
    kind = "mask"
    var_names = MASK_VARS
    __slots__ = ()

    @_handed_over("op")
    def __and__(self, other):
        return _combine(MaskMod, (self, as_mask(other, "right operand of &")), lambda a, b: ir.binary("and", a, b), _join(self, other, "&"))

    @_handed_over("op")
    def __or__(self, other):
        return _combine(MaskMod, (self, as_mask(other, "right operand of |")), lambda a, b: ir.binary("or", a, b), _join(self, other, "|"))

    @_handed_over("op")
    def __xor__(self, other):
        return _combine(MaskMod, (self, as_mask(other, "right operand of ^")), lambda a, b: ir.binary("xor", a, b), _join(self, other, "^"))

    def __rand__(self, other):
        return as_mask(other, "left operand of &") & self

    def __ror__(self, other):
        return as_mask(other, "left operand of |") | self

    def __rxor__(self, other):
        return as_mask(other, "left operand of ^") ^ self

    @property
    def attends_everywhere(self) -> bool:
        """Whether the mask is the constant True (``mods.full()``): nothing to apply."""
        return self.expr.op == "const" and self.expr.attr is True

    @_handed_over("op")
    def __invert__(self):
        return _combine(MaskMod, (self,), lambda a: ir.unary("not", a), f"~{self.name}" if self.name else None)


class ScoreMod(Mod):
    kind = "score"
    var_names = SCORE_VARS
    __slots__ = ()

    @_handed_over("op")
    def __rshift__(self, other):
        """``a >> b``: apply ``a``, then ``b`` to its result."""
        other = as_score(other, "right operand of >>")
        first = self

        def chain(ea, eb):
            return ir.substitute(eb, lambda n: ea if n.op == "var" and n.attr == "score" else None)

        return _combine(ScoreMod, (first, other), chain, _join(first, other, ">>"))

    def __rrshift__(self, other):
        return as_score(other, "left operand of >>") >> self


def _join(a, b, symbol):
    na = getattr(a, "name", None)
    nb = getattr(b, "name", None)
    return f"{na} {symbol} {nb}" if na and nb else None


def _as_numpy(value):
    from ..arrays import to_numpy  # late import: keeps mods free of framework logic

    return to_numpy(value)


# --- constructors -------------------------------------------------------------------------------

@_handed_over("call")
def mask_mod(fn: Callable | None = None, *, name: str | None = None):
    """Trace ``fn(b, h, q_idx, kv_idx) -> bool`` into a ``MaskMod``. Usable as a decorator."""
    if fn is None:
        return lambda f: mask_mod(f, name=name)
    return _MASK_TRACES.lookup(fn, name)


def _trace_mask(fn, name):
    _check_arity(fn, 4, "a mask function takes (b, h, q_idx, kv_idx)")
    expr, captures = trace(fn, MASK_VARS)
    if expr.dtype == ir.FLOAT:
        raise TraceError(f"a mask function must return a boolean, but {_fn_name(fn)}{_defined_at(fn)}"
                         " returns a float")
    expr, captures = canonicalize(ir.cast(expr, ir.BOOL), captures)
    return MaskMod(expr, captures, name or _fn_name(fn))


@_handed_over("call")
def score_mod(fn: Callable | None = None, *, name: str | None = None):
    """Trace ``fn(score, b, h, q_idx, kv_idx) -> float`` into a ``ScoreMod``."""
    if fn is None:
        return lambda f: score_mod(f, name=name)
    return _SCORE_TRACES.lookup(fn, name)


def _trace_score(fn, name):
    _check_arity(fn, 5, "a score function takes (score, b, h, q_idx, kv_idx)")
    expr, captures = trace(fn, SCORE_VARS)
    if expr.dtype == ir.BOOL:
        raise TraceError(f"a score function must return a number, but {_fn_name(fn)}{_defined_at(fn)}"
                         " returns a boolean")
    expr, captures = canonicalize(ir.cast(expr, ir.FLOAT), captures)
    return ScoreMod(expr, captures, name or _fn_name(fn))


# Plain functions traced once per fingerprint (mods/trace_cache.py): a torch-style
# lambda passed on every call costs a fingerprint, not a trace.
_MASK_TRACES = TraceCache(MaskMod, _trace_mask)
_SCORE_TRACES = TraceCache(ScoreMod, _trace_score)


def as_mask(x, what: str = "mask") -> MaskMod:
    """A ``MaskMod`` from a mod, a FlexAttention-style function, or ``True``/``False``."""
    if isinstance(x, MaskMod):
        return x
    if isinstance(x, bool):
        return MaskMod(ir.const(x), (), "full" if x else "empty")
    if isinstance(x, Mod):
        raise TypeError(f"{what}: expected a mask mod, got a {type(x).__name__}")
    if callable(x):
        return mask_mod(x)
    raise TypeError(f"{what}: expected a mask mod or a function (b, h, q_idx, kv_idx) -> bool, got {type(x).__name__}")


def as_score(x, what: str = "score") -> ScoreMod:
    """A ``ScoreMod`` from a mod or a FlexAttention-style ``score_mod`` function."""
    if isinstance(x, ScoreMod):
        return x
    if isinstance(x, Mod):
        raise TypeError(f"{what}: expected a score mod, got a {type(x).__name__}")
    if callable(x):
        return score_mod(x)
    raise TypeError(f"{what}: expected a score mod or a function (score, b, h, q_idx, kv_idx) -> float, got {type(x).__name__}")


def _fn_name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _defined_at(fn) -> str:
    """" (defined at file:line)" for a Python function, else "" (errors about what a traced
    function returned are raised after its frames are gone)."""
    code = getattr(fn, "__code__", None)
    return f" (defined at {code.co_filename}:{code.co_firstlineno})" if code is not None else ""


def _check_arity(fn, n, message):
    import inspect

    if not callable(fn):
        raise TypeError(f"{message}; got {type(fn).__name__}")
    try:
        inspect.signature(fn).bind(*range(n))
    except TypeError:
        raise TypeError(f"{message}; {_fn_name(fn)} has signature {inspect.signature(fn)}") from None
    except ValueError:  # builtins without a signature: let the call decide
        pass
