"""The exact numpy reference: forward (out, LSE) and backward (dq, dk, dv, captured-buffer
gradients) in float64 (or float32). The oracle of every kernel test and the CPU path."""

from .attention import Gradients, backward, forward

__all__ = ["forward", "backward", "Gradients"]
