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

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..arrays import dtype_name
from ..bounded import keep_bounded
from ..mods.positions import batch_in_heads, block_table_keys
from ..problem.spec import AttentionSpec
from ..problem.validate import AttentionShape
from .kernel_path import DECODE_HEAD_DIMS, KERNEL_DTYPES, _is_full, use_tvm_ffi
from .decode_path import (DECODE_MAX_Q_LEN, PAGE_TILE, DecodeMods, DecodeSite, attention_into, attention_plan,
                          mod_key)

# Query tokens up to which the decode kernel serves a forward call. Measured on the H100
# (bench_decode.py --flex, 2026-11-26): see benchmarks/RESULTS.md, "Decode".
SHORT_QUERY_MAX = DECODE_MAX_Q_LEN
_MAX_GROUP_ROWS = 128   # two consumer warpgroups of 64 packed rows


def _decode_kernel_takes(shape: AttentionShape, q_dtype: str) -> bool:
    """Whether the decode kernel takes a forward call of this shape and dtype (float32 among
    others is not: the decode kernel is 16-bit), whatever its mask."""
    return (q_dtype in KERNEL_DTYPES and shape.q_len <= SHORT_QUERY_MAX and shape.kv_len >= shape.q_len
            and shape.group * shape.q_len <= _MAX_GROUP_ROWS and shape.v_head_dim == shape.head_dim
            and shape.head_dim in DECODE_HEAD_DIMS)


def decode_route(shape: AttentionShape, spec: AttentionSpec, q_dtype: str) -> DecodeMods | None:
    """The decode kernel's mods for this forward call (``q_dtype``: the query's dtype name),
    or None where the forward kernel runs it."""
    if not _decode_kernel_takes(shape, q_dtype):
        return None
    mask = spec.mask
    block_mask = spec.block_mask
    if block_mask is not None:
        if not block_mask.from_mask:
            return None
        mask = block_mask.mask_mod
    return DecodeMods(spec.score, None if _is_full(mask) else mask, spec.resolved_scale(shape.head_dim),
                      true_positions=False)


@dataclass(frozen=True)
class ListWalk:
    """A short query whose block mask lists kv blocks the kernels cannot infer from its
    mask (torch's ``PagedAttention``: the pages of one physical cache that each sequence
    owns): the decode kernel walks each sequence's listed blocks as the pages of a paged
    cache (``table``: host int32 [B, blocks], read-only, full blocks first; ``lengths``:
    listed blocks x ``block`` per sequence), its mods rewritten to see each key at its
    position in K (``mods.positions.block_table_keys``); where each sequence lists at most
    one partial block (a length's last page), the kernel evaluates the mask on the tiles
    over that page alone (``DecodeMods.full_but_last``). Made once per block mask, batch
    and score mod (``_walk``): repeated calls find the same mods, hence the same decode plan."""

    mods: DecodeMods
    table: object
    lengths: list
    block: int
    # The batch folded into the heads (K / V batched, the lists shared by every sequence):
    # q, out and LSE as [1, B x Hq, ...], K / V as pages of B x Hkv heads, one table row.
    folded: bool = False


def list_walk_possible(shape: AttentionShape, spec: AttentionSpec, q_dtype: str, device) -> bool:
    """The shape, mask and adapter side of ``list_walk_route`` (the K / V side: their page
    views)."""
    block_mask = spec.block_mask
    if (device.page_view is None or block_mask is None or block_mask.from_mask
            or not _decode_kernel_takes(shape, q_dtype)):
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


def _walk(shape: AttentionShape, spec: AttentionSpec, folded: bool = False) -> ListWalk:
    """The ``ListWalk`` of a call that ``list_walk_possible`` accepts, kept on its block mask
    per batch, score mod (its IR and captures: the trace cache hands out a new mod object
    per call of one function), scale and folding."""
    block_mask = spec.block_mask
    score = spec.score
    scale = spec.resolved_scale(shape.head_dim)
    key = (shape.batch, shape.q_heads, folded, scale, mod_key(score))
    walks = block_mask.__dict__.setdefault("_list_walks", {})
    hit = walks.get(key)
    if hit is None:
        block = int(block_mask.BLOCK_SIZE[1])
        table, counts, full_but_last = block_mask.kv_block_table(1 if folded else shape.batch)
        heads = shape.q_heads if folded else None
        mods = DecodeMods(None if score is None else _through_table(score, table, block, heads),
                          _through_table(block_mask.mask_mod, table, block, heads), scale, true_positions=False,
                          full_but_last=full_but_last, listed_walk=True)
        # (the score kept too: the ids in the key stay its own)
        hit = keep_bounded(walks, key, (ListWalk(mods, table, [int(n) * block for n in counts], block, folded), score),
                           _WALKS_PER_MASK)
    return hit[0]


