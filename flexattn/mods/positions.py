"""Position remapping for decoding: mods keep seeing *true* positions.

In a decode step the kernel computes row ``i`` of a short query block that actually sits at
position ``q_offset[b] + i`` of sequence ``b``, against a cache whose first
``kv_lengths[b]`` slots are valid. These transforms rewrite a mod so it reads those true
positions, with the offsets and lengths as runtime buffers — stepping the decoder changes
values, never the structure, so nothing recompiles.
"""

from __future__ import annotations

from .builtins import _check_rank
from .mod import MaskMod, Mod, mask_mod, score_mod


def shift_queries(mod: Mod, q_offset) -> Mod:
    """``mod`` evaluated at query position ``q_idx + q_offset[b]`` (``q_offset``: [B] ints)."""
    if not isinstance(mod, Mod):
        raise TypeError(f"shift_queries: expected a mod, got {type(mod).__name__}")
    _check_rank("shift_queries", q_offset, (1,))
    name = f"{mod.name}@offset" if mod.name else None
    if isinstance(mod, MaskMod):
        return mask_mod(lambda b, h, q_idx, kv_idx: mod(b, h, q_idx + q_offset[b], kv_idx), name=name)
    return score_mod(lambda s, b, h, q_idx, kv_idx: mod(s, b, h, q_idx + q_offset[b], kv_idx), name=name)


def limit_keys(mask: MaskMod, kv_lengths) -> MaskMod:
    """``mask`` restricted to keys ``kv_idx < kv_lengths[b]`` (the valid part of a cache)."""
    _check_rank("limit_keys", kv_lengths, (1,))
    name = f"{mask.name} & valid_keys" if mask.name else "valid_keys"
    return mask_mod(lambda b, h, q_idx, kv_idx: mask(b, h, q_idx, kv_idx) & (kv_idx < kv_lengths[b]), name=name)


def offset_positions(mod: Mod, q_offset, kv_offset) -> Mod:
    """``mod`` evaluated at query position ``q_idx + q_offset`` and key position ``kv_idx +
    kv_offset`` (two numbers): a shard of a longer sequence (context parallelism) sees the
    global positions. The offsets are captured numbers, runtime kernel arguments, so every
    shard pair shares one kernel. Where the two are equal one number serves both, so
    ``q_idx >= kv_idx`` stays exactly causal (the offsets cancel) instead of a band with
    runtime bounds."""
    if not isinstance(mod, Mod):
        raise TypeError(f"offset_positions: expected a mod, got {type(mod).__name__}")
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    name = f"{mod.name}@shard" if mod.name else None
    if q_offset == kv_offset:
        both = q_offset
        if isinstance(mod, MaskMod):
            return mask_mod(lambda b, h, q_idx, kv_idx: mod(b, h, q_idx + both, kv_idx + both), name=name)
        return score_mod(lambda s, b, h, q_idx, kv_idx: mod(s, b, h, q_idx + both, kv_idx + both), name=name)
    if isinstance(mod, MaskMod):
        return mask_mod(lambda b, h, q_idx, kv_idx: mod(b, h, q_idx + q_offset, kv_idx + kv_offset), name=name)
    return score_mod(lambda s, b, h, q_idx, kv_idx: mod(s, b, h, q_idx + q_offset, kv_idx + kv_offset), name=name)


def table_positions(mod: Mod, q_positions, kv_positions) -> Mod:
    """``mod`` evaluated at query position ``q_positions[q_idx]`` and key position
    ``kv_positions[kv_idx]`` (two int arrays, captured: runtime kernel arguments): a shard
    whose tokens are several separate runs of the sequence (a load-balanced layout) as one
    launch."""
    if not isinstance(mod, Mod):
        raise TypeError(f"table_positions: expected a mod, got {type(mod).__name__}")
    _check_rank("table_positions", q_positions, (1,))
    _check_rank("table_positions", kv_positions, (1,))
    name = f"{mod.name}@positions" if mod.name else None
    if isinstance(mod, MaskMod):
        return mask_mod(lambda b, h, q_idx, kv_idx: mod(b, h, q_positions[q_idx], kv_positions[kv_idx]), name=name)
    return score_mod(lambda s, b, h, q_idx, kv_idx: mod(s, b, h, q_positions[q_idx], kv_positions[kv_idx]), name=name)


def block_table_keys(mod: Mod, table, block: int) -> Mod:
    """``mod`` evaluated at key position ``table[b, kv_idx // block] * block + kv_idx % block``
    (``table``: [B, blocks] ints): a walk over the key blocks a block mask lists, in list
    order, sees each key at its position in the key tensor — where the mod (torch's
    ``PagedAttention`` masks, any mask of a block-sparse call) expects it."""
    if not isinstance(mod, Mod):
        raise TypeError(f"block_table_keys: expected a mod, got {type(mod).__name__}")
    _check_rank("block_table_keys", table, (2,))
    block = int(block)
    name = f"{mod.name}@blocks" if mod.name else None

    # (the table read in the traced functions themselves: tracing captures their closures' arrays)
    if isinstance(mod, MaskMod):
        return mask_mod(lambda b, h, q_idx, kv_idx: mod(b, h, q_idx, table[b, kv_idx // block] * block + kv_idx % block),
                        name=name)
    return score_mod(lambda s, b, h, q_idx, kv_idx: mod(s, b, h, q_idx,
                                                        table[b, kv_idx // block] * block + kv_idx % block),
                     name=name)


def batch_in_heads(mod: Mod, heads: int) -> Mod:
    """``mod`` for a call whose batch is folded into its heads (one sequence of
    ``B x heads`` heads): head ``h`` of the folded call is head ``h % heads`` of sequence
    ``h // heads``, which the mod sees as (b, h)."""
    if not isinstance(mod, Mod):
        raise TypeError(f"batch_in_heads: expected a mod, got {type(mod).__name__}")
    heads = int(heads)
    name = f"{mod.name}@folded" if mod.name else None
    if isinstance(mod, MaskMod):
        return mask_mod(lambda b, h, q_idx, kv_idx: mod(h // heads, h % heads, q_idx, kv_idx), name=name)
    return score_mod(lambda s, b, h, q_idx, kv_idx: mod(s, h // heads, h % heads, q_idx, kv_idx), name=name)
