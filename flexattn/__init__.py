"""flexattn: FlexAttention as a functional kernel library in CuTeDSL.

Write attention variants as small pure functions ("mods"), compose them, and run them
on fused Hopper kernels — or on the exact numpy reference on the CPU.
"""
from . import mods
from .blockmask import BlockMask, create_block_mask
from .core import AttentionSpec, decode, flex_attention, flex_attention_backward
from .problem import KVCache, PagedKVCache
from .problem.bounds import check_bounds
from .mods import MaskMod, ScoreMod, mask_mod, score_mod

__version__ = "0.1.0"
__all__ = [
    "mods", "BlockMask", "create_block_mask", "AttentionSpec", "flex_attention",
    "flex_attention_backward", "decode", "KVCache", "PagedKVCache", "MaskMod", "ScoreMod",
    "mask_mod", "score_mod", "check_bounds",
]
