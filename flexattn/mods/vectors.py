"""Vector reads in mods: a captured tensor indexed along its leading dims only.

torch users write score mods that read a row of a captured tensor and reduce it, e.g. a
rotary or learned bias ``score + torch.dot(q_emb[b, h, q_idx], k_emb[b, h, kv_idx])`` or
``(a * b).sum()``. The IR computes one element at a time, so such a read is *unrolled*:
``q_emb[b, h, q_idx]`` (a ``CapturedArray`` with the trailing dims left) becomes, wherever
it is used in arithmetic, a ``SymArray`` — a numpy object array holding one traced load per
trailing index — and every operation on it applies element by element (numpy broadcasting
rules); ``sum`` / ``dot`` / ``@`` / ``inner`` / ``mean`` reduce it back to one traced value,
as do ``max`` / ``min`` / ``amax`` / ``amin`` / ``prod`` / ``logsumexp`` / ``norm`` / ``var`` /
``std`` (torch's ``dim`` / ``keepdim`` and numpy's ``axis`` / ``keepdims``, numpy's defaults
where they differ: ``trace.NUMPY_NAMES``).
The kernels then see plain loads, products and adds (their derivatives too, so captured
tensors read this way get gradients), computed once per row where they depend only on the
query (the emitters' row factoring).

Unrolling costs a load per element per trailing index: vectors are capped at
``MAX_VECTOR_ELEMENTS``.
"""

from __future__ import annotations

import operator

import numpy as np

from . import trace as _t

MAX_VECTOR_ELEMENTS = 256


class SymArray:
    """A small array of traced values (numpy object array of ``Sym`` or numbers)."""

    __slots__ = ("values",)
    __array_priority__ = 1001   # above Sym's: numpy defers to us

    def __init__(self, values):
        self.values = np.asarray(values, dtype=object)
        if self.values.size > MAX_VECTOR_ELEMENTS:
            raise _t.TraceError(f"a vector read of {self.values.size} elements in a mod (the kernels unroll it;"
                                f" at most {MAX_VECTOR_ELEMENTS})")

    shape = property(lambda self: self.values.shape)
    ndim = property(lambda self: self.values.ndim)

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, index):
        picked = self.values[index]
        return SymArray(picked) if isinstance(picked, np.ndarray) else picked

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __getattr__(self, name):   # tensor methods: x.float(), x.exp(), x.sum(-1), ...
        op = _t.OPERATIONS.get(name)
        if op is None:
            raise AttributeError(name)
        return lambda *args, **kwargs: _t._call(op, name, (self, *args), kwargs)

    def __repr__(self):
        return f"SymArray(shape={self.shape})"

    __torch_function__ = classmethod(lambda cls, func, types_, args=(), kwargs=None:
                                     _t.Sym.__torch_function__.__func__(cls, func, types_, args, kwargs))

    def __array_function__(self, func, types_, args, kwargs):
        return _t.Sym.__array_function__(self, func, types_, args, kwargs)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return _t.Sym.__array_ufunc__(self, ufunc, method, *inputs, **kwargs)


def is_vector(x) -> bool:
    """A ``SymArray``, or a captured array indexed along its leading dims only."""
    return isinstance(x, SymArray) or (isinstance(x, _t.CapturedArray) and x.shape != ())


def as_values(x):
    """The object array of a vector operand; scalars (Sym, numbers) as they are."""
    if isinstance(x, SymArray):
        return x.values
    if isinstance(x, _t.CapturedArray) and x.shape != ():
        return unrolled(x).values
    return x


def unrolled(captured) -> SymArray:
    """A partially indexed captured array as one traced load per trailing index."""
    shape = captured.shape
    if int(np.prod(shape)) > MAX_VECTOR_ELEMENTS:
        raise _t.TraceError(f"a vector read of shape {shape} in a mod (the kernels unroll it; at most"
                            f" {MAX_VECTOR_ELEMENTS} elements)")
    values = np.empty(shape, dtype=object)
    for index in np.ndindex(*shape):
        values[index] = captured[index]
    return SymArray(values)


def elementwise(apply, args):
    """``apply`` (a scalar op on proxies) over broadcast vector operands."""
    arrays = [as_values(a) for a in args]
    # (a proxy is a scalar: np.shape on it would ask the proxy's __array_function__)
    shape = np.broadcast_shapes(*(a.shape if isinstance(a, np.ndarray) else () for a in arrays))
    out = np.empty(shape, dtype=object)
    views = [np.broadcast_to(np.asarray(a, dtype=object), shape) for a in arrays]
    for index in np.ndindex(*shape):
        out[index] = apply(*(v[index] for v in views))
    return SymArray(out)


