"""The fp32 forward's operands (kernels/fwd/fp32_operands.py) for one call: allocated by the
adapter, written on its stream by TVM-FFI launches, in the layout ``FlashFwdSm90`` reads
with ``dtype="fp32"`` (its module doc): V^T always; with 3xTF32 also Q's and K's parts."""

from __future__ import annotations

import functools

from flexattn.kernels.fwd.fp32_operands import OperandsConfig, operand_passes, operand_shape
from flexattn.kernels.launch import disk_cache
from flexattn.kernels.launch.compile import compile_fp32_operands


@functools.cache
def _operands_kernel(cfg: OperandsConfig):
    return disk_cache.compiled(cfg.key(), lambda: compile_fp32_operands(cfg, tvm_ffi=True))


def fp32_operands(fwd_cfg, q, k, v, alloc) -> tuple:
    """(q, k, v) as the fp32 forward of ``fwd_cfg`` reads them. ``alloc(shape, dtype,
    zeroed)`` gives contiguous GPU arrays (``core.backward_path.Allocator``); TVM-FFI's
    stream must be the caller's (the launches read it)."""
    arrays = {"q": q, "k": k, "v": v}
    for source, cfg in operand_passes(fwd_cfg):
        out = alloc(operand_shape(cfg, arrays[source].shape), "float32", False)
        _operands_kernel(cfg)(arrays[source], out)
        arrays[source] = out
    return arrays["q"], arrays["k"], arrays["v"]
