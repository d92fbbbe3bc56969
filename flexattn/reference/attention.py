"""numpy reference for attention with mods: slow, exact, the oracle for every kernel.

Semantics (FlexAttention's): ``s = scale · q·kᵀ``; ``s' = score_mod(s, b, h, q, kv)``;
masked pairs get ``-inf``; ``out = softmax(s') · v``; ``lse = logsumexp(s')`` (natural
log). A query that attends to nothing has ``out = 0`` and ``lse = -inf`` — never NaN.
GQA: query head ``h`` reads key/value head ``h // (Hq / Hkv)``.

The backward recomputes the forward in the working precision and returns dq, dk, dv and
the gradients of captured float buffers of the score mod (``d_captures``), using the
symbolic derivative of the mod. Work is done one (batch, head) at a time to bound memory.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..arrays import to_numpy
from ..blockmask import FULL, PARTIAL
from ..problem.spec import AttentionSpec
from ..problem.validate import AttentionShape, check_inputs
from ..mods.derivative import differentiate
from ..mods.evaluate import evaluate


class Gradients(NamedTuple):
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    d_captures: tuple  # one per score-mod capture: an array for float buffers, else None


def forward(q, k, v, spec: AttentionSpec | None = None, dtype=np.float64, max_scores: bool = False):
    """(out [B, Hq, Q, Dv], lse [B, Hq, Q]) in ``dtype``; with ``max_scores``, also each
    row's max of the scaled, modded, masked scores [B, Hq, Q] (-inf for empty rows), as
    torch's ``AuxRequest(max_scores=True)``."""
    spec = spec or AttentionSpec()
    shape = check_inputs(q, k, v, spec)
    q, k, v = (_host(x, dtype) for x in (q, k, v))
    out = np.zeros((shape.batch, shape.q_heads, shape.q_len, shape.v_head_dim), dtype)
    lse = np.zeros((shape.batch, shape.q_heads, shape.q_len), dtype)
    row_max = np.zeros_like(lse)
    problem = _Problem(spec, shape, dtype)
    for b in range(shape.batch):
        for h in range(shape.q_heads):
            hk = h // shape.group
            p, row_lse, _, _, row_max[b, h] = problem.probabilities(b, h, q[b, h], k[b, hk])
            out[b, h] = p @ v[b, hk]
            lse[b, h] = row_lse
    return (out, lse, row_max) if max_scores else (out, lse)


def backward(q, k, v, d_out, d_lse=None, spec: AttentionSpec | None = None, dtype=np.float64,
             out=None, lse=None) -> Gradients:
    """Gradients of ``sum(out·d_out) + sum(lse·d_lse)`` w.r.t. q, k, v and score-mod buffers.

    ``out``: the forward output as a FlashAttention-style backward sees it (stored in
    bf16/fp16). If given, ``delta = rowsum(d_out·out)`` uses it instead of the exact
    output, which reproduces that backward's one inherent rounding: buffer gradients
    are sums with heavy cancellation, so the bf16 rounding of ``out`` alone moves them
    by ~2% (ALiBi slopes) while dq/dk/dv barely change.

    ``lse`` (with ``out``): the row statistics of a longer attention this call is one key
    shard of (context parallelism): probabilities are ``exp(s' - lse)`` instead of this
    call's own softmax, so the gradients are this shard's part of the whole's."""
    spec = spec or AttentionSpec()
    if lse is not None and out is None:
        raise ValueError("backward(lse=...) needs the whole attention's out as well")
    shape = check_inputs(q, k, v, spec)
    q, k, v = (_host(x, dtype) for x in (q, k, v))
    d_out = _host(d_out, dtype)
    d_lse = None if d_lse is None else _host(d_lse, dtype)
    out = None if out is None else _host(out, dtype)
    lse = None if lse is None else _host(lse, dtype)
    if d_out.shape != (shape.batch, shape.q_heads, shape.q_len, shape.v_head_dim):
        raise ValueError(f"d_out has shape {d_out.shape}, expected the output's {tuple(q.shape[:3]) + (shape.v_head_dim,)}")
    problem = _Problem(spec, shape, dtype)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    d_caps = problem.new_capture_grads()
    scale = problem.scale
    for b in range(shape.batch):
        for h in range(shape.q_heads):
            hk = h // shape.group
            p, _, raw, env, _ = problem.probabilities(b, h, q[b, h], k[b, hk], None if lse is None else lse[b, h])
            o = p @ v[b, hk] if out is None else out[b, h]
            dv[b, hk] += p.T @ d_out[b, h]
            dp = d_out[b, h] @ v[b, hk].T
            delta = np.sum(d_out[b, h] * o, axis=-1, keepdims=True)
            ds_mod = p * (dp - delta)  # gradient w.r.t. the modified score s'
            if d_lse is not None:
                ds_mod += p * d_lse[b, h][:, None]  # ∂lse/∂s' = softmax
            live = p > 0
            ds = problem.through_score_mod(ds_mod, raw, env, live, d_caps)
            dq[b, h] = scale * (ds @ k[b, hk])
            dk[b, hk] += scale * (ds.T @ q[b, h])
    return Gradients(dq, dk, dv, d_caps)


