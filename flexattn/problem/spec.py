"""What one attention call computes, apart from its tensors: mods, block mask, scale, GQA."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from ..blockmask import BlockMask
from ..mods import MaskMod, ScoreMod, as_mask, as_score

# Stands for a capture that is an operand of each call (a framework tensor the adapter
# passes separately: an op input, a jax operand), in a spec's template.
OPERAND = object()


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

    @property
    def element_mask(self) -> MaskMod | None:
        """The mask mod applied inside tiles: the block mask's own, else ``mask``."""
        return self.block_mask.mask_mod if self.block_mask is not None else self.mask

    def template(self, is_operand, masks: bool = False) -> tuple:
        """(this spec with the score mod's captures for which ``is_operand(capture)`` holds
        replaced by ``OPERAND``, and with ``masks`` the element mask's too; those score
        captures; those mask captures). A template holds no operand alive (registries,
        traced calls); ``bind`` puts this call's values back."""
        score, score_ops = _template_mod(self.score, is_operand)
        if not masks:
            return self._with_mods(score, self.element_mask), score_ops, []
        mask, mask_ops = _template_mod(self.element_mask, is_operand)
        return self._with_mods(score, mask), score_ops, mask_ops

    def bind(self, score_values=(), mask_values=()) -> "AttentionSpec":
        """A template's ``OPERAND`` captures replaced by these values, in capture order."""
        if not score_values and not mask_values:
            return self
        return self._with_mods(_bind_mod(self.score, score_values), _bind_mod(self.element_mask, mask_values))

    def operand_slots(self) -> list:
        """Score-capture slot of each score operand of a template, in capture order."""
        return [] if self.score is None else [i for i, c in enumerate(self.score.captures) if c is OPERAND]

    def _with_mods(self, score, mask) -> "AttentionSpec":
        if self.block_mask is None:
            return AttentionSpec(score, mask, None, self.scale, self.enable_gqa)
        bm = self.block_mask
        if mask is not bm.mask_mod:
            bm = copy.copy(bm)
            bm.mask_mod = mask
        return AttentionSpec(score, None, bm, self.scale, self.enable_gqa)


def _template_mod(mod, is_operand):
    if mod is None:
        return None, []
    operands = [c for c in mod.captures if is_operand(c)]
    if not operands:
        return mod, []
    return mod.with_captures(tuple(OPERAND if is_operand(c) else c for c in mod.captures)), operands


def _bind_mod(mod, values):
    if mod is None or not values:
        return mod
    it = iter(values)
    return mod.with_captures(tuple(next(it) if c is OPERAND else c for c in mod.captures))


def lse_dtype(q) -> str:
    """The LSE's dtype name for queries like ``q``: float64 for float64, else float32 (torch's)."""
    return "float64" if str(q.dtype).replace("torch.", "") == "float64" else "float32"
