"""Backward postprocess: dQ = softmax_scale * dq_accum, converted to the input dtype.

The main kernel's dQ writer warp adds dS K (without the scale) into the fp32 workspace
`dq_accum` one tile_m-row tile at a time, each tile in *fragment order*
(`bwd.sm90.dq_tile_layout`: the consumer threads' accumulator registers, 16 bytes per
thread in turn, so that the tile leaves shared memory as two contiguous bulk adds). Here
one CTA = one tile of one (batch, head), with the main kernel's two consumer warpgroups'
geometry: thread t reads back exactly the registers consumer thread t held (the same
128-bit copy), scales and converts them, writes them to shared memory with stmatrix at
the coordinates the dQ MMA gave them (tile_m 80: the MMA computed dQ^T, so a transposing
stmatrix), and one TMA store writes the tile (rows >= Q_LEN of the last tile are clipped
by the TMA unit).

Deterministic mode with buffer gradients: the main kernel summed them exactly in fixed
point (`grad_fixed`, one accumulator per gradient element, slot after slot); each is
rounded to fp32 and added to the caller's fp32 gradient array here (grid-stride over all
the gradient elements; one thread per element, so the result is deterministic).
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import cpasync

from flexattn.kernels.hopper import mma
from flexattn.kernels.hopper.atomics import FIXED_WORDS, fixed_to_f32
from flexattn.kernels.bwd.preprocess import grid_stride
from flexattn.kernels.bwd.sm90 import (FlashBwdSm90, dq_fragment_copy, dq_slice_atom, dq_splits_rows, dq_tile_layout,
                                       make_dq_mma)


class BwdPostprocess:

    num_wg = FlashBwdSm90.num_mma_wg     # the geometry the main kernel wrote dq_accum in
    num_threads = 128 * num_wg

    def __init__(self, config):
        self.cfg = config
        self.dtype = config.cutlass_dtype
        # The main kernel's warpgroups split dQ's rows (each holds all of D), or its head dim.
        self.rows_split = dq_splits_rows(config.tile_m, self.num_wg, config.dq_swap_ab)

    @cute.jit
    def __call__(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32,
                 grad_args, mGradFixed, stream: cuda.CUstream):
        """mdQacc [B, H, Sq_pad, D] fp32 (contiguous, tiles in fragment order) -> mdQ
        [B, H, Sq, D]. grad_args (contiguous fp32 buffer gradients) and mGradFixed
        ([N, FIXED_WORDS] int64) iff deterministic with buffer grads, else None."""
        cfg = self.cfg
        if const_expr(mdQ.element_type != self.dtype):
            raise TypeError(f"expected {self.dtype}, got {mdQ.element_type}")
        if const_expr((grad_args is None) != (mGradFixed is None)):
            raise ValueError("grad_args and grad_fixed go together")
        tm, D = cfg.tile_m, cfg.head_dim
        dQ = mma.select_modes(mdQ, [2, 3, 1, 0])          # (S, D, H, B)
        dQacc = mma.select_modes(mdQacc, [2, 3, 1, 0])
        tiled_mma = make_dq_mma(self.dtype, tm, D, self.num_wg, cfg.dq_swap_ab)
        s_layout = mma.smem_layout(self.dtype, tm, D, atom_cols=None if self.rows_split else dq_slice_atom(D, self.num_wg))
        tma_atom, tma_dQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), dQ, s_layout, (tm, D))

        @cute.struct
        class SharedStorage:
            sdQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(s_layout)], 1024]

        grid = ((dQ.shape[0] + tm - 1) // tm, dQ.shape[2], dQ.shape[3])
        self.kernel(dQacc, tma_dQ, tma_atom, tiled_mma, s_layout, softmax_scale, grad_args,
                    mGradFixed, SharedStorage).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream, use_pdl=cfg.pdl)

    @cute.kernel
    def kernel(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, tma_atom: cute.CopyAtom,
               tiled_mma: cute.TiledMma, s_layout: cute.ComposedLayout, softmax_scale: Float32,
               grad_args, mGradFixed, SharedStorage: cutlass.Constexpr):
        cfg = self.cfg
        tm, D = cfg.tile_m, cfg.head_dim
        tidx = cute.arch.thread_idx()[0]
        m_block, head, batch = cute.arch.block_idx()
        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        sdQ = storage.sdQ.get_tensor(s_layout.outer, swizzle=s_layout.inner)
        if const_expr(cfg.pdl):
            cute.arch.griddepcontrol_wait()   # launched as the main kernel's dependent: dq_accum done

        # Registers of consumer thread tidx, in the order its dQ fragment holds them
        # (swapped: a dQ^T fragment).
        swap = cfg.dq_swap_ab
        acc_shape = (D, tm) if const_expr(swap) else (tm, D)
        acc = cute.make_rmem_tensor(tiled_mma.get_slice(tidx).partition_shape_C(acc_shape), Float32)
        tile = cute.local_tile(mdQacc[None, None, head, batch], (tm, D), (m_block, 0))
        src = dq_fragment_copy(self.num_wg).get_slice(tidx).partition_S(
            cute.make_tensor(tile.iterator, dq_tile_layout(cfg, self.num_wg)))
        cute.autovec_copy(src, cute.make_tensor(acc.iterator, cute.make_layout(src.shape)))
        rdQ = cute.make_rmem_tensor_like(acc, self.dtype)
        rdQ.store((acc.load() * softmax_scale).to(self.dtype))

        # dQ^T fragments go in transposed (stmatrix .trans on the (D, tm) view of sdQ).
        r2s = mma.stmatrix_copy(tiled_mma, self.dtype, tidx, transpose=swap,
                                wg_cols=D if const_expr(self.rows_split) else D // self.num_wg)
        cute.copy(r2s, r2s.retile(rdQ),
                  r2s.partition_D(mma.transpose_view(sdQ) if const_expr(swap) else sdQ))
        cute.arch.fence_view_async_shared()          # generic-proxy writes -> TMA reads
        cute.arch.barrier()
        if tidx // 32 == 0:
            gdQ = cute.local_tile(mdQ[None, None, head, batch], (tm, D), (m_block, 0))
            mma.tma_store_tile(tma_atom, sdQ, gdQ)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
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
                flat[e] = flat[e] + fixed_to_f32(mGradFixed.iterator + FIXED_WORDS * (offset + e))
            offset = offset + cute.size(grad)


class Fp32Postprocess:
    """The float32 backward's postprocess: dQ = softmax_scale * dq_accum, row by row (the
    float32 kernel, bwd/tf32_sync.py, adds into dq_accum in plain row order). One CTA = one
    tile_m-row tile of one (batch, head); each thread moves 16 bytes at a time."""

    num_threads = 128

    def __init__(self, config):
        self.cfg = config

    @cute.jit
    def __call__(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32,
                 grad_args, mGradFixed, stream: cuda.CUstream):
        if const_expr(mdQ.element_type != Float32):
            raise TypeError(f"expected Float32, got {mdQ.element_type}")
        if const_expr(grad_args is not None or mGradFixed is not None):
            raise ValueError("the float32 backward has no deterministic mode")
        tm = self.cfg.tile_m
        grid = ((mdQ.shape[2] + tm - 1) // tm, mdQ.shape[1], mdQ.shape[0])
        self.kernel(mdQacc, mdQ, softmax_scale).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32):
        tm, D = self.cfg.tile_m, self.cfg.head_dim
        tidx = cute.arch.thread_idx()[0]
        m_block, head, batch = cute.arch.block_idx()
        per_row = D // 4
        total = tm * per_row
        for c in cutlass.range_constexpr((total + self.num_threads - 1) // self.num_threads):
            idx = tidx + c * self.num_threads
            r = idx // per_row
            row = m_block * tm + r
            if idx < total and row < mdQ.shape[2]:
                col = idx - r * per_row
                src = cute.local_tile(mdQacc[batch, head, row, None], (4,), (col,))
                dst = cute.local_tile(mdQ[batch, head, row, None], (4,), (col,))
                dst.store(src.load() * softmax_scale)


def postprocess_kernel(config):
    """The postprocess for a `BwdConfig`: the float32 kernel's row order or the bf16
    kernel's fragment order."""
    return Fp32Postprocess(config) if config.dtype == "fp32" else BwdPostprocess(config)
