"""Slicing a block mask by an index that lives on the GPU (gpt-fast's eager step:
``block_mask[:, :, input_pos // 128]``, ``BlockMask._device_rows``): the states are indexed
on the device and the lists compacted there when read — the index never comes to the
host. Emulated here with arrays that say they live on CUDA (DLPack) and count every copy
to the host, and a GPU builder that compacts on the host; the torch route over such a
slice (``flexattn.torch.ops._row_walk_call``) runs in tests/gpu/test_short_query_gpu.py."""

import numpy as np
import pytest

from flexattn import mods
from flexattn.blockmask import BlockMask, DeviceArrays, create_block_mask, register_device
from flexattn.blockmask.device import _DEVICE_RESOLVERS, _GPU_BUILDER, GpuBuilder, register_gpu_builder
from flexattn.blockmask.layout import _LIST_NAMES, PARTIAL, FULL, _lists


class OnCuda:
    """An array that says it lives on cuda:0; ``get()`` (to_numpy's way off a device)
    counts its copies to the host."""

    host_copies = 0

    def __init__(self, a):
        self.a = np.asarray(a)

    def __dlpack_device__(self):
        return (2, 0)

    @property
    def dtype(self):
        return self.a.dtype

    @property
    def shape(self):
        return self.a.shape

    def reshape(self, *shape):
        return OnCuda(self.a.reshape(*shape))

    def __getitem__(self, index):
        index = tuple(i.a if isinstance(i, OnCuda) else i for i in (index if isinstance(index, tuple) else (index,)))
        return OnCuda(self.a[index])

    def get(self):
        OnCuda.host_copies += 1
        return self.a.copy()


class HostCompaction(GpuBuilder):
    """The GPU builder's compaction, on the host, over ``OnCuda`` states."""

    def compact(self, states, arrays):
        s = states.a
        partial, full = s == PARTIAL, s == FULL
        lists = (*_lists(partial), *_lists(full), *_lists(partial.swapaxes(-1, -2)), *_lists(full.swapaxes(-1, -2)))
        return {name: OnCuda(x) for name, x in zip(_LIST_NAMES, lists)}


@pytest.fixture
def fake_cuda():
    def resolve(device):
        if str(device) != "cuda:0":
            return None
        return DeviceArrays(device="cuda:0", stream=0, empty=None, to_device=lambda x: OnCuda(np.array(x)))

    builders = list(_GPU_BUILDER)
    register_device(resolve)
    register_gpu_builder(HostCompaction())
    OnCuda.host_copies = 0
    try:
        yield
    finally:
        _DEVICE_RESOLVERS.remove(resolve)
        _GPU_BUILDER[:] = builders


@pytest.mark.parametrize("mask,batch", [(mods.causal(), 1), (mods.sliding_window(200), 1),
                                        (mods.causal() & mods.document(np.repeat([[0, 1], [0, 0]], 512, 1)), 2)])
def test_rows_by_a_device_index_stay_on_the_device(fake_cuda, mask, batch):
    """Each row sliced by a device index has the host slice's states and lists; the index
    and the states never come to the host on the way, and the slice keeps its source."""
    L = 1024
    parent = create_block_mask(mask, batch, None, L, L, BLOCK_SIZE=128)
    assert parent.device == "cpu"
    for row in (0, 3, 7, -1):
        sliced = parent[:, :, OnCuda(np.array([row]) if row >= 0 else np.array(row))]
        assert OnCuda.host_copies == 0, "the index or the states came to the host"
        assert sliced._row_source[0] is parent and isinstance(sliced._device_states, OnCuda)
        want = parent[:, :, [row % 8]]
        np.testing.assert_array_equal(sliced._device_states.a, want.block_states())
        for name in _LIST_NAMES[:4]:   # compacted when first read, on the "device"
            np.testing.assert_array_equal(sliced.list_array(name).a, want.list_array(name))
        assert OnCuda.host_copies == 0
        assert sliced.shape == (batch, 1, L, L) and sliced.num_blocks == (1, 8)
        with pytest.raises(ValueError, match="mask_mod is unset"):
            sliced.mask_mod
        np.testing.assert_array_equal(sliced.block_states(), want.block_states())   # host states on demand
        assert OnCuda.host_copies == 1
        OnCuda.host_copies = 0
    # The host-built parent's states went to the device once, for all its slices.
    assert list(parent.__dict__["_device_copies"]) == ["cuda:0"]


def test_device_slice_with_ints_and_head_slices(fake_cuda):
    """Ints keep their dimension (as torch's slicing does); slices of batch and head dims
    combine with the device index; an int out of range is an IndexError before anything
    runs."""
    parent = create_block_mask(mods.causal(), 2, 4, 512, 512, BLOCK_SIZE=128)
    sliced = parent[1, 1:3, OnCuda(np.array([2, 0]))]
    np.testing.assert_array_equal(sliced._device_states.a, parent[1, 1:3, [2, 0]].block_states())
    assert sliced._row_source[1][:2] == (slice(1, 2), slice(1, 3))
    with pytest.raises(IndexError, match="out of range"):
        parent[2, :, OnCuda(np.array([0]))]