def _host(x, dtype):
    return np.asarray(to_numpy(x), dtype=dtype)


class _Problem:
    """Per-call state: mods' numpy inputs, the derivative, the element mask per head."""

    def __init__(self, spec: AttentionSpec, shape: AttentionShape, dtype):
        self.spec, self.shape, self.dtype = spec, shape, dtype
        self.scale = spec.resolved_scale(shape.head_dim)
        self.q_idx = np.arange(shape.q_len)[:, None]
        self.kv_idx = np.arange(shape.kv_len)[None, :]
        self.score_values = [to_numpy(c) for c in spec.score.captures] if spec.score is not None else []
        bm = spec.block_mask
        mask = bm.mask_mod if bm is not None else spec.mask
        self.mask = mask
        self.mask_values = [to_numpy(c) for c in mask.captures] if mask is not None else []
        self.tile_states = bm.block_states() if bm is not None else None  # one copy, not one per head
        self._derivative = None

    def allowed(self, b, h) -> np.ndarray | None:
        """[Q, KV] bool of attended pairs, or None when everything is attended."""
        env = {"b": b, "h": h, "q": self.q_idx, "kv": self.kv_idx}
        bm = self.spec.block_mask
        if bm is None:
            if self.mask is None:
                return None
            return np.broadcast_to(evaluate(self.mask.expr, env, self.mask_values), (self.shape.q_len, self.shape.kv_len))
        states = self.tile_states
        tile = states[b if states.shape[0] > 1 else 0, h if states.shape[1] > 1 else 0]
        qb, kvb = bm.BLOCK_SIZE
        tile = tile[np.arange(self.shape.q_len) // qb][:, np.arange(self.shape.kv_len) // kvb]
        inner = evaluate(bm.mask_mod.expr, env, self.mask_values)
        return (tile == FULL) | ((tile == PARTIAL) & inner)

    def probabilities(self, b, h, qh, kh, given_lse=None):
        """Softmax probabilities [Q, KV], row lse, raw scores, the index env and the row max
        of the scaled, modded, masked scores (the forward's max_scores). ``given_lse``:
        probabilities against these row statistics instead of this call's own."""
        raw = (qh @ kh.T) * self.scale
        env = {"b": b, "h": h, "q": self.q_idx, "kv": self.kv_idx}
        s = raw
        if self.spec.score is not None:
            env_s = dict(env, score=raw)
            s = np.broadcast_to(evaluate(self.spec.score.expr, env_s, self.score_values, self.dtype), raw.shape)
        allowed = self.allowed(b, h)
        if allowed is not None:
            s = np.where(allowed, s, -np.inf)
        with np.errstate(invalid="ignore", over="ignore"):
            m = np.max(s, axis=-1, keepdims=True)
            m_safe = np.where(np.isfinite(m), m, 0.0)
            e = np.exp(s - m_safe)
            total = e.sum(axis=-1, keepdims=True)
            p = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
            lse = np.where(total[:, 0] > 0, m_safe[:, 0] + np.log(np.where(total[:, 0] > 0, total[:, 0], 1.0)), -np.inf)
            if given_lse is not None:
                live = np.isfinite(s) & np.isfinite(given_lse)[:, None]
                p = np.where(live, np.exp(np.where(live, s - given_lse[:, None], 0.0)), 0.0)
        return p.astype(self.dtype, copy=False), lse, raw, env, m[:, 0]

    # -- backward through the score mod ---------------------------------------------------------
    def new_capture_grads(self):
        grads = []
        for value in self.score_values:  # Python numbers are constants to autograd: no grad
            is_float_array = isinstance(value, np.ndarray) and value.dtype.kind == "f"
            grads.append(np.zeros(value.shape, self.dtype) if is_float_array else None)
        return tuple(grads)

    def through_score_mod(self, ds_mod, raw, env, live, d_caps):
        """dS from dS' (chain rule through the mod); scatter buffer grads into ``d_caps``."""
        score = self.spec.score
        if score is None:
            return np.where(live, ds_mod, 0.0)
        if self._derivative is None:
            self._derivative = differentiate(score.expr)
        env_s = dict(env, score=raw)
        with np.errstate(all="ignore"):
            d_score = evaluate(self._derivative.d_score, env_s, self.score_values, self.dtype)
            ds = np.where(live, ds_mod * d_score, 0.0)
            for load, partial in self._derivative.d_loads:
                grad = d_caps[load.attr.slot]
                if grad is None:
                    continue
                contrib = np.where(live, ds_mod * evaluate(partial, env_s, self.score_values, self.dtype), 0.0)
                if not load.args:  # 0-d buffer: one value read everywhere
                    grad[()] += contrib.sum()
                    continue
                index = tuple(np.broadcast_to(evaluate(i, env_s, self.score_values), contrib.shape) for i in load.args)
                np.add.at(grad, index, contrib)
        return ds
