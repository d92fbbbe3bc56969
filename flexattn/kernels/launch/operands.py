"""The operand bundles runners take instead of long argument lists. Plain dataclasses: the
core and the adapters import them without loading CuTeDSL."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BackwardArrays:
    """The arrays of one backward call: DLPack arrays on the GPU, none requiring grad.

    ``q, k, v``: the forward's inputs; ``out`` [B, Hq, Q, D] and ``lse`` [B, Hq, Q]
    (float32, natural log): what the forward wrote for them. ``d_out``: the gradient of
    ``out`` (input dtype, head dim contiguous, other strides multiples of 8 elements);
    ``d_lse``: the gradient of ``lse`` (float32 [B, Hq, Q], contiguous) or None.
    ``dq, dk, dv``: destinations shaped like q, k, v, written entirely (None where the
    runner gets them later from its ``outputs`` callable: `FfiBackwardRunner.run`).
    """

    q: Any
    k: Any
    v: Any
    out: Any
    lse: Any
    d_out: Any
    dq: Any
    dk: Any
    dv: Any
    d_lse: Any = None
