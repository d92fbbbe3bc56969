"""Short queries take the decoding kernel, whatever the door.

A torch user decodes by calling ``flex_attention(q, k_cache[:, :, :L], v_cache[:, :, :L])``
with one query token (torch itself switches to its decoding kernel for short queries).
The forward kernel would spend a 128-row tile on that token and read K/V once per query
head; the split-KV decode kernel (``kernels/decode``) packs the query heads that share a
K/V head into one tile (GQA) and splits the keys over the whole GPU. So the core sends a
forward call here when

- the query is short (``SHORT_QUERY_MAX`` tokens, and its GQA group's rows fit the decode
  kernel's two 64-row warpgroups),
- no key row is shorter than the query block (``KV >= Q``),
- the mask is a mask mod (``mask=``, or a block mask built from its mask alone:
  ``BlockMask.from_mask``; the decode kernel skips blocks by analysing the mask itself,
  so lists given by hand keep the forward kernel), any score mod,
  (a short query whose block mask lists blocks of one K / V that every sequence shares
  — torch's ``PagedAttention``: a physical cache of batch 1, each sequence's pages listed
  — walks those blocks as the pages of a paged cache: ``list_walk_route``),
- and the adapter supplies the decode kernel's resources (``Device.decode_resources``:
  torch, CuPy) — or, for JAX, whose launches are XLA custom calls, ``xla_path.XlaPlan``
  plans the decode kernel's entry with a fixed launch (``decode_path.fixed_length_launch``).

Queries keep flex_attention's positions (``q_idx`` from 0: ``DecodeMods.true_positions``
False). The forward's outputs and LSE are the same arrays, so a backward that follows
runs unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..mods.positions import block_table_keys
from ..problem.spec import AttentionSpec
from ..problem.validate import AttentionShape
from .kernel_path import DECODE_HEAD_DIMS, KERNEL_DTYPES
from .decode_path import DECODE_MAX_Q_LEN, PAGE_TILE, DecodeMods, DecodeSite, attention_into, attention_plan

# Query tokens up to which the decode kernel serves a forward call. Measured on the H100
# (bench_decode.py --flex, 2026-11-26): see benchmarks/RESULTS.md, "Decode".
SHORT_QUERY_MAX = DECODE_MAX_Q_LEN
_MAX_GROUP_ROWS = 128   # two consumer warpgroups of 64 packed rows


def decode_route(shape: AttentionShape, spec: AttentionSpec, q_dtype: str) -> DecodeMods | None:
    """The decode kernel's mods for this forward call (``q_dtype``: the query's dtype name),
    or None where the forward kernel runs it (float32 among others: the decode kernel is
    16-bit)."""
    if q_dtype not in KERNEL_DTYPES:
        return None
    if shape.q_len > SHORT_QUERY_MAX or shape.kv_len < shape.q_len or shape.group * shape.q_len > _MAX_GROUP_ROWS:
        return None
    if shape.v_head_dim != shape.head_dim or shape.head_dim not in DECODE_HEAD_DIMS:
        return None
    mask = spec.mask
    block_mask = spec.block_mask
    if block_mask is not None:
        if not block_mask.from_mask:
            return None
        mask = block_mask.mask_mod
    if mask is not None and mask.expr.op == "const" and mask.expr.attr is True:
        mask = None
    return DecodeMods(spec.score, mask, spec.resolved_scale(shape.head_dim), true_positions=False)


@dataclass(frozen=True)
class ListWalk:
    """A short query whose block mask lists kv blocks the kernels cannot infer from its
    mask (torch's ``PagedAttention``: the pages of one physical cache that each sequence
    owns): the decode kernel walks each sequence's listed blocks as the pages of a paged
    cache (``table``: host int32 [B, blocks], read-only, full blocks first; ``lengths``:
    listed blocks x ``block`` per sequence), its mods rewritten to see each key at its
    position in K (``mods.positions.block_table_keys``); where each sequence lists at most
    one partial block (a length's last page), the kernel evaluates the mask in the
    length-bound block alone (``DecodeMods.full_but_last``). Made once per block mask, batch and score mod
    (``_walk``): repeated calls find the same mods, hence the same decode plan."""

    mods: DecodeMods
    table: object
    lengths: list
    block: int


def list_walk_possible(shape: AttentionShape, spec: AttentionSpec, q_dtype: str, device) -> bool:
    """The shape, mask and adapter side of ``list_walk_route`` (the K / V side: their page
    views)."""
    block_mask = spec.block_mask
    if (device.page_view is None or block_mask is None or block_mask.from_mask or q_dtype not in KERNEL_DTYPES
            or shape.q_len > SHORT_QUERY_MAX or shape.group * shape.q_len > _MAX_GROUP_ROWS
            or shape.v_head_dim != shape.head_dim or shape.head_dim not in DECODE_HEAD_DIMS):
        return False
    q_block, kv_block = block_mask.BLOCK_SIZE
    if shape.q_len > q_block or shape.kv_len % kv_block:
        return False
    from ..kernels.decode.sm90 import check_page_size

    try:
        check_page_size(kv_block, PAGE_TILE)
    except ValueError:
        return False
    walk = block_mask.kv_block_table(shape.batch)
    # (a sequence listing no block sees no key: the forward kernel's zeros and -inf LSE)
    return walk is not None and int(walk[1].min()) >= 1


_WALKS_PER_MASK = 8


def _walk(shape: AttentionShape, spec: AttentionSpec) -> ListWalk:
    """The ``ListWalk`` of a call that ``list_walk_possible`` accepts, kept on its block mask
    per batch, score mod (its IR and captures: the trace cache hands out a new mod object
    per call of one function) and scale."""
    block_mask = spec.block_mask
    score = spec.score
    scale = spec.resolved_scale(shape.head_dim)
    key = (shape.batch, scale, None if score is None else
           (id(score.expr), tuple(c if isinstance(c, (int, float)) else id(c) for c in score.captures)))
    walks = block_mask.__dict__.setdefault("_list_walks", {})
    hit = walks.get(key)
    if hit is None:
        block = int(block_mask.BLOCK_SIZE[1])
        table, counts, full_but_last = block_mask.kv_block_table(shape.batch)
        mods = DecodeMods(None if score is None else block_table_keys(score, table, block),
                          block_table_keys(block_mask.mask_mod, table, block), scale, true_positions=False,
                          full_but_last=full_but_last)
        if len(walks) >= _WALKS_PER_MASK:
            walks.pop(next(iter(walks)))
        # (the score kept too: the ids in the key stay its own)
        hit = walks[key] = (ListWalk(mods, table, [int(n) * block for n in counts], block), score)
    return hit[0]


def list_walk_route(shape: AttentionShape, spec: AttentionSpec, q_dtype: str, k, v, device) -> tuple | None:
    """``(ListWalk, k pages, v pages)`` for the decode kernel's walk of a short query's
    listed kv blocks, where every sequence reads the same K / V (batch 1, or a key / value
    batch of 1 broadcast: ``Device.page_view``), one row of q blocks lists them and its
    heads agree; else None (the forward kernel reads the lists itself)."""
    if not list_walk_possible(shape, spec, q_dtype, device):
        return None
    block = int(spec.block_mask.BLOCK_SIZE[1])
    k_pages, v_pages = device.page_view(k, block), device.page_view(v, block)
    if k_pages is None or v_pages is None:
        return None
    return _walk(shape, spec), k_pages, v_pages


def list_walk_into(q, out, lse, route: tuple, device) -> None:
    """Run a ``list_walk_route`` call with the decode kernel on ``device``'s stream."""
    walk, k_pages, v_pages = route
    site = _site(device)
    table = device.to_device(walk.table)
    plan = attention_plan(q, k_pages, v_pages, out, lse, site, walk.mods, table, walk.block)
    plan.run(q, k_pages, v_pages, table, out, lse, walk.lengths, site.num_sms)


class PreparedListWalk:
    """``PreparedShortQuery`` for ``list_walk_route`` calls: the walk made once, the page
    views per launch (K / V of another layout, or another stream: False, the full path)."""

    __slots__ = ("_walk", "_device", "_plan", "_table", "_num_sms")

    def __init__(self, walk: ListWalk, device):
        self._walk, self._device, self._plan = walk, device, None

    def launch(self, q, k, v, out, lse, stream: int | None = None):
        device, walk = self._device, self._walk
        if stream is not None and stream != device.stream:
            return False
        k_pages, v_pages = device.page_view(k, walk.block), device.page_view(v, walk.block)
        if k_pages is None or v_pages is None:
            return False
        if self._plan is None:
            site = _site(device)
            self._table = device.to_device(walk.table)
            self._plan = attention_plan(q, k_pages, v_pages, out, lse, site, walk.mods, self._table, walk.block)
            self._num_sms = site.num_sms
        self._plan.run(q, k_pages, v_pages, self._table, out, lse, walk.lengths, self._num_sms)
        return True


def prepared_list_walk(shape: AttentionShape, spec: AttentionSpec, q_dtype: str, device):
    """A ``PreparedListWalk`` for calls like this one, or None where they cannot walk."""
    if not list_walk_possible(shape, spec, q_dtype, device):
        return None
    return PreparedListWalk(_walk(shape, spec), device)


def _site(device) -> DecodeSite:
    num_sms, workspace = device.decode_resources()
    return DecodeSite(device, num_sms, workspace)


def short_query_into(q, k, v, out, lse, mods: DecodeMods, device) -> None:
    """Run a routed call (``decode_route``) with the decode kernel on ``device``'s stream."""
    attention_into(q, k, v, out, lse, _site(device), mods)


class PreparedShortQuery:
    """A routed call shape ready to launch again: ``kernel_path.prepare_forward`` hands it
    out in place of a ``PreparedForward``, with the same ``launch``. Its decode plan is
    made at the first launch (it needs the arrays) for the device's stream; a launch on
    another stream returns False (the adapter then takes the full path)."""

    __slots__ = ("_mods", "_device", "_run", "_lengths", "_num_sms")

    def __init__(self, mods: DecodeMods, device):
        self._mods, self._device, self._run = mods, device, None

    def launch(self, q, k, v, out, lse, stream: int | None = None):
        if stream is not None and stream != self._device.stream:
            return False
        if self._run is None:
            site = _site(self._device)
            self._run, self._num_sms = attention_plan(q, k, v, out, lse, site, self._mods).run, site.num_sms
            self._lengths = [int(k.shape[2])] * int(q.shape[0])
        self._run(q, k, v, None, out, lse, self._lengths, self._num_sms)
        return True


__all__ = ["SHORT_QUERY_MAX", "ListWalk", "PreparedListWalk", "PreparedShortQuery", "decode_route", "list_walk_into",
           "list_walk_possible", "list_walk_route", "prepared_list_walk", "short_query_into"]
