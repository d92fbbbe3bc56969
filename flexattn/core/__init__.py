"""Framework-agnostic entry points: validation, configuration, backend choice.

No torch, cupy or jax import may appear under ``flexattn.core``: tensors arrive through
the array protocols (shape, dtype, DLPack) and adapters own framework specifics.
"""
from .api import decode, flex_attention, flex_attention_backward
from .spec import AttentionSpec
from .validate import AttentionShape, check_inputs

__all__ = ["AttentionSpec", "AttentionShape", "check_inputs", "decode", "flex_attention", "flex_attention_backward"]
