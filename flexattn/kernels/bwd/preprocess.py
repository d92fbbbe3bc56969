"""Backward preprocess: per (batch, head, query row), before the main backward kernel.

    delta[q]    = sum_d dO[q, d] * O[q, d]  (- dLSE[q] when the LSE output has a gradient)
    lse_log2[q] = LSE[q] * log2(e)           (+inf for empty rows, LSE = -inf, and for the
                                              padding rows q >= Q_LEN: P = exp2(.. - inf) = 0)
    dq_accum[q, :] = 0                       (the main kernel only adds into it; dq_first_store: only
                                              where LSE[q] = -inf, the rows of tiles no CTA visits)
    dq_semaphore[tile] = 0                   (deterministic mode, dq_finish, dq_first_store: one per
                                              tile_m-row q tile)
    dQ[q, :] = 0 where LSE[q] = -inf         (dq_finish: the main kernel stores the dQ rows of the
                                              tiles it visits; a tile none visits has only empty rows)
    grad_fixed = 0                           (deterministic mode with buffer grads: the
                                              128-bit accumulators, grid-stride)

Workspaces are [B, H, Sq_pad(, D)] fp32 with Sq_pad a multiple of `BwdConfig.q_pad`, so the
main kernel's TMA boxes and atomics never leave them and never need bound checks.
Why dLSE enters delta: d lse / d s' = P, so dS' = P * (dP - delta + dLSE).

One CTA = one q tile (`BwdConfig.tile_m` rows) of one (batch, head); D/8 threads share a
row (16-byte chunks each) and reduce with warp shuffles.
"""

import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64, const_expr

from flexattn.kernels.hopper.atomics import FIXED_WORDS

LOG2_E = math.log2(math.e)


class RowChunkKernel:
    """Geometry of the preprocess: one CTA = one q tile (tile_m rows) of one (batch, head);
    a power of two of threads share a row of O / dO (their sum is a butterfly shuffle),
    each owning a chunk of whole 16-byte runs: Dv/8 threads of one run at value head dims
    64 and 128; at 96, 4 threads of three runs; at 80, 2 of five. The same threads zero
    the row's D fp32 dq_accum columns (D/threads each)."""

    num_threads = 128

    def __init__(self, config):
        self.cfg = config
        self.dtype = config.cutlass_dtype
        self.rows_per_cta = config.tile_m   # a preprocess CTA zeroes one tile's dQ flag
        runs = config.head_dim_v * self.dtype.width // 128   # 16-byte runs per O / dO row
        # the largest power of two dividing them, at most a warp (the shuffle reduction)
        self.threads_per_row = min(runs & -runs, 32)
        self.chunk = config.head_dim_v // self.threads_per_row   # O / dO elements per thread and row
        self.dq_chunk = config.head_dim // self.threads_per_row  # dq_accum columns zeroed per thread
        self.rows_per_pass = self.num_threads // self.threads_per_row
        assert self.rows_per_cta % self.rows_per_pass == 0


@cute.jit
def grid_stride(tidx, num_threads):
    """(first index, stride) of this thread in a loop spread over the whole grid."""
    bx, by, bz = cute.arch.block_idx()
    gx, gy, gz = cute.arch.grid_dim()
    return ((bz * gy + by) * gx + bx) * num_threads + tidx, gx * gy * gz * num_threads


@cute.jit
def zero_grid_stride(mGradFixed: cute.Tensor, tidx, num_threads: cutlass.Constexpr):
    start, step = grid_stride(tidx, num_threads)
    for i in cutlass.range(start, mGradFixed.shape[0], step, unroll=1):
        for w in cutlass.range_constexpr(FIXED_WORDS):
            mGradFixed[i, w] = Int64(0)