def _tree(items, combine):
    """``combine`` over ``items`` as a balanced tree (shallower IR than a chain)."""
    items = list(items)
    while len(items) > 1:
        items = [combine(items[i], items[i + 1]) if i + 1 < len(items) else items[i] for i in range(0, len(items), 2)]
    return items[0]


def _sum(items):
    return _tree(items, operator.add) if len(items) else 0


def _total(values):
    """Sum of an object array."""
    return _sum(list(np.ravel(values)))


def _reduce(x, dim, keepdim, reduce_items, empty=None):
    """``reduce_items(list of elements) -> one value`` over every element of a vector
    operand, or along ``dim`` (an int or a tuple), torch's ``keepdim``; scalars are their
    own reduction."""
    values = as_values(x)
    if not isinstance(values, np.ndarray):
        return x
    if values.size == 0:
        if empty is None:
            raise _t.TraceError("a reduction over an empty vector read in a mod has no value")
        return empty
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == values.ndim):
        out = np.empty((), dtype=object)
        out[()] = reduce_items(list(np.ravel(values)))
        if keepdim:
            out = out.reshape((1,) * values.ndim)
        return SymArray(out) if out.ndim else out[()]
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    dims = tuple(sorted(d % values.ndim for d in dims))
    moved = np.moveaxis(values, dims, tuple(range(values.ndim - len(dims), values.ndim)))
    out = np.empty(moved.shape[:values.ndim - len(dims)], dtype=object)
    for index in np.ndindex(*out.shape):
        out[index] = reduce_items(list(np.ravel(moved[index])))
    if keepdim:
        for d in dims:
            out = np.expand_dims(out, d)
    return SymArray(out) if out.ndim else out[()]


def _axes(name, dim, keepdim, kwargs):
    """(dim, keepdim) of a reduction from torch's and numpy's spellings (``dim`` / ``axis``,
    ``keepdim`` / ``keepdims``); ``dtype`` and ``out=None`` change nothing in a mod; any other
    option (numpy's ``where=``, ``initial=``) is a clear error, never silently dropped."""
    if "axis" in kwargs:
        axis = kwargs.pop("axis")
        if dim is not None and axis is not None:
            raise _t.TraceError(f"{name}: pass dim or axis, not both")
        dim = axis if axis is not None else dim
    if "keepdims" in kwargs:
        keepdim = kwargs.pop("keepdims")
    kwargs.pop("dtype", None)
    if kwargs.pop("out", None) is not None:
        raise _t.TraceError(f"{name}(..., out=) in a mod: a mod computes values, it writes no arrays")
    unknown = [k for k, v in kwargs.items() if v is not None]
    if unknown:
        raise _t.TraceError(f"{name}(..., {', '.join(k + '=' for k in unknown)}) is not supported in a mod")
    return dim, bool(keepdim)


def _reduction(name, reduce_items, empty=None):
    """torch's ``f(x, dim=None, keepdim=False)`` / numpy's ``f(x, axis=None, keepdims=False)``
    over a vector operand, ``reduce_items`` reducing each run of elements."""
    def f(x, dim=None, keepdim=False, *rest, **kwargs):
        if rest:
            raise _t.TraceError(f"{name}: too many positional arguments in a mod")
        dim, keepdim = _axes(name, dim, keepdim, kwargs)
        return _reduce(x, dim, keepdim, reduce_items, empty)
    f.__name__ = name
    return f


vector_sum = _reduction("sum", _sum, empty=0)


def vector_mean(x, dim=None, keepdim=False, **kwargs):
    dim, keepdim = _axes("mean", dim, keepdim, kwargs)
    values = as_values(x)
    if not isinstance(values, np.ndarray):
        return x
    count = values.size if dim is None else int(np.prod([values.shape[d] for d in np.atleast_1d(dim)]))
    return vector_sum(x, dim, keepdim) / count


def _op(name):
    return _t.OPERATIONS[name]


# torch.amax / np.max: the largest element (NaN if any is, as torch's)
vector_amax = _reduction("amax", lambda items: _tree(items, _op("maximum")))
vector_amin = _reduction("amin", lambda items: _tree(items, _op("minimum")))
vector_prod = _reduction("prod", lambda items: _tree(items, operator.mul), empty=1)


def _logsumexp_items(items):
    """log(sum(exp(items))) shifted by their max (finite for large scores; -inf when every
    item is -inf, as torch's)."""
    m = _tree(items, _op("maximum"))
    shift = _t._where(_op("isinf")(m), 0.0, m)
    return shift + _op("log")(_sum([_op("exp")(i - shift) for i in items]))


