"""Merge one partial attention result into a running one by log-sum-exp, in place.

Context parallelism computes a query shard's attention in pieces (one launch per K/V
shard and chunk pair) and combines them as they come. Per row, with the running ``acc``
(fp32, normalized over the keys seen so far) and ``lse``, and a piece's ``out`` (the
kernel's dtype) and ``lse_j``:

    new = log(exp(lse) + exp(lse_j)),   acc = exp(lse - new) acc + exp(lse_j - new) out.

One warp per row. The row's two LSEs are read first, and the bulk of the row only where
it is needed: a row the piece did not attend (``lse_j`` = -inf: a document on another
rank, a pair's masked half) costs two 4-byte reads and nothing else; a row attended for
the first time (``lse`` = -inf) is copied without reading ``acc``. So a merge costs memory
traffic in proportion to the rows the piece attended, where torch elementwise ops read and
write every row of the range (documents16 on 2 H100s, 2026-11-27: the merges took a fifth
of the forward's time).
"""

import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from flexattn.kernels.decode.combine import lane_columns

LOG2_E = math.log2(math.e)
LN2 = math.log(2.0)


class MergePartial:
    """``__call__(acc, lse, out, lse_j, stream)``: acc [B, H, S, Dv] fp32 (or, with
    ``acc_dtype`` = ``dtype``, the result's own 16-bit rows: the last of two partials merged
    straight into the result, computed in fp32 and rounded once), lse [B, H, S] fp32, out
    [B, H, S, Dv] of ``dtype``, lse_j [B, H, S] fp32 (any strides, Dv contiguous); acc and
    lse are updated in place."""

    warps = 8   # rows per CTA

    def __init__(self, dtype: str, head_dim_v: int, acc_dtype: str = "fp32"):
        from flexattn.kernels.hopper.warp_specialized import DTYPES

        if acc_dtype not in ("fp32", dtype):
            raise ValueError(f"the merge accumulates in fp32 or in the partial's dtype {dtype}, not {acc_dtype}")
        self.dtype = DTYPES[dtype]
        self.acc_dtype = Float32 if acc_dtype == "fp32" else self.dtype
        self.head_dim_v = head_dim_v

    @cute.jit
    def __call__(self, mAcc: cute.Tensor, mLse: cute.Tensor, mOut: cute.Tensor, mLseJ: cute.Tensor,
                 stream: cuda.CUstream):
        if const_expr(mOut.element_type != self.dtype):
            raise TypeError(f"expected {self.dtype}, got {mOut.element_type}")
        if const_expr(mAcc.element_type != self.acc_dtype):
            raise TypeError(f"expected an {self.acc_dtype} accumulator, got {mAcc.element_type}")
        rows = mAcc.shape[0] * mAcc.shape[1] * mAcc.shape[2]
        self.kernel(mAcc, mLse, mOut, mLseJ).launch(
            grid=((rows + self.warps - 1) // self.warps, 1, 1), block=[32 * self.warps, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mAcc: cute.Tensor, mLse: cute.Tensor, mOut: cute.Tensor, mLseJ: cute.Tensor):
        D = self.head_dim_v
        tidx = cute.arch.thread_idx()[0]
        lane = tidx % 32
        row = cute.arch.block_idx()[0] * self.warps + tidx // 32
        heads, seq = mAcc.shape[1], mAcc.shape[2]
        if row < mAcc.shape[0] * heads * seq:
            s = row % seq
            bh = row // seq
            h = bh % heads
            b = bh // heads
            lse_j = Float32(mLseJ[b, h, s])
            if lse_j != -Float32.inf:
                lse = Float32(mLse[b, h, s])
                acc_row = mAcc[b, h, s, None]
                out = _columns(mOut[b, h, s, None], lane, D)
                if lse == -Float32.inf:
                    _store_columns(acc_row, lane, D, out)
                    if lane == 0:
                        mLse[b, h, s] = lse_j
                else:
                    m = cute.arch.fmax(lse, lse_j)
                    w0 = cute.math.exp2((lse - m) * Float32(LOG2_E), fastmath=True)
                    w1 = cute.math.exp2((lse_j - m) * Float32(LOG2_E), fastmath=True)
                    total = w0 + w1      # in [1, 2]: the larger weight is exactly 1
                    inv = Float32(1.0) / total
                    acc = _columns(acc_row, lane, D)
                    _store_columns(acc_row, lane, D, acc * (w0 * inv) + out * (w1 * inv))
                    if lane == 0:
                        mLse[b, h, s] = m + cute.math.log2(total, fastmath=True) * Float32(LN2)


@cute.jit
def _columns(row: cute.Tensor, lane: Int32, head_dim: cutlass.Constexpr[int]):
    """This lane's columns of ``row`` (``decode.combine.lane_columns``) as fp32 values
    (strided columns past the row's end read as 0)."""
    per_lane = lane_columns(head_dim)
    if const_expr(head_dim % 32 == 0):
        return cute.local_tile(row, (per_lane,), (lane,)).load().to(Float32)
    vals = cute.make_rmem_tensor(per_lane, Float32)
    for i in cutlass.range_constexpr(per_lane):
        c = lane + 32 * i
        vals[i] = cutlass.select_(c < head_dim, Float32(row[cutlass.min(c, head_dim - 1)]), Float32(0.0))
    return vals.load()


@cute.jit
def _store_columns(row: cute.Tensor, lane: Int32, head_dim: cutlass.Constexpr[int], values):
    """Store this lane's columns of ``row`` (fp32 ``values`` in ``_columns``' order)."""
    per_lane = lane_columns(head_dim)
    if const_expr(head_dim % 32 == 0):
        cute.local_tile(row, (per_lane,), (lane,)).store(values.to(row.element_type))
    else:
        vals = cute.make_rmem_tensor(per_lane, Float32)
        vals.store(values)
        for i in cutlass.range_constexpr(per_lane):
            if lane + 32 * i < head_dim:
                row[lane + 32 * i] = vals[i].to(row.element_type)


__all__ = ["MergePartial"]
