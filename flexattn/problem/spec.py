"""What one attention call computes, apart from its tensors: mods, block mask, scale, GQA."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..blockmask import BlockMask
from ..mods import MaskMod, ScoreMod, as_mask, as_score


@dataclass(frozen=True)
class AttentionSpec:
    """Normalized call configuration shared by every backend (reference, kernels).

    ``mask`` applies element-wise when there is no ``block_mask``; with a block mask the
    tiles decide and the block mask's own ``mask_mod`` applies inside partial tiles
    (FlexAttention's semantics).
    """

    score: ScoreMod | None = None
    mask: MaskMod | None = None
    block_mask: BlockMask | None = None
    scale: float | None = None
    enable_gqa: bool = False

    @classmethod
    def from_args(cls, score_mod=None, block_mask=None, scale=None, enable_gqa=False, mask=None, score=None):
        """Accept torch's argument names (``score_mod``, ``block_mask``) and ours (``score``, ``mask``)."""
        if score_mod is not None and score is not None:
            raise TypeError("pass the score modification as score_mod= or score=, not both")
        score = score if score is not None else score_mod
        score = as_score(score, "score_mod") if score is not None else None
        if block_mask is not None and not isinstance(block_mask, BlockMask):
            raise TypeError(
                f"block_mask must be a flexattn BlockMask (from flexattn.create_block_mask), got {type(block_mask).__name__}"
            )
        mask = as_mask(mask, "mask") if mask is not None else None
        if mask is not None and block_mask is not None and mask is not block_mask.mask_mod:
            raise ValueError("pass either mask= or block_mask= (a block mask carries its own mask_mod)")
        if scale is not None:
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
                raise TypeError(f"scale must be a finite number or None, got {scale!r}")
            scale = float(scale)
        if not isinstance(enable_gqa, bool):
            raise TypeError(f"enable_gqa must be a bool, got {enable_gqa!r}")
        return cls(score, mask if block_mask is None else None, block_mask, scale, enable_gqa)

    def resolved_scale(self, head_dim: int) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(head_dim)