def _pages(spec: AttentionSpec, k, v, device):
    """``_pages_of`` for the block mask of ``spec``."""
    return _pages_of(int(spec.block_mask.BLOCK_SIZE[1]), spec.block_mask.shape[0], k, v, device)


def _pages_of(block: int, mask_batch: int, k, v, device):
    """``(folded, k pages, v pages)`` of a walk over this K / V in blocks of ``block`` keys:
    page views where every sequence reads the same K / V (batch 1, or a key / value batch
    of 1 broadcast: ``Device.page_view``); else, where the walk may fold the batch into the
    heads and the block mask treats every sequence alike (``mask_batch`` 1, as gpt-fast
    slices one per step), pages of B x Hkv heads; else None."""
    k_pages, v_pages = device.page_view(k, block), device.page_view(v, block)
    if k_pages is not None and v_pages is not None:
        return False, k_pages, v_pages
    if device.heads_view is None or mask_batch != 1:
        return None
    k_pages, v_pages = device.page_view(k, block, True), device.page_view(v, block, True)
    if k_pages is None or v_pages is None:
        return None
    return True, k_pages, v_pages


_TABLE_REWRITES: dict = {}   # (mod structure, block, heads) -> (rewrite, origin of each capture)
_TABLE_REWRITES_CAPACITY = 64


def _through_table(mod, table, block: int, heads: int | None):
    """``_through_table_origins``' rewrite of ``mod`` with its captures and ``table`` put in."""
    template, origins = _through_table_origins(mod, block, heads)
    return template.with_captures(_from_origins(origins, mod.captures, table))


def _through_table_origins(mod, block: int, heads: int | None):
    """``(template, origins)``: ``block_table_keys(mod, table, block)`` (with ``heads``, of
    the mod folded first: ``batch_in_heads``; the table's one row then read at the kernel's
    b, always 0) over a stand-in table, and for each of its captures the index of ``mod``'s
    capture it is (None: the table). Traced once per mod structure: a block mask converted
    anew each step (torch's PagedAttention in a serving loop: a fresh mask_mod closure,
    traced anew, same structure) reuses the rewrite with this mod's captures and this table
    put in — the same IR, so the decode kernel's config is found again (tracing the rewrite
    cost ~0.5 ms)."""
    key = (mod.structure_key, block, heads)
    hit = _TABLE_REWRITES.get(key)
    if hit is None:
        stand_in = np.zeros((1, 1), np.int32)
        template = block_table_keys(batch_in_heads(mod, heads) if heads else mod, stand_in, block)
        slots = {id(c): i for i, c in enumerate(mod.captures)}
        origins = tuple(None if c is stand_in else slots[id(c)] for c in template.captures)
        hit = keep_bounded(_TABLE_REWRITES, key, (template, origins), _TABLE_REWRITES_CAPACITY)
    return hit


def list_walk_route(shape: AttentionShape, spec: AttentionSpec, q_dtype: str, k, v, device) -> tuple | None:
    """``(ListWalk, k pages, v pages)`` for the decode kernel's walk of a short query's
    listed kv blocks (``_pages`` says over which K / V layouts), where one row of q blocks
    lists them and its heads agree; else None (the forward kernel reads the lists itself)."""
    if not list_walk_possible(shape, spec, q_dtype, device):
        return None
    pages = _pages(spec, k, v, device)
    if pages is None:
        return None
    folded, k_pages, v_pages = pages
    return _walk(shape, spec, folded), k_pages, v_pages


def _folded(folded: bool, q, out, lse, device) -> tuple:
    """``(q, out, lse)`` as a walk's kernel sees them: [1, B x Hq, ...] views where it is
    ``folded`` (q copied if its strides do not merge; the outputs are the adapter's, contiguous)."""
    if not folded:
        return q, out, lse
    views = device.heads_view(q, True), device.heads_view(out, False), device.heads_view(lse, False)
    if views[1] is None or views[2] is None:
        raise RuntimeError("flexattn: a folded walk needs contiguous outputs")
    return views


def _walk_plan(walk: ListWalk, q, k_pages, v_pages, out, lse, device) -> tuple:
    """``(decode plan, table on the device, SM count)`` of a walk over these arrays (q, out
    and LSE as ``_folded`` gives them)."""
    site = _site(device)
    table = device.to_device(walk.table)
    return attention_plan(q, k_pages, v_pages, out, lse, site, walk.mods, table, walk.block), table, site.num_sms


