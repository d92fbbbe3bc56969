"""Context parallelism under ``jax.shard_map``: one sequence sharded over a mesh axis, any
mod, differentiable (``jax.grad`` through the ring).

    from jax.sharding import PartitionSpec as P
    from flexattn.core.context_parallel import choose_layout
    from flexattn.jax import context_parallel as cp

    layout = choose_layout(S, world, mask)                       # mask over global positions
    q, k, v = (cp.shard(x, layout) for x in (q, k, v))            # global arrays, tokens in rank order

    @partial(jax.shard_map, mesh=mesh, in_specs=(P(None, None, "cp"),) * 3, out_specs=P(None, None, "cp"))
    def attend(q, k, v):                                          # this device's shards
        return cp.flex_attention(q, k, v, mask=mask, layout=layout, axis_name="cp")

    out = cp.unshard(attend(q, k, v), layout)                     # global order again

JAX programs are SPMD: every device runs the same program, so the pairs cannot differ by
rank as in ``flexattn.core.context_parallel``'s plans. Each ring step instead runs one call
of the local queries against the K/V in hand, with the mods reading every token's global
position from tables (``mods.positions.table_positions``; this device's row of the
layout's positions, picked by ``lax.axis_index``), merges by LSE, and passes K/V on with
``lax.ppermute``. JAX differentiates the whole ring (the transpose of a ppermute is the
reverse ppermute; each call's ``custom_vjp`` gets both cotangents), so gradients reach q,
k, v and the score mod's captured arrays; replicated captures are summed over the axis by
``shard_map`` itself.

CPU devices only for now: the GPU path needs a block mask for a mask whose captured
arrays (here the position tables) are traced, which ``flexattn.jax`` cannot build while
tracing yet. CUDA arrays get a clear error before anything runs.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from ..core.context_parallel import ShardLayout
from ..mods.positions import table_positions
from ..problem.spec import AttentionSpec
from . import _platform, flex_attention as _flex_attention


def shard(x, layout: ShardLayout, axis: int = 2):
    """A whole-sequence array with its tokens in rank order (rank 0's chunks, then rank 1's,
    ...): splitting it evenly along ``axis`` over the mesh axis gives each device its
    shard."""
    return jnp.take(x, jnp.asarray(layout.order()), axis=axis)


def unshard(x, layout: ShardLayout, axis: int = 2):
    """``shard``'s inverse: tokens back in global order."""
    return jnp.take(x, jnp.asarray(np.argsort(layout.order())), axis=axis)


def flex_attention(q, k, v, score_mod=None, scale=None, enable_gqa=False, return_lse=False, *, layout: ShardLayout,
                   axis_name, mask=None, score=None):
    """Inside ``shard_map`` over ``axis_name``: this device's shards ``[B, H, S / world, D]``
    (tokens as ``layout`` says) attend to the whole sequence; returns this device's rows of
    ``out`` (and ``lse``). Mods see global positions. No ``block_mask``: pass the mask as
    ``mask=`` (each step's block structure comes from it)."""
    if not isinstance(layout, ShardLayout):
        raise TypeError(f"layout must be a ShardLayout (core.context_parallel.choose_layout), got {type(layout).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, jax.Array):
            raise TypeError(f"{name} must be a jax array, got {type(x).__name__}")
        if x.ndim != 4 or x.shape[2] != layout.local_len:
            raise ValueError(f"{name} must be this device's shard [B, H, {layout.local_len}, D] of the"
                             f" {layout.seq_len}-token sequence, got shape {tuple(x.shape)}")
    world = layout.world
    size = jax.lax.axis_size(axis_name)
    if size != world:
        raise ValueError(f"the layout is for {world} devices, mesh axis {axis_name!r} has {size}")
    if _platform(q, k, v) != "cpu":
        raise NotImplementedError(
            "flexattn.jax.context_parallel runs on CPU devices for now: on CUDA each ring step needs the block"
            " mask of a mask over traced position tables, which flexattn.jax cannot build while tracing yet;"
            " use flexattn.torch.context_parallel on GPUs")
    spec = AttentionSpec.from_args(score_mod, None, scale, enable_gqa, mask, score)
    positions = jnp.asarray(np.stack([layout.positions(r) for r in range(world)]).astype(np.int32))
    rank = jax.lax.axis_index(axis_name)
    q_pos = positions[rank]
    reads_positions = spec.score is not None and {"q", "kv"} & spec.score.depends_on
    acc = lse = None
    work = jnp.promote_types(q.dtype, jnp.float32)     # merges in float32 (float64 for float64 inputs)
    kv = (k, v)
    ring = [(i, (i + 1) % world) for i in range(world)]
    for s in range(world):
        kv_pos = positions[(rank - s) % world]
        step_score = table_positions(spec.score, q_pos, kv_pos) if reads_positions else spec.score
        step_mask = None if spec.mask is None else table_positions(spec.mask, q_pos, kv_pos)
        out_s, lse_s = _flex_attention(q, *kv, score=step_score, mask=step_mask, scale=spec.scale,
                                       enable_gqa=spec.enable_gqa, return_lse=True)
        acc, lse = (out_s.astype(work), lse_s) if acc is None else _merge(acc, lse, out_s, lse_s)
        if s + 1 < world:
            kv = tuple(jax.lax.ppermute(x, axis_name, ring) for x in kv)
    out = acc.astype(q.dtype)
    return (out, lse) if return_lse else out


def _merge(acc, lse, out_s, lse_s):
    """The LSE merge of two partial attentions, differentiable without NaNs where a row
    attends nothing in either (its weights are exact zeros, its lse stays −inf)."""
    top = jnp.maximum(lse, lse_s)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w0, w1 = jnp.exp(lse - top), jnp.exp(lse_s - top)
    total = w0 + w1
    live = total > 0
    safe = jnp.where(live, total, 1.0)
    new_lse = jnp.where(live, top + jnp.log(safe), -jnp.inf)
    merged = (acc * (w0 / safe)[..., None] + out_s.astype(acc.dtype) * (w1 / safe)[..., None])
    return merged, new_lse.astype(lse.dtype)
