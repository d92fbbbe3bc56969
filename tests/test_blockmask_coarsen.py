"""A block mask at another BLOCK_SIZE on the kernels' 128 x 128 tiles (blockmask/coarsen.py):
the same attended elements as torch defines them (full tiles, and partial ones where the
mask mod holds), for random tile states, block sizes that divide 128 or not, lengths that
are no multiple of either, per-head and broadcast states, with and without a mask mod."""

import zlib

import numpy as np
import pytest

from flexattn import mods
from flexattn.blockmask.coarsen import at_block_size
from flexattn.blockmask.layout import EMPTY, FULL, PARTIAL, BlockMask


def _elements(block_mask, b, h):
    """[Q, KV] bool: the pairs ``block_mask`` attends for (b, h), by torch's definition."""
    states = block_mask.block_states()
    tile = states[b if states.shape[0] > 1 else 0, h if states.shape[1] > 1 else 0]
    (q_block, kv_block), (q_len, kv_len) = block_mask.BLOCK_SIZE, block_mask.seq_lengths
    tile = tile[np.arange(q_len) // q_block][:, np.arange(kv_len) // kv_block]
    inner = np.broadcast_to(block_mask.mask_mod(b, h, np.arange(q_len)[:, None], np.arange(kv_len)[None, :]),
                            (q_len, kv_len))
    return (tile == FULL) | ((tile == PARTIAL) & inner)


DOC = np.repeat(np.arange(7), [50, 13, 90, 41, 77, 30, 99]).astype(np.int32)   # 400 tokens


@pytest.mark.parametrize("block_size", [(64, 64), (64, 32), (100, 48), (256, 256), (128, 64), (16, 200)])
@pytest.mark.parametrize("mask", ["documents", "none", "window"])
@pytest.mark.parametrize("heads", [(2, 3), (1, 1), (1, 3)])
def test_coarse_tiles_attend_the_same_elements(block_size, mask, heads):
    rng = np.random.default_rng(zlib.crc32(repr((block_size, mask, heads)).encode()))
    q_len, kv_len = 333, 400
    fine = {"documents": mods.document(DOC[:kv_len]) if q_len == kv_len else
            mods.mask_mod(lambda b, h, q, kv: DOC[q] == DOC[kv]),
            "none": None, "window": mods.sliding_window(70)}[mask]
    shape = (*heads, -(-q_len // block_size[0]), -(-kv_len // block_size[1]))
    states = rng.choice([EMPTY, PARTIAL, FULL], size=shape, p=[0.4, 0.3, 0.3]).astype(np.int8)
    states[..., :1, :] = FULL    # some coarse tiles all full, others all empty
    states[..., -1:, :] = EMPTY
    bm = BlockMask(states, (q_len, kv_len), block_size, fine)
    coarse = at_block_size(bm, (128, 128))
    assert coarse.BLOCK_SIZE == (128, 128) and not coarse.from_mask
    assert coarse.block_states().shape == (*heads, 3, 4)
    for b in range(2):
        for h in range(3):
            np.testing.assert_array_equal(_elements(coarse, b, h), _elements(bm, b, h), err_msg=f"b{b} h{h}")
    # kept on the block mask: made once, anew when the mask mod is replaced
    assert at_block_size(bm, (128, 128)) is coarse
    bm.mask_mod = mods.causal()
    again = at_block_size(bm, (128, 128))
    assert again is not coarse
    np.testing.assert_array_equal(_elements(again, 1, 2), _elements(bm, 1, 2))
    assert at_block_size(coarse, (128, 128)) is coarse


def test_coarse_states_take_full_and_empty_only_where_every_fine_tile_does():
    states = np.array([[[[FULL, FULL, EMPTY, EMPTY], [FULL, PARTIAL, EMPTY, EMPTY]]]], dtype=np.int8)
    bm = BlockMask(states, (128, 256), (64, 64), None)
    coarse = at_block_size(bm, (128, 128))
    np.testing.assert_array_equal(coarse.block_states()[0, 0], [[PARTIAL, EMPTY]])
    states[0, 0, 1, 1] = FULL
    coarse = at_block_size(BlockMask(states, (128, 256), (64, 64), None), (128, 128))
    np.testing.assert_array_equal(coarse.block_states()[0, 0], [[FULL, EMPTY]])


def test_a_block_mask_from_its_mask_alone_is_built_anew_from_the_mask():
    """``from_mask``: the mask itself at the kernels' tiles (so its structure — a band, the
    diagonal — still plans the kernels), built once per block mask."""
    from flexattn import create_block_mask

    doc = mods.document(DOC) & mods.causal()
    fine = create_block_mask(doc, 2, None, 400, 400, BLOCK_SIZE=(64, 32))
    coarse = at_block_size(fine, (128, 128))
    assert coarse.from_mask and coarse.BLOCK_SIZE == (128, 128) and coarse.mask_mod is fine.mask_mod
    np.testing.assert_array_equal(coarse.block_states(),
                                  create_block_mask(doc, 2, None, 400, 400, BLOCK_SIZE=128).block_states())
    assert at_block_size(fine, (128, 128)) is coarse
    for b in range(2):
        np.testing.assert_array_equal(_elements(coarse, b, 0), _elements(fine, b, 0))


@pytest.mark.parametrize("fine", [(64, 64), (32, 128), (256, 64), (512, 256), (16, 32)])
def test_whole_number_ratios_take_array_operations_with_the_same_states(fine):
    """The reshaping path (ratios 2, 4, 8, 1/2, ...) gives the tile-by-tile path's states,
    and a 128k sequence at BLOCK_SIZE 64 (4M tiles) takes well under a second."""
    import time

    from flexattn.blockmask.coarsen import _coarse_states, _coarse_states_by_tile

    rng = np.random.default_rng(fine[0] * 7 + fine[1])
    for q_len, kv_len in ((1000, 777), (1024, 1024), (129, 3000)):
        shape = (2, 3, -(-q_len // fine[0]), -(-kv_len // fine[1]))
        states = rng.choice([EMPTY, PARTIAL, FULL], size=shape, p=[0.45, 0.1, 0.45]).astype(np.int8)
        np.testing.assert_array_equal(_coarse_states(states, fine, (128, 128), (q_len, kv_len)),
                                      _coarse_states_by_tile(states, fine, (128, 128), (q_len, kv_len)))
    states = rng.choice([EMPTY, PARTIAL, FULL], size=(1, 1, 2048, 2048)).astype(np.int8)
    start = time.perf_counter()
    _coarse_states(states, (64, 64), (128, 128), (131072, 131072))
    assert time.perf_counter() - start < 1.0


def test_a_copy_binding_the_same_captures_finds_the_coarse_block_mask_again():
    """Call paths that copy a block mask to put this call's captures back (the registry
    under torch.compile, JAX's templates) find the coarse one again while the tile states
    and the captured values are the same objects; other captures make another."""
    import copy

    states = np.random.default_rng(3).choice([EMPTY, PARTIAL, FULL], size=(1, 2, 7, 7)).astype(np.int8)
    ids = np.repeat(np.arange(4), 100).astype(np.int32)
    bm = BlockMask(states, (400, 400), (64, 64), mods.document(ids))
    coarse = at_block_size(bm, (128, 128))
    again = copy.copy(bm)
    again.mask_mod = mods.document(ids)         # the same structure and capture objects
    assert at_block_size(again, (128, 128)) is coarse
    other = copy.copy(bm)
    other.mask_mod = mods.document(ids.copy())  # another capture: another coarse mask, its own table mask
    assert at_block_size(other, (128, 128)) is not coarse
