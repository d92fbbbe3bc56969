"""Merge the split-KV partial results of a decode step (see decode_sm90.py).

Split s of a row holds O_s (normalized over its own keys, fp32) and its natural-log
LSE_s. The full row is

    LSE = log(sum_s exp(LSE_s)),   O = sum_s exp(LSE_s - LSE) * O_s,

computed with the max subtracted first (exp2 with log2(e) folded in). Splits that saw no
key have LSE_s = -inf and weigh nothing; a row no split attended gets O = 0, LSE = -inf,
as in the forward. One warp per row, each lane owns D/32 consecutive columns, so every
split's row is read as one coalesced 256/512-byte segment. The kernel is tiny and
latency-bound (tens of splits x one L2 round trip each, serialized, cost ~13 µs on the
H100 at 16 splits): the LSEs are read across lanes and the partials' loop is unrolled,
so the loads of many splits overlap.
"""

import math
from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

LOG2_E = math.log2(math.e)
LN2 = math.log(2.0)
UNROLL = 8   # splits whose partial rows one lane loads before accumulating

_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}


@dataclass(frozen=True)
class CombineConfig:
    dtype: str = "bf16"     # the output O's dtype
    head_dim: int = 128     # 64 | 128
    rows_per_cta: int = 4   # one warp per row

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.head_dim not in (64, 128):
            raise ValueError(f"head_dim must be 64 or 128, got {self.head_dim}")

    def key(self) -> tuple:
        return ("decode_combine", self.dtype, self.head_dim, self.rows_per_cta)


class DecodeCombine:
    """`cute.compile(DecodeCombine(cfg), o_part, lse_part, o, lse, stream)` with
    o_part [splits, rows, D] fp32, lse_part [splits, rows] fp32, o [rows, D] (cfg.dtype),
    lse [rows] fp32 (rows = B * Hq * q_len, flattened by the caller)."""

    def __init__(self, config: CombineConfig):
        self.cfg = config
        self.dtype = _DTYPES[config.dtype]

    @cute.jit
    def __call__(self, mOPart: cute.Tensor, mLSEPart: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, stream: cuda.CUstream):
        if const_expr(mO.element_type != self.dtype):
            raise TypeError(f"expected {self.dtype}, got {mO.element_type}")
        rows = mO.shape[0]
        grid = ((rows + self.cfg.rows_per_cta - 1) // self.cfg.rows_per_cta, 1, 1)
        self.kernel(mOPart, mLSEPart, mO, mLSE).launch(
            grid=grid, block=[32 * self.cfg.rows_per_cta, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mOPart: cute.Tensor, mLSEPart: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor):
        cfg = self.cfg
        per_lane = cfg.head_dim // 32
        tidx = cute.arch.thread_idx()[0]
        bidx = cute.arch.block_idx()[0]
        lane = tidx % 32
        row = bidx * cfg.rows_per_cta + tidx // 32
        num_splits = mLSEPart.shape[0]
        if row < mO.shape[0]:
            # The LSEs: lane i reads splits i, i + 32, ... (all in flight at once, not one
            # dependent load per split), then warp-wide max and sum of weights.
            m = -Float32.inf
            for s0 in cutlass.range(0, num_splits, 32, unroll=1):
                if s0 + lane < num_splits:
                    m = cute.arch.fmax(m, Float32(mLSEPart[s0 + lane, row]))
            m = cute.arch.warp_reduction_max(m)
            acc = cute.make_rmem_tensor(per_lane, Float32)
            acc.fill(0.0)
            total = Float32(0.0)
            if m != -Float32.inf:
                m_scaled = m * Float32(LOG2_E)
                for s0 in cutlass.range(0, num_splits, 32, unroll=1):
                    if s0 + lane < num_splits:
                        total = total + cute.math.exp2(
                            Float32(mLSEPart[s0 + lane, row]) * Float32(LOG2_E) - m_scaled, fastmath=True)
                total = cute.arch.warp_reduction_sum(total)
                # Partials: unrolled so several splits' loads are in flight per lane.
                for s in cutlass.range(num_splits, unroll=UNROLL):
                    w = cute.math.exp2(Float32(mLSEPart[s, row]) * Float32(LOG2_E) - m_scaled, fastmath=True)
                    part = cute.local_tile(mOPart[s, row, None], (per_lane,), (lane,))
                    acc.store(acc.load() + part.load() * w)
            inv = Float32(0.0) if total == Float32(0.0) else Float32(1.0) / total
            out = cute.local_tile(mO[row, None], (per_lane,), (lane,))
            out.store((acc.load() * inv).to(self.dtype))
            if lane == 0:
                lse = -Float32.inf
                if total > Float32(0.0):
                    lse = m + cute.math.log2(total, fastmath=True) * Float32(LN2)
                mLSE[row] = lse


__all__ = ["CombineConfig", "DecodeCombine"]