def test_device_slice_falls_back_to_the_host(fake_cuda):
    """Two device indices (their host meaning is dim by dim), an index on a device no
    builder serves, of another framework than the builder's arrays, or unsigned: the host
    path, as before."""
    parent = create_block_mask(mods.causal(), 2, 1, 512, 512, BLOCK_SIZE=128)
    both = parent[OnCuda(np.array([1])), :, OnCuda(np.array([2]))]
    assert both._row_source is None and OnCuda.host_copies == 2
    np.testing.assert_array_equal(both.block_states(), parent[[1], :, [2]].block_states())

    class OtherGpu(OnCuda):
        def __dlpack_device__(self):
            return (2, 1)

    other = parent[:, :, OtherGpu(np.array([3]))]
    assert other._row_source is None and OnCuda.host_copies == 3

    class OtherFramework(OnCuda):   # (a CuPy index while torch's adapter serves the device)
        pass

    OtherFramework.__module__ = "cupy"
    foreign = parent[:, :, OtherFramework(np.array([1]))]
    assert foreign._row_source is None and OnCuda.host_copies == 4
    np.testing.assert_array_equal(foreign.block_states(), parent[:, :, [1]].block_states())
    # an unsigned index array (torch reads uint8 ones as masks): not a device row index
    unsigned = parent[:, :, OnCuda(np.array([2], np.uint8))]
    assert unsigned._row_source is None and OnCuda.host_copies == 5


def test_gpu_built_parent_slices_its_own_device_states(fake_cuda):
    """A GPU-built mask (its states on the device) slices them in place: no copy of them."""
    host = create_block_mask(mods.sliding_window(300), 1, 1, 1024, 1024, BLOCK_SIZE=128)
    arrays = {"states": OnCuda(host.block_states()), **{n: OnCuda(host.list_array(n)) for n in _LIST_NAMES}}
    parent = BlockMask._on_device(arrays, host.seq_lengths, host.BLOCK_SIZE, host.mask_mod, "cuda:0")
    sliced = parent[:, :, OnCuda(np.array([5]))]
    assert "_device_copies" not in parent.__dict__ and OnCuda.host_copies == 0
    np.testing.assert_array_equal(sliced._device_states.a, host[:, :, [5]].block_states())


@pytest.mark.parametrize("separate_full", [True, False])
def test_row_walks_of_every_row(separate_full):
    """``flexattn.torch.ops._row_walks``: every row of a mask walked at once (what the eager
    device-row route indexes) lists, per row, the blocks the host walk table lists (full
    first, then partial) with the same lengths."""
    torch = pytest.importorskip("torch")
    import flexattn.torch as fa
    import flexattn.torch.ops as fa_ops

    L, block = 1024, 128
    docs = np.repeat([[0, 1, 1, 2], [0, 0, 1, 1]], L // 4, 1)
    for mask, batch in ((mods.causal(), 1), (mods.sliding_window(200), 1), (mods.causal() & mods.document(docs), 2)):
        parent = fa.create_block_mask(mask, batch, None, L, L, BLOCK_SIZE=block, separate_full_blocks=separate_full)
        tables, lengths = fa_ops._row_walks(parent, torch.device("cpu"))
        assert fa_ops._row_walks(parent, torch.device("cpu"))[0] is tables   # once per mask and device
        for b in range(batch):
            for row in range(L // block):
                table, counts, _ = parent[b, :, row].kv_block_table(1)
                n = int(counts[0])
                assert int(lengths[b, 0, row]) == n * block
                if separate_full:   # (else every block is listed partial: any order serves)
                    assert tables[b, 0, row, :n].tolist() == table[0, :n].tolist()
                else:
                    assert sorted(tables[b, 0, row, :n].tolist()) == sorted(table[0, :n].tolist())
    # Per-head rows: the walks of the picked head only (memory bounded by the slice, not the mask)
    heads = fa.create_block_mask(lambda b, h, q, kv: (q >= kv) & (q - kv <= 100 + 300 * h), 1, 2, L, L,
                                 BLOCK_SIZE=block, separate_full_blocks=separate_full)
    tables, lengths = fa_ops._row_walks(heads, torch.device("cpu"), (slice(None), slice(1, 2)))
    assert tuple(tables.shape[:3]) == (1, 1, L // block)
    for row in range(L // block):
        table, counts, _ = heads[:, 1, row].kv_block_table(1)
        n = int(counts[0])
        assert int(lengths[0, 0, row]) == n * block
        assert sorted(tables[0, 0, row, :n].tolist()) == sorted(table[0, :n].tolist())
