"""Backward postprocess: dQ = softmax_scale * dq_accum, converted to the input dtype.

The main kernel accumulates dS K (without the scale) in fp32 with atomics; the scale of
dQ = scale * dS K is applied here, where it costs nothing. Rows q >= Q_LEN of the padded
workspace are dropped. One CTA = 64 rows of one (batch, head), 16-byte chunks per thread.

Deterministic mode with buffer gradients: the main kernel summed them exactly in 128-bit
fixed point (`grad_fixed`, one accumulator per gradient element, slot after slot); each is
rounded to fp32 and added to the caller's fp32 gradient array here (grid-stride over all
the gradient elements; one thread per element, so the result is deterministic).
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from flexattn.kernels.atomics import fixed128_to_f32
from flexattn.kernels.bwd_preprocess import RowChunkKernel, grid_stride


class BwdPostprocess(RowChunkKernel):

    @cute.jit
    def __call__(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32,
                 grad_args, mGradFixed, stream: cuda.CUstream):
        """mdQacc [B, H, Sq_pad, D] fp32 -> mdQ [B, H, Sq, D]. grad_args (contiguous fp32
        buffer gradients) and mGradFixed ([N, 2] int64) iff deterministic with buffer
        grads, else None."""
        if const_expr(mdQ.element_type != self.dtype):
            raise TypeError(f"expected {self.dtype}, got {mdQ.element_type}")
        if const_expr((grad_args is None) != (mGradFixed is None)):
            raise ValueError("grad_args and grad_fixed go together")
        grid = ((mdQ.shape[2] + self.rows_per_cta - 1) // self.rows_per_cta, mdQ.shape[1],
                mdQ.shape[0])
        self.kernel(mdQacc, mdQ, softmax_scale, grad_args, mGradFixed).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32,
               grad_args, mGradFixed):
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
        if const_expr(mGradFixed is not None):
            self._finish_grads(grad_args, mGradFixed, tidx)

    @cute.jit
    def _finish_grads(self, grad_args, mGradFixed: cute.Tensor, tidx):
        """grad[e] += fixed-point sum of element e, for every element of every slot
        (accumulator row offset + e; the runner checked the grads are contiguous)."""
        start, step = grid_stride(tidx, self.num_threads)
        offset = cutlass.Int32(0)
        for k in cutlass.range_constexpr(len(grad_args)):
            grad = grad_args[k]
            flat = cute.make_tensor(grad.iterator, cute.make_layout(cute.size(grad)))
            for e in cutlass.range(start, cute.size(grad), step, unroll=1):
                flat[e] = flat[e] + fixed128_to_f32(mGradFixed.iterator + 2 * (offset + e))
            offset = offset + cute.size(grad)
