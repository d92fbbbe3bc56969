"""Independent, obviously-correct attention for tests: dense scores, eager mods.

Written with torch so its gradients come from torch autograd, not from our derivative code.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def index_grids(B, H, Q, KV):
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q = torch.arange(Q).view(1, 1, Q, 1)
    kv = torch.arange(KV).view(1, 1, 1, KV)
    return b, h, q, kv


def attention(q, k, v, score_fn=None, mask_fn=None, scale=None, dense_mask=None):
    """(out, lse). ``score_fn``/``mask_fn`` are FlexAttention-style functions applied to
    whole index grids; ``dense_mask`` [B|1, H|1, Q, KV] bool is and-ed in."""
    B, H, Q, D = q.shape
    KV = k.shape[2]
    group = H // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    b, h, qi, ki = index_grids(B, H, Q, KV)
    if score_fn is not None:
        s = score_fn(s, b, h, qi, ki)
    allowed = torch.ones(B, H, Q, KV, dtype=torch.bool)
    if mask_fn is not None:
        allowed = allowed & mask_fn(b, h, qi, ki)
    if dense_mask is not None:
        allowed = allowed & torch.as_tensor(dense_mask, dtype=torch.bool)
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    finite = torch.isfinite(lse)
    p = torch.where(allowed & finite[..., None], torch.exp(s - torch.where(finite, lse, 0.0)[..., None]), 0.0)
    return p @ v, lse


def numpy_attention(q, k, v, allowed=None, scale=None):
    """Plain numpy softmax attention (float64) with an explicit [B|1,H|1,Q,KV] bool mask."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    z = e.sum(-1, keepdims=True)
    p = np.where(z > 0, e / np.where(z > 0, z, 1), 0.0)
    return p @ v