# torch.logsumexp (``dim`` required by torch; every element when omitted)
vector_logsumexp = _reduction("logsumexp", _logsumexp_items)


def vector_norm(x, p=2, dim=None, keepdim=False, **kwargs):
    """torch.norm / x.norm / torch.linalg.vector_norm (``ord``) / numpy's linalg.norm of a
    vector (``ord``, ``axis``): the p-norm of the elements (2, "fro" and None: the square
    root of the sum of squares; 1; inf / -inf: the largest / smallest magnitude; 0: the
    count of non-zeros; any other p: (sum |x|^p)^(1/p))."""
    if "ord" in kwargs:
        p = kwargs.pop("ord")
    dim, keepdim = _axes("norm", dim, keepdim, kwargs)
    p = 2 if p is None or p == "fro" else p
    if isinstance(p, str):
        raise _t.TraceError(f"norm with p={p!r} in a mod: vector reads take numeric p (2, 1, inf, ...)")
    absolute = _op("abs")

    def norm(items):
        if p == 2:
            return _op("sqrt")(_sum([i * i for i in items]))
        if p == 1:
            return _sum([absolute(i) for i in items])
        if p == float("inf"):
            return _tree([absolute(i) for i in items], _op("maximum"))
        if p == -float("inf"):
            return _tree([absolute(i) for i in items], _op("minimum"))
        if p == 0:
            return _sum([(i != 0).float() if isinstance(i, _t.Sym) else float(i != 0) for i in items])
        power = _op("pow")
        return power(_sum([power(absolute(i), p) for i in items]), 1.0 / p)

    return _reduce(x, dim, keepdim, norm, empty=0.0)


def vector_linalg_norm(x, ord=None, dim=None, keepdim=False, **kwargs):
    """torch.linalg.vector_norm(x, ord=2, dim, keepdim): ``ord`` second."""
    return vector_norm(x, 2 if ord is None else ord, dim, keepdim, **kwargs)


def _variance(correction):
    def var(items):
        mean = _sum(items) / len(items)
        squares = _sum([(i - mean) * (i - mean) for i in items])
        return squares / (len(items) - correction) if len(items) > correction else squares * float("nan")
    return var


def vector_var(x, dim=None, *args, correction=None, unbiased=None, keepdim=False, ddof=None, **kwargs):
    """torch.var / x.var (``correction``, default 1; the older ``unbiased`` flag; positional
    ``torch.var(x, dim, unbiased, keepdim)``) and numpy's ``ddof`` (numpy's own default, 0,
    is ``numpy_var``'s)."""
    if args:
        if isinstance(args[0], bool) and dim is not None and not isinstance(dim, bool):
            unbiased, args = args[0], args[1:]
        if args:
            keepdim = args[0]
    if isinstance(dim, bool):
        dim, unbiased = None, dim
    dim, keepdim = _axes("var", dim, keepdim, kwargs)
    if ddof is not None:
        correction = ddof
    if correction is None:
        correction = 1 if unbiased is None or unbiased else 0
    return _reduce(x, dim, keepdim, _variance(correction))


def vector_std(x, dim=None, *args, **kwargs):
    return _op("sqrt")(vector_var(x, dim, *args, **kwargs))


def numpy_var(x, axis=None, dtype=None, out=None, ddof=0, keepdims=False, **kwargs):
    """numpy's / jax.numpy's var: ``ddof`` 0 by default (torch's correction is 1)."""
    return vector_var(x, axis, ddof=ddof, keepdim=keepdims, dtype=dtype, out=out, **kwargs)


def numpy_std(x, axis=None, dtype=None, out=None, ddof=0, keepdims=False, **kwargs):
    return _op("sqrt")(numpy_var(x, axis, dtype, out, ddof, keepdims, **kwargs))


def dot(a, b, **_):
    """torch.dot / inner / vdot, ``a @ b`` and matmul of 1-D vectors: the unrolled sum of
    products."""
    va, vb = as_values(a), as_values(b)
    if np.ndim(va) != 1 or np.ndim(vb) != 1:
        raise _t.TraceError("dot / @ in a mod takes two 1-D vector reads (e.g. q_emb[b, h, q_idx] @ k_emb[b, h, kv_idx])")
    if len(va) != len(vb):
        raise _t.TraceError(f"dot of vectors of lengths {len(va)} and {len(vb)}")
    return _total(va * vb)
