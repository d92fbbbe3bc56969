"""The fp32 forward's operands (kernels/fwd/fp32_operands.py) for one call: allocated by the
adapter, written on its stream by TVM-FFI launches, in the layout ``FlashFwdSm90`` reads
with ``dtype="fp32"`` (its module doc): V^T always; with 3xTF32 also Q's and K's parts."""

from __future__ import annotations

import functools

from flexattn.kernels.fwd.fp32_operands import OperandsConfig, padded_keys
from flexattn.kernels.launch import disk_cache
from flexattn.kernels.launch.compile import compile_fp32_operands


@functools.cache
def _operands_kernel(cfg: OperandsConfig):
    return disk_cache.compiled(cfg.key(), lambda: compile_fp32_operands(cfg, tvm_ffi=True))


def fp32_operands(fwd_cfg, q, k, v, alloc) -> tuple:
    """(q, k, v) as the fp32 forward of ``fwd_cfg`` reads them. ``alloc(shape, dtype,
    zeroed)`` gives contiguous GPU arrays (``core.backward_path.Allocator``); TVM-FFI's
    stream must be the caller's (the launches read it)."""
    parts = fwd_cfg.operand_parts
    b, h_kv, s_kv, dv = (int(n) for n in v.shape)
    vt = alloc((parts * b, h_kv, dv, padded_keys(s_kv)), "float32", False)
    _operands_kernel(OperandsConfig(dv, True, parts))(v, vt)
    if parts == 1:
        return q, k, vt
    split = []
    for x in (q, k):
        out = alloc((2 * int(x.shape[0]), *(int(n) for n in x.shape[1:])), "float32", False)
        _operands_kernel(OperandsConfig(int(x.shape[3]), False, 2))(x, out)
        split.append(out)
    return split[0], split[1], vt
