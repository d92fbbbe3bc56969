"""The GPU kernels behind ``create_block_mask(device=...)`` and ``varlen_block_mask(device=...)``.

The block-mask layer sits below the kernels and never imports them; this module, in the
layer that plans and launches kernels, registers itself as its GPU builder when
``flexattn.core`` is imported (``blockmask.register_gpu_builder``). Tile states come from
``kernels/blockmask/classify.py`` (interval analysis per tile, early-exit evaluation of the
undecided ones), the sorted lists from ``kernels/blockmask/compact.py``; they stay on the
GPU as the framework's arrays.
"""

from __future__ import annotations

import numpy as np

from ..arrays import to_numpy
from ..blockmask import BlockMask, DeviceArrays, GpuBuilder, register_gpu_builder
from .kernel_path import use_tvm_ffi


def _tvm_ffi(arrays: DeviceArrays) -> bool:
    """As the forward's launches (``use_tvm_ffi``): TVM-FFI where installed and its stream is
    the caller's (``arrays.tvm_ffi_stream``); ``FLEXATTN_TVM_FFI=0/1`` overrides."""
    return use_tvm_ffi(arrays)


# GPU-built masks copy their int8 tile states to the host (asynchronously) up to this size,
# for BlockMask.tile_balance and row_pairs_match (larger ones copy their per-row counts,
# for tile_balance alone): 4 MiB is B 4, H 16, 32k tokens of 128-token blocks.
STATES_COPY_BYTES = 4 << 20


def _nbytes(array) -> int:
    return int(np.prod(array.shape, dtype=np.int64))   # int8


class KernelBlockMaskBuilder(GpuBuilder):
    def build(self, mask, B, H, Q_LEN, KV_LEN, block_size, arrays: DeviceArrays,
              separate_full_blocks: bool = True) -> BlockMask:
        from ..kernels.blockmask.classify import builder_for

        qb, kvb = block_size
        builder = builder_for(mask, qb, kvb, _tvm_ffi(arrays))
        built = builder.build(mask, B, H, Q_LEN, KV_LEN, arrays, separate_full_blocks)

        def count_allowed():
            per_tile = builder.count_allowed(mask, B, H, Q_LEN, KV_LEN, arrays)
            return np.asarray(to_numpy(per_tile), dtype=np.int64).sum(axis=-1)

        block_mask = BlockMask._on_device(built, (Q_LEN, KV_LEN), (qb, kvb), mask, arrays.device, count_allowed)
        if not separate_full_blocks:
            # Full tiles are listed as partial while the states still say full: the kernels
            # must walk the partial lists (BlockMask.has_partial_tiles reads the states).
            block_mask._has_partial = True
        if arrays.download is not None:
            states = built["states"]
            if _nbytes(states) <= STATES_COPY_BYTES:   # the tile states: tile_balance(), row_pairs_match()
                block_mask._states_copy = arrays.download(states)
            else:   # the per-row tile counts alone, for tile_balance()
                block_mask._row_counts = tuple(arrays.download(built[n]) for n in ("kv_num_blocks", "full_kv_num_blocks"))
        return block_mask

    def compact(self, states, arrays: DeviceArrays) -> dict:
        from ..kernels.blockmask.classify import compact

        return compact(states, arrays, _tvm_ffi(arrays))


register_gpu_builder(KernelBlockMaskBuilder())