def list_walk_into(q, out, lse, route: tuple, device) -> None:
    """Run a ``list_walk_route`` call with the decode kernel on ``device``'s stream."""
    walk, k_pages, v_pages = route
    q, out, lse = _folded(walk.folded, q, out, lse, device)
    plan, table, num_sms = _walk_plan(walk, q, k_pages, v_pages, out, lse, device)
    plan.run(q, k_pages, v_pages, table, out, lse, walk.lengths, num_sms)


class PreparedListWalk:
    """``PreparedShortQuery`` for ``list_walk_route`` calls: per K / V layout (folded or
    not) the walk, its table on the device and its plan, made at the first launch; the page
    views per launch (K / V the walk cannot take, or another stream: False, the full path)."""

    __slots__ = ("_shape", "_spec", "_device", "_ready")

    def __init__(self, shape: AttentionShape, spec: AttentionSpec, device):
        self._shape, self._spec, self._device, self._ready = shape, spec, device, {}

    def launch(self, q, k, v, out, lse, stream: int | None = None):
        device = self._device
        if stream is not None and stream != device.stream:
            return False
        pages = _pages(self._spec, k, v, device)
        if pages is None:
            return False
        folded, k_pages, v_pages = pages
        ready = self._ready.get(folded)
        walk = ready[0] if ready is not None else _walk(self._shape, self._spec, folded)
        q, out, lse = _folded(walk.folded, q, out, lse, device)
        if ready is None:
            ready = self._ready[folded] = (walk, *_walk_plan(walk, q, k_pages, v_pages, out, lse, device))
        _, plan, table, num_sms = ready
        plan.run(q, k_pages, v_pages, table, out, lse, walk.lengths, num_sms)
        return True


def prepared_list_walk(shape: AttentionShape, spec: AttentionSpec, q_dtype: str, device):
    """A ``PreparedListWalk`` for calls like this one, or None where they cannot walk."""
    if not list_walk_possible(shape, spec, q_dtype, device):
        return None
    return PreparedListWalk(shape, spec, device)


@dataclass(frozen=True)
class DeviceLists:
    """A short query's block mask given as a walk already on the device (torch.compile: a
    block mask sliced or built in the graph, whose lists the graph turns into these with its
    own ops, ``flexattn/torch/graph_walk.py``; nothing reads them on the host): ``table``
    int32 [1 or B, width] each sequence's kv blocks, full ones first; ``lengths`` int32
    [1 or B] its listed blocks x ``block``; ``q_block`` the mask's query block. Every tile
    is masked (how many of the listed blocks are full is not known on the host)."""

    table: object
    lengths: object
    block: int
    q_block: int


def device_walk_into(q, k, v, out, lse, shape: AttentionShape, spec: AttentionSpec, lists: DeviceLists,
                     device) -> "PreparedDeviceWalk | bool | None":
    """Run a short query over ``lists`` with the decode kernel (``spec.mask``: the block
    mask's mask_mod, read through the table as ``list_walk_route``'s walk reads it) and
    return its ``PreparedDeviceWalk`` for calls like it (False: launched, nothing to keep);
    None where the kernel or the K / V layout cannot take it (nothing launched: the caller
    converts the lists on the host)."""
    block, batch = lists.block, int(lists.table.shape[0])
    if (device.page_view is None or device.decode_resources is None or shape.q_len > lists.q_block
            or shape.kv_len % block or batch not in (1, shape.batch)
            or not _decode_kernel_takes(shape, dtype_name(q))):
        return None
    from ..kernels.decode.sm90 import check_page_size

    try:
        check_page_size(block, PAGE_TILE)
    except ValueError:
        return None
    pages = _pages_of(block, batch, k, v, device)
    if pages is None:
        return None
    folded, k_pages, v_pages = pages
    table, lengths = lists.table, lists.lengths
    if not folded and batch != shape.batch:
        return None   # (one row for every sequence of a shared K / V: the adapter broadcasts it)
    heads = shape.q_heads if folded else None
    mask = None if _is_full(spec.mask) else spec.mask
    walked = [None if m is None else _through_table_origins(m, block, heads) for m in (spec.score, mask)]
    mods = DecodeMods(*(None if w is None else w[0].with_captures(_from_origins(w[1], m.captures, table))
                        for w, m in zip(walked, (spec.score, mask))),
                      spec.resolved_scale(shape.head_dim), true_positions=False, listed_walk=True)
    q_seen, out_seen, lse_seen = _folded(folded, q, out, lse, device)
    site = _site(device)
    longest = int(table.shape[1]) * block
    if not use_tvm_ffi(device):
        plan = attention_plan(q_seen, k_pages, v_pages, out_seen, lse_seen, site, mods, table, block)
        plan.run_device_lengths(q_seen, k_pages, v_pages, table, out_seen, lse_seen, lengths, longest, site.num_sms)
        return False   # (launched; repeats take this path again: only TVM-FFI launches take captures per call)
    # The plan is made over stand-ins of the call's arrays and every launch passes its own:
    # a kept plan holding a graph's tensors would keep them alive (CUDA graph trees refuse
    # memory of their pool that the graph's outputs do not account for).
    plan = attention_plan(q_seen, k_pages, v_pages, out_seen, lse_seen, site, _with_stand_ins(mods),
                          _stand_in(table), block)
    origins = tuple(("score", o) for o in (walked[0][1] if walked[0] else ())) + \
        tuple(("mask", o) for o in (walked[1][1] if walked[1] else ()))
    prepared = PreparedDeviceWalk(plan, device, folded, block, batch, origins, longest, site.num_sms)
    prepared.launch(q, k, v, out, lse, mod_captures(spec), table, lengths)
    return prepared


