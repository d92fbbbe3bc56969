"""Backward postprocess: dQ = softmax_scale * dq_accum, converted to the input dtype.

The main kernel accumulates dS K (without the scale) in fp32 with atomics; the scale of
dQ = scale * dS K is applied here, where it costs nothing. Rows q >= Q_LEN of the padded
workspace are dropped. One CTA = 64 rows of one (batch, head), 16-byte chunks per thread.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from flexattn.kernels.bwd_preprocess import RowChunkKernel


class BwdPostprocess(RowChunkKernel):

    @cute.jit
    def __call__(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32,
                 stream: cuda.CUstream):
        """mdQacc [B, H, Sq_pad, D] fp32 -> mdQ [B, H, Sq, D]."""
        if const_expr(mdQ.element_type != self.dtype):
            raise TypeError(f"expected {self.dtype}, got {mdQ.element_type}")
        grid = ((mdQ.shape[2] + self.rows_per_cta - 1) // self.rows_per_cta, mdQ.shape[1],
                mdQ.shape[0])
        self.kernel(mdQacc, mdQ, softmax_scale).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32):
        tidx = cute.arch.thread_idx()[0]
        m_block, head, batch = cute.arch.block_idx()
        seqlen = mdQ.shape[2]
        chunk = tidx % self.threads_per_row
        for p in cutlass.range_constexpr(self.rows_per_cta // self.rows_per_pass):
            row = m_block * self.rows_per_cta + p * self.rows_per_pass + tidx // self.threads_per_row
            if row < seqlen:
                acc = cute.local_tile(mdQacc[batch, head, row, None], (self.chunk,), (chunk,))
                out = cute.local_tile(mdQ[batch, head, row, None], (self.chunk,), (chunk,))
                out.store((acc.load() * softmax_scale).to(self.dtype))
