"""Decoding as attention: short queries at the end of each sequence against a KV cache.

``decode_problem`` turns (queries, cache, mods) into an ordinary attention problem: the
cache's logical K/V, and mods rewritten to true positions — query row ``i`` of sequence
``b`` sits at ``lengths[b] - q_len + i``; keys at or beyond ``lengths[b]`` are masked.
Offsets and lengths are runtime buffers of the rewritten mods, so each decoder step reuses
the compiled kernel.
"""

from __future__ import annotations

import numpy as np

from ..mods import as_mask, as_score, full
from ..mods.positions import limit_keys, shift_queries
from .spec import AttentionSpec


def decode_problem(q, cache, score_mod=None, mask=None, scale=None):
    """(k, v, spec) for ``q`` [B, Hq, q_len, D] attending ``cache`` (KVCache / PagedKVCache)."""
    if not hasattr(cache, "logical_kv") or not hasattr(cache, "host_lengths"):
        raise TypeError(f"cache must be a KVCache or PagedKVCache, got {type(cache).__name__}")
    if len(q.shape) != 4:
        raise ValueError(f"query must be 4-D [B, H, q_len, D], got shape {tuple(q.shape)}")
    lengths = cache.host_lengths()
    q_len = int(q.shape[2])
    if lengths.shape[0] != q.shape[0]:
        raise ValueError(f"query batch {q.shape[0]} does not match the cache's {lengths.shape[0]}")
    if np.any(lengths < q_len):
        raise ValueError(
            f"every sequence must already hold its {q_len} query tokens (append them first); lengths {lengths.tolist()}"
        )
    q_offset = (lengths - q_len).astype(np.int32)
    valid = lengths.astype(np.int32)
    q_offset.flags.writeable = valid.flags.writeable = False  # ours alone: device copies may be cached
    k, v = cache.logical_kv()
    return k, v, decode_spec(score_mod, mask, q_offset, valid, scale)


def decode_spec(score_mod, mask, q_offset, lengths, scale=None) -> AttentionSpec:
    """The attention problem of a decode step: the mods at true positions (query row i of
    sequence b at ``q_offset[b] + i``) and the keys limited to each sequence's ``lengths[b]``,
    both [B] arrays captured by the mods (runtime values: new steps never recompile)."""
    base = as_mask(mask, "mask") if mask is not None else full()
    return AttentionSpec.from_args(
        score=shift_queries(as_score(score_mod, "score_mod"), q_offset) if score_mod is not None else None,
        mask=limit_keys(shift_queries(base, q_offset), lengths),
        scale=scale,
        enable_gqa=True,
    )
