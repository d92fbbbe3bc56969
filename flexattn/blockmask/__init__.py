"""Block sparsity: FlexAttention's ``BlockMask`` layout and its builders.

| module | concept |
|---|---|
| ``layout``  | ``BlockMask``: tile states → the eight sorted index lists, views, ``from_kv_blocks`` |
| ``build``   | ``create_block_mask``: host classification (interval analysis, then elements) |
| ``varlen``  | ``varlen_block_mask``: packed documents in closed form |
| ``device``  | what a framework provides for GPU builds, and the GPU builder ``flexattn.core`` registers |
"""

from .build import create_block_mask
from .device import DeviceArrays, GpuBuilder, register_device, register_gpu_builder
from .layout import _LIST_NAMES, EMPTY, FULL, PARTIAL, BlockCounts, BlockMask
from .varlen import varlen_block_mask

__all__ = ["BlockMask", "BlockCounts", "create_block_mask", "varlen_block_mask", "DeviceArrays",
           "GpuBuilder", "register_device", "register_gpu_builder", "EMPTY", "PARTIAL", "FULL"]
