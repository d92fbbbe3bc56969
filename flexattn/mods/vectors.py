"""Vector reads in mods: a captured tensor indexed along its leading dims only.

torch users write score mods that read a row of a captured tensor and reduce it, e.g. a
rotary or learned bias ``score + torch.dot(q_emb[b, h, q_idx], k_emb[b, h, kv_idx])`` or
``(a * b).sum()``. The IR computes one element at a time, so such a read is *unrolled*:
``q_emb[b, h, q_idx]`` (a ``CapturedArray`` with the trailing dims left) becomes, wherever
it is used in arithmetic, a ``SymArray`` — a numpy object array holding one traced load per
trailing index — and every operation on it applies element by element (numpy broadcasting
rules); ``sum`` / ``dot`` / ``@`` / ``inner`` / ``mean`` reduce it back to one traced value.
The kernels then see plain loads, products and adds (their derivatives too, so captured
tensors read this way get gradients), computed once per row where they depend only on the
query (the emitters' row factoring).

Unrolling costs a load per element per trailing index: vectors are capped at
``MAX_VECTOR_ELEMENTS``.
"""

from __future__ import annotations

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


def _total(values):
    """Sum of an object array as a balanced tree of adds (shallower IR than a chain)."""
    items = list(np.ravel(values))
    if not items:
        return 0
    while len(items) > 1:
        items = [items[i] + items[i + 1] if i + 1 < len(items) else items[i] for i in range(0, len(items), 2)]
    return items[0]


def vector_sum(x, dim=None, keepdim=False, dtype=None, **_):
    """torch.sum / x.sum / np.sum: over every element, or one dim."""
    values = as_values(x)
    if not isinstance(values, np.ndarray):
        return x
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == values.ndim):
        return _total(values)
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    dims = tuple(sorted(d % values.ndim for d in dims))
    moved = np.moveaxis(values, dims, tuple(range(values.ndim - len(dims), values.ndim)))
    out = np.empty(moved.shape[:values.ndim - len(dims)], dtype=object)
    for index in np.ndindex(*out.shape):
        out[index] = _total(moved[index])
    if keepdim:
        for d in dims:
            out = np.expand_dims(out, d)
    return SymArray(out) if out.ndim else out[()]


def vector_mean(x, dim=None, keepdim=False, **_):
    values = as_values(x)
    if not isinstance(values, np.ndarray):
        return x
    count = values.size if dim is None else int(np.prod([values.shape[d] for d in np.atleast_1d(dim)]))
    return vector_sum(x, dim, keepdim) / count


def dot(a, b, **_):
    """torch.dot / inner / vdot, ``a @ b`` and matmul of 1-D vectors: the unrolled sum of
    products."""
    va, vb = as_values(a), as_values(b)
    if np.ndim(va) != 1 or np.ndim(vb) != 1:
        raise _t.TraceError("dot / @ in a mod takes two 1-D vector reads (e.g. q_emb[b, h, q_idx] @ k_emb[b, h, kv_idx])")
    if len(va) != len(vb):
        raise _t.TraceError(f"dot of vectors of lengths {len(va)} and {len(vb)}")
    return _total(va * vb)
