"""Framework-agnostic entry points: validation, planning, backend choice, launches.

No torch, cupy or jax import may appear under ``flexattn.core``: tensors arrive through
the array protocols (shape, dtype, DLPack) and adapters own framework specifics.
"""
from ..problem import AttentionShape, AttentionSpec, check_inputs
from . import blockmask_gpu  # noqa: F401  (registers the GPU block-mask builder)
from .api import decode, flex_attention, flex_attention_backward

__all__ = ["AttentionSpec", "AttentionShape", "check_inputs", "decode", "flex_attention", "flex_attention_backward"]
