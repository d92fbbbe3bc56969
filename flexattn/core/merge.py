"""The log-sum-exp merge of a partial attention result on the GPU: context parallelism
folds each shard pair's (out, lse) into the rank's result with it, one pass over the rows
the pair attended (``kernels/merge``)."""

from __future__ import annotations

from .kernel_path import use_tvm_ffi


def merge_partial_into(acc, lse, out_j, lse_j, stream: int) -> None:
    """In place: ``acc`` [B, H, S, Dv] (fp32, or the partial's dtype) and ``lse`` [B, H, S]
    (fp32) become the merge of themselves and the partial ``out_j`` (bf16 / fp16) /
    ``lse_j`` (fp32), launched on ``stream`` (a CUstream handle; TVM-FFI launches take the
    framework's current stream, which must be it)."""
    from ..kernels.launch.merge import merge_partial

    merge_partial(acc, lse, out_j, lse_j, tvm_ffi=use_tvm_ffi(), stream=stream)
