"""torch.compile: a short query whose block mask is a value of the graph walks its lists on
the device.

gpt-fast decodes with ``block_mask[:, :, input_pos // 128]`` inside the compiled step: the
sliced lists are tensors the graph computes. Converting them on the host (our block mask
format) would wait for the GPU in every step and every layer. Instead, where a marked call
(``nested.rewrite_marked_calls``) is a short query over one row of q blocks of one head,
the graph itself turns the lists into the decode kernel's walk (``walk_lists``: a table of
each sequence's kv blocks, full ones first, its length in keys and its count of full
blocks) — torch ops that Inductor fuses with the slice, captured by CUDA graphs like the
rest — and passes the walk to our op in place of the four lists (``[None] * 4 + walk``: the
sliced lists are then never materialized). The op runs the decode kernel on it
(``core.short_query.device_walk_into``) with lengths read on the device; where the kernel or
the K / V layout cannot take the call, it rebuilds the four lists from the walk
(``lists_of_walk``) and converts them as before.
"""

from __future__ import annotations

import operator

import torch

from ..core.short_query import SHORT_QUERY_MAX


def walk_lists(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, kv_block: int, kv_blocks: int):
    """``(table, lengths, full)`` of torch block-mask lists with one row of q blocks and one
    head ([B, 1, 1] counts, [B, 1, 1, n] indices; the full ones may be None): ``table`` int32
    [B, at most ``kv_blocks``] each sequence's full blocks then its partial ones, in the
    lists' order (any order serves: the walk masks every tile and the softmax sums; entries
    past its count are any block in range), ``lengths`` int32 [B] its listed blocks x
    ``kv_block``, ``full`` int32 [B] how many of them are full (the lists can be rebuilt from
    the three: ``lists_of_walk``). Counts are clamped to their lists and to ``kv_blocks``,
    indices to ``kv_blocks``: lists made by hand that break those bounds read wrong blocks,
    never outside K / V."""
    batch = kv_num_blocks.shape[0]
    indices = kv_indices.reshape(batch, -1)
    count = kv_num_blocks.reshape(batch, 1).clamp(0, indices.shape[1])
    if full_kv_num_blocks is None or full_kv_indices is None:
        table, full_count = indices, torch.zeros_like(count)
    else:
        full = full_kv_indices.reshape(batch, -1)
        full_count = full_kv_num_blocks.reshape(batch, 1).clamp(0, full.shape[1])
        both = torch.cat([full, indices], 1)
        slot = torch.arange(both.shape[1], device=both.device).unsqueeze(0)
        # slot j < full count: the full list's j-th; after: the partial list's (j - full count)-th
        source = torch.where(slot < full_count, slot, slot - full_count + full.shape[1])
        table = both.gather(1, source.clamp(max=both.shape[1] - 1))
        count = count + full_count
    # (at most every block once: wider tables would only size the launch for keys never read)
    table = table[:, :kv_blocks].clamp(0, kv_blocks - 1).to(torch.int32)
    count = count.reshape(batch).clamp(max=kv_blocks)
    full_count = torch.minimum(full_count.reshape(batch), count)
    return table, (count * kv_block).to(torch.int32), full_count.to(torch.int32)


def lists_of_walk(table, lengths, full, kv_block: int) -> list:
    """The four kv-side lists ([B, 1, 1] counts, [B, 1, 1, W] indices, int32) of a walk
    (``walk_lists``' three outputs): what a call that cannot take the walk converts."""
    batch, width = table.shape
    count = lengths.to(torch.int64) // kv_block
    full = full.to(torch.int64)
    slot = torch.arange(width, device=table.device).unsqueeze(0)
    partial = table.gather(1, (slot + full.unsqueeze(1)).clamp(max=max(width - 1, 0)))   # (past the full ones)
    return [(count - full).to(torch.int32).reshape(batch, 1, 1), partial.reshape(batch, 1, 1, width),
            full.to(torch.int32).reshape(batch, 1, 1), table.reshape(batch, 1, 1, width)]


def _value(node):
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else node


def walk_nodes(graph: torch.fx.Graph, query, lists: list, layout: list) -> list:
    """``[table, lengths, full]`` nodes (``walk_lists``) inserted at the graph's insertion point for
    a marked call's block mask where the call is a short query over one row of q blocks of
    one head; else ``[]``. The batch and KV_LEN may be symbolic (a serving loop's batch
    changes, and dynamo then compiles them dynamic): the table's width is then a node of the
    graph, and a KV_LEN off the kv blocks is found by the op (it converts the lists)."""
    q, kv_num = _value(query), _value(lists[0])
    if not isinstance(q, torch.Tensor) or not isinstance(kv_num, torch.Tensor) or q.dim() != 4 or kv_num.dim() != 3:
        return []
    q_block, kv_block, _, kv_len = layout
    q_len, heads, rows = q.shape[2], kv_num.shape[1], kv_num.shape[2]
    if not all(type(x) is int for x in (q_block, kv_block, q_len, heads, rows)):   # (symbolic: not a decode row)
        return []
    if q_len > min(SHORT_QUERY_MAX, q_block) or (heads, rows) != (1, 1):
        return []
    if isinstance(kv_len, torch.fx.Node):
        if _value(kv_len) is None:   # (no example of the size: left to the conversion)
            return []
        kv_blocks = graph.call_function(operator.floordiv, (kv_len, kv_block))
        kv_blocks.meta["example_value"] = _value(kv_len) // kv_block
    elif type(kv_len) is int and kv_len % kv_block == 0:
        kv_blocks = kv_len // kv_block
    else:
        return []
    node = graph.call_function(walk_lists, (*lists, kv_block, kv_blocks))
    fake_mode = getattr(kv_num, "fake_mode", None)   # (the examples' own: the pass runs outside it)
    if fake_mode is not None:
        with fake_mode:
            node.meta["example_value"] = walk_lists(*(_value(x) for x in lists), kv_block, _value(kv_blocks))
    outputs = []
    for i in range(3):
        item = graph.call_function(operator.getitem, (node, i))
        if "example_value" in node.meta:
            item.meta["example_value"] = node.meta["example_value"][i]
        outputs.append(item)
    return outputs


__all__ = ["lists_of_walk", "walk_lists", "walk_nodes"]