def mod_captures(spec: AttentionSpec) -> dict:
    """``{"score": captures, "mask": captures}`` of a spec's mods (``PreparedDeviceWalk.launch``)."""
    return {"score": spec.score.captures if spec.score is not None else (),
            "mask": spec.mask.captures if spec.mask is not None else ()}


def _stand_in(x):
    """A host array of ``x``'s shape and dtype (one element seen everywhere, writeable: the
    plan would copy a read-only one to the device) standing for ``x`` in a kept plan;
    numbers pass."""
    if isinstance(x, (int, float)):
        return x
    try:
        dtype = np.dtype(dtype_name(x))
    except TypeError:
        dtype = np.dtype(np.float32)   # (bfloat16 and friends: never read)
    shape = tuple(int(n) for n in x.shape)
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape, (0,) * len(shape))


def _with_stand_ins(mods: DecodeMods) -> DecodeMods:
    return dataclasses.replace(mods, **{name: None if m is None else m.with_captures(tuple(map(_stand_in, m.captures)))
                                        for name, m in (("score_mod", mods.score_mod), ("mask", mods.mask))})


def _from_origins(origins: tuple, captures: tuple, table) -> tuple:
    return tuple(table if o is None else captures[o] for o in origins)


class PreparedDeviceWalk:
    """``device_walk_into``'s call made again (the adapter keeps it per op call shape: a
    compiled graph repeats its calls): the plan, the fold and where each of the kernel's
    captures comes from (the call's score or mask captures, or its table) are kept, so a
    call costs its views, its captures' conversion and the launch — no rewrite of the
    mods, no plan lookup or rebinding (~60 µs of host time per call on a CPU box).
    ``launch`` returns False where this call's K / V cannot take the same walk (the
    adapter then takes the full path)."""

    __slots__ = ("_plan", "_device", "_folded", "_block", "_batch", "_origins", "_longest", "_num_sms")

    def __init__(self, plan, device, folded: bool, block: int, batch: int, origins: tuple, longest: int,
                 num_sms: int):
        self._plan, self._device, self._folded, self._block, self._batch = plan, device, folded, block, batch
        self._origins, self._longest, self._num_sms = origins, longest, num_sms

    def launch(self, q, k, v, out, lse, captures: dict, table, lengths) -> bool:
        """Launch this call's walk; ``captures``: its mods' captures by kind, ``{"score":
        (...), "mask": (...)}`` (``mod_captures``)."""
        device = self._device
        pages = _pages_of(self._block, self._batch, k, v, device)
        if pages is None or pages[0] != self._folded:
            return False
        _, k_pages, v_pages = pages
        q, out, lse = _folded(self._folded, q, out, lse, device)
        captures = tuple(table if o is None else captures[kind][o] for kind, o in self._origins)
        self._plan.run_device_lengths(q, k_pages, v_pages, table, out, lse, lengths, self._longest, self._num_sms,
                                      captures)
        return True


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


__all__ = ["DeviceLists", "ListWalk", "PreparedDeviceWalk", "PreparedListWalk", "PreparedShortQuery",
           "SHORT_QUERY_MAX", "decode_route", "device_walk_into", "list_walk_into", "list_walk_possible",
           "list_walk_route", "mod_captures", "prepared_list_walk", "short_query_into"]
