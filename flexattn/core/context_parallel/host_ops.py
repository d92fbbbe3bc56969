"""The schedules' array operations on host (numpy) arrays, attention by the exact reference:
the framework-free CPU path, and the oracle the adapters' operations are tested against."""

from __future__ import annotations

import contextlib

import numpy as np

from ... import reference


class HostOps:
    """``ops`` for ``schedule`` over numpy [B, H, S, D] arrays (float64 work)."""

    @staticmethod
    def writes_into(result) -> bool:
        """Launches write into views of ``result`` only where that changes no number: the
        reference computes in float64."""
        return np.asarray(result).dtype == np.float64

    def attention(self, q, k, v, spec, into=None):
        return written_into(into, reference.forward(q, k, v, spec))

    def outputs(self, q, v):
        b, h, s = np.shape(q)[:3]
        return np.empty((b, h, s, np.shape(v)[-1]), np.result_type(q, np.float32)), np.empty((b, h, s))

    def attention_backward(self, q, k, v, out, lse, d_out, d_lse, spec, into=None):
        grads = reference.backward(q, k, v, d_out, d_lse, spec, out=out, lse=lse)
        captures = spec.score.captures if spec.score is not None else ()
        by_id = {id(c): g for c, g in zip(captures, grads.d_captures) if g is not None}
        return (*written_into(into, (grads.dq, grads.dk, grads.dv)), by_id)

    def rows(self, x, start, stop):
        return x[:, :, start:stop]

    def cat(self, parts):
        return np.concatenate(parts, axis=2)

    def contiguous(self, x):
        return np.ascontiguousarray(x)

    def aside(self, like):
        """A context whose copies run beside the launches (on the host: in line)."""
        return contextlib.nullcontext()

    def stats(self, q, v):
        b, h, s = q.shape[:3]
        return np.zeros((b, h, s, v.shape[-1])), np.full((b, h, s), -np.inf)

    def merge(self, acc, lse, start, stop, out_j, lse_j):
        merge_rows(acc[:, :, start:stop], lse[:, :, start:stop], out_j, lse_j)
        return acc, lse

    def assign(self, acc, lse, start, stop, out_j, lse_j):
        acc[:, :, start:stop] = out_j
        lse[:, :, start:stop] = lse_j
        return acc, lse

    def merge_into(self, out, lse, start, stop, out_j, lse_j):
        """Rows start:stop of the result (``out`` in its dtype, ``lse``) ← their merge with
        the partial (``out_j``, ``lse_j``), computed in float64, rounded once."""
        acc = out[:, :, start:stop].astype(np.float64)
        merge_rows(acc, lse[:, :, start:stop], out_j, lse_j)
        out[:, :, start:stop] = acc

    def zeros(self, x):
        return np.zeros(np.shape(x))

    def work_empty(self, x):
        """A work-dtype array shaped like ``x`` whose contents the caller writes before it
        reads them: NaN here, so a read of an unwritten element shows in every result."""
        return np.full(np.shape(x), np.nan)

    def add_rows(self, acc, start, stop, x):
        acc[:, :, start:stop] += x
        return acc

    def add(self, a, b):
        return a + b

    def empty(self, x):
        return np.empty(np.shape(x), np.asarray(x).dtype)

    def assign_rows(self, out, start, stop, x):
        out[:, :, start:stop] = x

    def add_rows_into(self, out, start, stop, acc, x):
        """Rows start:stop of ``out`` ← ``acc`` + ``x`` (work-dtype sums plus a last
        contribution), in ``out``'s dtype."""
        out[:, :, start:stop] = acc + x

    def zero_rows(self, out, start, stop):
        out[:, :, start:stop] = 0

    def cast(self, x, like):
        return x.astype(np.asarray(like).dtype, copy=False)


def written_into(into, results) -> tuple:
    """Each result copied into its view of ``into`` (None, or a view or None per result;
    numpy or torch) and returned as that view; the others as they are."""
    if into is None:
        return tuple(results)
    out = []
    for view, x in zip(into, results):
        if view is not None:
            view[...] = x
            x = view
        out.append(x)
    return tuple(out)


def merge_rows(acc, lse, out_j, lse_j) -> None:
    """``acc``/``lse`` (views, updated in place) ← the softmax-weighted merge of the two
    partial attentions: lse = logaddexp(lse, lse_j), acc = acc·e^(lse₀−lse) + out_j·e^(lse_j−lse).
    Rows empty on both sides stay 0 / −inf."""
    new = np.logaddexp(lse, lse_j)
    live = np.isfinite(new)
    safe = np.where(live, new, 0.0)
    w0 = np.where(live, np.exp(np.where(np.isfinite(lse), lse, -np.inf) - safe), 0.0)
    w1 = np.where(live, np.exp(np.where(np.isfinite(lse_j), lse_j, -np.inf) - safe), 0.0)
    acc *= w0[..., None]
    acc += w1[..., None] * out_j
    lse[...] = new
