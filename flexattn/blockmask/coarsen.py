"""A block mask at the kernels' tile size, from one built at another ``BLOCK_SIZE``.

The GPU kernels walk 128 x 128 tiles. A block mask made at another size (torch users pass
``BLOCK_SIZE=64``, ``(128, 64)``, ...) keeps its meaning exactly, as torch defines it: an
element (q, kv) is attended where its tile is full, or partial and the mask mod holds there.
``at_block_size`` gives the same attention on the kernels' tiles:

- each kernel tile is full where every listed tile it overlaps is full, empty where every
  one is empty, else partial (only the states decide: the mask mod is not evaluated, so a
  captured tensor keeps being read at call time wherever the original read it);
- its mask mod reads the original tile states from a captured table (``states[b, h, q //
  q_block, kv // kv_block]``): full there, or partial and the original mask mod.

A block mask made from its mask alone (``from_mask``) is instead built anew from the mask at
``block_size`` (on its device), and stays ``from_mask``: the kernels' path then reads the
mask's structure as for any such block mask (a window's band, causal's diagonal).
"""

from __future__ import annotations

import collections

import numpy as np

from ..mods.mod import mask_mod
from .build import create_block_mask
from .layout import EMPTY, FULL, PARTIAL, BlockMask


# Coarse block masks by (the original's lists, block size, mask structure and
# captures): a repeated call finds its block mask's again, and so does a call path that
# copies a block mask to bind this call's captures (the registry under torch.compile,
# JAX's templates). Bounded; it holds what its keys name alive, so their ids stay theirs.
_KEPT: "collections.OrderedDict" = collections.OrderedDict()
_KEPT_CAPACITY = 32


def at_block_size(block_mask: BlockMask, block_size: tuple) -> BlockMask:
    """``block_mask`` at ``block_size`` (see the module's text); itself where it already
    is. Made once per block mask, mask structure and captures (``_KEPT``)."""
    block_size = tuple(int(s) for s in block_size)
    if tuple(block_mask.BLOCK_SIZE) == block_size:
        return block_mask
    fine_mask = block_mask.mask_mod
    # (its lists: made once per block mask, shared by its copies)
    states_source = block_mask.__dict__.get("_lists")
    key = (id(states_source), block_mask.from_mask, block_size, tuple(block_mask.BLOCK_SIZE),
           fine_mask.structure_key, tuple(id(c) for c in fine_mask.captures))
    hit = _KEPT.get(key)
    if hit is not None:
        _KEPT.move_to_end(key)
        return hit[0]
    if block_mask.from_mask:
        batch, heads = block_mask.shape[:2]
        coarse = create_block_mask(fine_mask, batch, heads, *block_mask.seq_lengths, BLOCK_SIZE=block_size,
                                   device=None if block_mask.device == "cpu" else block_mask.device)
    else:
        states = block_mask.block_states()
        coarse = BlockMask(_coarse_states(states, block_mask.BLOCK_SIZE, block_size, block_mask.seq_lengths),
                           block_mask.seq_lengths, block_size, _tile_mask(states, block_mask.BLOCK_SIZE, fine_mask))
    _KEPT[key] = (coarse, states_source, fine_mask.captures)
    while len(_KEPT) > _KEPT_CAPACITY:
        _KEPT.popitem(last=False)
    return coarse


def _coarse_states(states: np.ndarray, fine: tuple, coarse: tuple, seq_lengths: tuple) -> np.ndarray:
    """[B, H, Q tiles, KV tiles] of the ``coarse`` tiles: FULL where every ``fine`` tile
    they overlap is FULL, EMPTY where every one is EMPTY, else PARTIAL. Whole-number ratios
    (64 -> 128, 256 -> 128) in array operations (a 128k sequence at 64 holds 4M tiles per
    head); other sizes tile by tile."""
    out = states
    for axis, (f, c, length) in ((2, (fine[0], coarse[0], seq_lengths[0])), (3, (fine[1], coarse[1], seq_lengths[1]))):
        n = -(-length // c)
        if f % c == 0:       # each coarse tile inside one fine tile
            out = np.take(out, np.minimum(np.arange(n) * c // f, out.shape[axis] - 1), axis=axis)
        elif c % f == 0:     # each coarse tile over c / f fine ones: padded with neutral tiles
            ratio = c // f
            pad = [(0, 0)] * 4
            pad[axis] = (0, n * ratio - out.shape[axis])
            shape = out.shape[:axis] + (n, ratio) + out.shape[axis + 1:]
            full = np.all(np.pad(out, pad, constant_values=FULL).reshape(shape) == FULL, axis=axis + 1)
            empty = np.all(np.pad(out, pad, constant_values=EMPTY).reshape(shape) == EMPTY, axis=axis + 1)
            # (a partial fine tile makes its coarse tile partial: neither all full nor all empty)
            out = np.where(full, FULL, np.where(empty, EMPTY, PARTIAL)).astype(np.int8)
        else:
            return _coarse_states_by_tile(states, fine, coarse, seq_lengths)
    return np.ascontiguousarray(out, dtype=np.int8)


def _coarse_states_by_tile(states: np.ndarray, fine: tuple, coarse: tuple, seq_lengths: tuple) -> np.ndarray:
    """``_coarse_states`` tile by tile, for sizes of no whole-number ratio."""
    rows = _overlaps(seq_lengths[0], fine[0], coarse[0], states.shape[2])
    cols = _overlaps(seq_lengths[1], fine[1], coarse[1], states.shape[3])
    out = np.empty(states.shape[:2] + (len(rows), len(cols)), dtype=np.int8)
    for i, (r0, r1) in enumerate(rows):
        band = states[:, :, r0:r1]
        for j, (c0, c1) in enumerate(cols):
            tile = band[:, :, :, c0:c1]
            full = np.all(tile == FULL, axis=(2, 3))
            empty = np.all(tile == EMPTY, axis=(2, 3))
            out[:, :, i, j] = np.where(full, FULL, np.where(empty, EMPTY, PARTIAL))
    return out


def _overlaps(length: int, fine: int, coarse: int, fine_count: int) -> list:
    """[(first, last + 1)] of the fine blocks each coarse block of ``length`` tokens overlaps."""
    out = []
    for start in range(0, max(length, 1), coarse):
        stop = min(start + coarse, length) - 1
        out.append((start // fine, min(stop // fine, fine_count - 1) + 1))
    return out


def _tile_mask(states: np.ndarray, fine: tuple, fine_mask):
    """The element mask the original tile states and mask mod mean: full tiles attended,
    partial ones where ``fine_mask`` holds, empty ones not."""
    table = np.ascontiguousarray(states, dtype=np.int8)
    table.flags.writeable = False      # read-only: a captured constant the GPU path copies once
    q_block, kv_block = fine
    one_batch, one_head = table.shape[0] == 1, table.shape[1] == 1   # (broadcast over b / h)
    everywhere = fine_mask.attends_everywhere

    def listed(b, h, q_idx, kv_idx):
        state = table[0 if one_batch else b, 0 if one_head else h, q_idx // q_block, kv_idx // kv_block]
        if everywhere:
            return state != EMPTY
        return (state == FULL) | ((state == PARTIAL) & fine_mask(b, h, q_idx, kv_idx))

    return mask_mod(listed, name=f"{fine_mask.name or 'mask'}@{q_block}x{kv_block}")