class BwdPreprocess(RowChunkKernel):

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdLSE,
                 mLSElog2: cute.Tensor, mDelta: cute.Tensor, mdQacc: cute.Tensor,
                 mdQsem, mdQ, mGradFixed, stream: cuda.CUstream):
        """mO, mdO [B, H, Sq, D]; mLSE (natural log) and mdLSE (or None) [B, H, Sq] fp32;
        outputs mLSElog2, mDelta [B, H, Sq_pad], mdQacc [B, H, Sq_pad, D] fp32, and (or
        None) mdQsem [B, H, Sq_pad / tile_m] int32, mGradFixed [N, FIXED_WORDS] int64, zeroed;
        mdQ [B, H, Sq, D] (iff cfg.dq_finish): its empty rows zeroed."""
        for t in (mO, mdO) + ((mdQ,) if const_expr(mdQ is not None) else ()):
            if const_expr(t.element_type != self.dtype):
                raise TypeError(f"expected {self.dtype}, got {t.element_type}")
        if const_expr(self.cfg.dq_finish != (mdQ is not None)):
            raise ValueError("dq must be given iff cfg.dq_finish")
        grid = (mLSElog2.shape[2] // self.rows_per_cta, mO.shape[1], mO.shape[0])
        self.kernel(mO, mdO, mLSE, mdLSE, mLSElog2, mDelta, mdQacc, mdQsem, mdQ, mGradFixed).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdLSE,
               mLSElog2: cute.Tensor, mDelta: cute.Tensor, mdQacc: cute.Tensor,
               mdQsem, mdQ, mGradFixed):
        tidx = cute.arch.thread_idx()[0]
        m_block, head, batch = cute.arch.block_idx()
        if const_expr(self.cfg.pdl):
            # The main kernel (a programmatic dependent) may take SMs as this grid drains;
            # it waits for this grid to finish before reading what it writes.
            cute.arch.griddepcontrol_launch_dependents()
        if const_expr(mdQsem is not None):
            # One CTA per q tile: the main kernel's dQ turn flag of this tile.
            if tidx == 0:
                mdQsem[batch, head, m_block] = 0
        if const_expr(mGradFixed is not None):
            zero_grid_stride(mGradFixed, tidx, self.num_threads)
        seqlen = mO.shape[2]
        tpr = self.threads_per_row
        chunk = tidx % tpr
        passes = self.rows_per_cta // self.rows_per_pass
        # Every load of the CTA's rows is issued before any store: the zeroing stores to
        # dq_accum may alias O / dO as far as the compiler knows, so loads interleaved with
        # them would wait one memory latency per pass (1.8 TB/s measured; FA4's 2.6).
        # Padding rows (row >= seqlen) read the last row and their results are discarded.
        loaded = []
        for p in cutlass.range_constexpr(passes):
            row = cutlass.min(m_block * self.rows_per_cta + p * self.rows_per_pass + tidx // tpr, seqlen - 1)
            o = cute.local_tile(mO[batch, head, row, None], (self.chunk,), (chunk,))
            do = cute.local_tile(mdO[batch, head, row, None], (self.chunk,), (chunk,))
            dlse = mdLSE[batch, head, row] if const_expr(mdLSE is not None) else None
            loaded.append((o.load(), do.load(), mLSE[batch, head, row], dlse))
        for p in cutlass.range_constexpr(passes):
            row = m_block * self.rows_per_cta + p * self.rows_per_pass + tidx // tpr
            o, do, lse, dlse = loaded[p]
            prod = o.to(Float32) * do.to(Float32)
            dot = prod.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            dot = cute.arch.warp_reduction_sum(dot, threads_in_group=tpr)
            dq = cute.local_tile(mdQacc[batch, head, row, None], (self.dq_chunk,), (chunk,))
            if const_expr(self.cfg.dq_first_store):
                # The main kernel's first visit to a tile stores it; tiles no CTA visits
                # have only empty rows (as under dq_finish).
                if lse == -Float32.inf:
                    dq.fill(0.0)
            else:
                dq.fill(0.0)
            if const_expr(mdQ is not None):
                if row < seqlen and lse == -Float32.inf:
                    cute.local_tile(mdQ[batch, head, row, None], (self.dq_chunk,), (chunk,)).fill(0.0)
            if chunk == 0:
                lse_log2 = Float32.inf
                delta = Float32(0.0)
                if row < seqlen:
                    lse_log2 = Float32.inf if lse == -Float32.inf else lse * Float32(LOG2_E)
                    delta = dot
                    if const_expr(mdLSE is not None):
                        delta = dot - dlse
                mLSElog2[batch, head, row] = lse_log2
                mDelta[batch, head, row] = delta
