"""The mod language: trace, compose and interpret attention variants."""
from . import ir, ops
from .builtins import (
    alibi, alibi_slopes, and_masks, bias, causal, document, document_from_lengths, document_from_offsets,
    document_ids_from_offsets, full, noop_mask, or_masks, prefix_lm, relative_bias, sliding_window, softcap,
)
from .mod import MaskMod, Mod, ScoreMod, as_mask, as_score, mask_mod, score_mod
from .trace import TraceError
from . import positions  # noqa: E402 (needs the mods above)

__all__ = [
    "ir", "ops", "positions", "Mod", "MaskMod", "ScoreMod", "mask_mod", "score_mod", "as_mask", "as_score",
    "TraceError", "full", "causal", "sliding_window", "document", "document_from_offsets",
    "document_from_lengths", "document_ids_from_offsets", "prefix_lm", "alibi", "alibi_slopes",
    "softcap", "relative_bias", "bias", "and_masks", "or_masks", "noop_mask",
]
