"""The bounds-checked debug mode: every captured-tensor read of a call's mods, checked
against the tensor's shape before anything runs.

A mod that indexes a captured tensor out of range (``bias[h, q_idx - kv_idx]`` with a
negative difference, a table one entry short, a document id past the table) reads
whatever memory lies there on the GPU — neither torch nor FlashAttention-4 says so. With
the debug mode on (``FLEXATTN_CHECK_BOUNDS=1`` in the environment, or
``flexattn.check_bounds()`` as a switch or a ``with`` block), ``check_inputs`` checks
each read of the score mod, the mask and the block mask's mask_mod over every (b, h, q,
kv) of the call: interval analysis first (``mods.intervals``: a proof settles it), else
the index computed for every position it depends on, in chunks. A read out of
``[0, n)`` raises an ``IndexError`` naming the mod, the source line of the read (recorded
while tracing, ``ir.Node.site``) and the first offending position, before any launch.

Negative indices count as out of range: the kernels do not wrap them as Python and torch
do (a constant negative index is resolved while tracing). The check reads the captured
values on the host (a device-to-host copy per tensor and call) and costs up to a few
seconds for large calls: a debugging aid, off by default. Indices that depend on the
score itself cannot be enumerated and are left unchecked.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

from ..arrays import to_numpy
from ..mods import ir
from ..mods.evaluate import evaluate
from ..mods.intervals import bounds

_ENABLED = [os.environ.get("FLEXATTN_CHECK_BOUNDS", "0") not in ("", "0")]
# Index values computed per chunk (int64): bounds the memory of one evaluation.
_CHUNK_ELEMENTS = 1 << 22


def enabled() -> bool:
    return _ENABLED[0]


class check_bounds(contextlib.ContextDecorator):
    """Turn the bounds-checked debug mode on (``check_bounds()`` / ``check_bounds(False)``
    as a switch), or on for a block: ``with flexattn.check_bounds(): ...``. Repeated
    calls skip their checks on the fast path (prepared launches); while the mode is on,
    every call takes the checked path."""

    def __init__(self, on: bool = True):
        self._previous = _ENABLED[0]
        _ENABLED[0] = bool(on)
        self._on = bool(on)

    def __enter__(self):
        _ENABLED[0] = self._on
        return self

    def __exit__(self, *exc):
        _ENABLED[0] = self._previous
        return False


def check_capture_reads(spec, shape) -> None:
    """Raise ``IndexError`` for the first captured-tensor read of ``spec``'s mods that leaves
    its tensor's shape somewhere in the call of ``shape`` (``validate.AttentionShape``)."""
    mods = [("score_mod", spec.score), ("mask", spec.mask)]
    if spec.block_mask is not None:
        mods.append(("block_mask.mask_mod", spec.block_mask.mask_mod))
    extents = {"b": shape.batch, "h": shape.q_heads, "q": shape.q_len, "kv": shape.kv_len}
    for role, mod in mods:
        if mod is not None and any(n.op == "load" for n in mod.expr.walk()):
            _check_mod(role, mod, extents)


def _check_mod(role: str, mod, extents: dict) -> None:
    values = [np.asarray(to_numpy(c)) if hasattr(c, "shape") else c for c in mod.captures]
    ranges = {v: (0, n - 1) for v, n in extents.items()}
    for node in mod.expr.walk():   # children first: an index's own reads are checked before it
        if node.op != "load":
            continue
        shape = np.shape(values[node.attr.slot])
        for dim, index in enumerate(node.args):
            n = int(shape[dim])
            if "score" in index.free_vars():
                continue
            found = bounds(index, ranges, values)
            if float(np.min(found.lo)) >= 0 and float(np.max(found.hi)) <= n - 1:
                continue   # proven in range
            bad = _first_out_of_range(index, n, extents, values)
            if bad is not None:
                raise IndexError(_message(role, mod, node, dim, n, *bad, shape))


def _first_out_of_range(index: ir.Node, n: int, extents: dict, values):
    """(value, position) of the first index out of [0, n) over the variables ``index``
    uses (b, h, q, kv order), or None: the last one whole, the positions of the others
    flattened and taken in chunks, so one evaluation stays bounded."""
    used = [v for v in ("b", "h", "q", "kv") if v in index.free_vars()]
    if not used:
        value = int(evaluate(index, {}, values))
        return None if 0 <= value < n else (value, {})
    *lead, last = used
    lead_sizes = [extents[v] for v in lead]
    rows = max(1, _CHUNK_ELEMENTS // extents[last])
    total = int(np.prod(lead_sizes, dtype=np.int64))
    for start in range(0, total, rows):
        flat = np.arange(start, min(total, start + rows), dtype=np.int64)
        env = {v: c[:, None] for v, c in zip(lead, np.unravel_index(flat, lead_sizes))} if lead else {}
        env[last] = np.arange(extents[last], dtype=np.int64)[None, :]
        got = np.broadcast_to(np.asarray(evaluate(index, env, values), dtype=np.int64), (len(flat), extents[last]))
        out = (got < 0) | (got >= n)
        if out.any():
            r, c = np.unravel_index(int(np.argmax(out)), out.shape)
            position = {v: int(env[v][r, 0]) for v in lead}
            position[last] = int(c)
            return int(got[r, c]), position
    return None


def _message(role: str, mod, node, dim: int, n: int, value: int, position: dict, shape) -> str:
    site = getattr(node, "site", None)
    where = f"{site[0]}:{site[1]} (in {site[2]})" if site else "a read"
    at = ", ".join(f"{v}={p}" for v, p in position.items()) or "every position"
    name = f" {mod.name!r}" if getattr(mod, "name", None) else ""
    return (f"{role}{name}: {where} reads a captured tensor of shape {tuple(int(s) for s in shape)} at index"
            f" {value} along dim {dim}, outside [0, {n}), at {at} (negative indices count: the kernels do"
            " not wrap them)")


__all__ = ["check_bounds", "check_capture_reads", "enabled"]
