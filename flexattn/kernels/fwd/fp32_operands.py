"""The operands the fp32 forward reads (kernels/fwd/sm90.py, ``dtype="fp32"``), made on the GPU.

tf32 wgmmas read both operands K-major, so P V needs V^T (keys contiguous), and the S
accumulator feeds P straight in as the A operand only if the keys of each group of 8 are
stored in the order a thread's accumulator columns map to A columns: position p of a group
holds key 2 (p % 4) + p // 4 (``mma.acc_as_tf32_a_view``). With 3xTF32 every operand also
comes as two tf32 parts, hi = round(x) and lo = round(x - hi), stacked along the batch dim
(batch b's lo part at b + B).

``Fp32Operands(OperandsConfig(head_dim, transpose, parts))`` launches one kernel:
- ``transpose`` (V): [B, H, S, D] → [parts * B, H, D, S8] (S8 = S rounded up to 8; keys
  past S are zeros), in 32 x 32 tiles through shared memory so reads and writes are both
  coalesced;
- otherwise (Q, K under 3xTF32): [B, H, S, D] → [2 * B, H, S, D] (hi, lo).
The memory traffic is a few passes over the inputs, next to the O(S²) attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from flexattn.kernels.hopper import mma

TILE = 32      # keys x head-dim columns per transposed tile
THREADS = 256  # 8 warps: each moves 4 rows of a tile
ROWS = 32      # rows (S) per CTA of the untransposed split


def key_order(p: int) -> int:
    """The key at position ``p`` of V^T's 8-key groups (host mirror of the kernel's order)."""
    return p // 8 * 8 + 2 * (p % 4) + p % 8 // 4


@dataclass(frozen=True)
class OperandsConfig:
    head_dim: int
    transpose: bool   # V: V^T with keys permuted; else Q / K parts
    parts: int        # 1 (tf32: hi only, rounded) or 2 (3xTF32: hi, lo)

    def __post_init__(self):
        if self.parts not in (1, 2) or (not self.transpose and self.parts == 1):
            raise ValueError("parts must be 2, or 1 for the transpose (Q and K need no pass of their own)")

    def key(self) -> tuple:
        return ("fp32_operands", self.head_dim, self.transpose, self.parts)


def padded_keys(seqlen: int) -> int:
    return -(-seqlen // 8) * 8


def operand_passes(fwd_cfg) -> tuple:
    """(source, ``OperandsConfig``) of each pass the fp32 forward of ``fwd_cfg`` needs, in
    the order its adapters launch them: "v" (V^T), then with 3xTF32 "q" and "k" (parts)."""
    parts = fwd_cfg.operand_parts
    passes = (("v", OperandsConfig(fwd_cfg.head_dim_v, True, parts)),)
    if parts == 2:
        passes += (("q", OperandsConfig(fwd_cfg.head_dim, False, 2)), ("k", OperandsConfig(fwd_cfg.head_dim, False, 2)))
    return passes


def operand_shape(cfg: OperandsConfig, x_shape) -> tuple:
    """The shape of a pass's output for an input [B, H, S, D]."""
    b, h, s, d = (int(n) for n in x_shape)
    if cfg.transpose:
        return (cfg.parts * b, h, d, padded_keys(s))
    return (2 * b, h, s, d)


class Fp32Operands:
    def __init__(self, cfg: OperandsConfig):
        self.cfg = cfg

    @cute.jit
    def __call__(self, mX: cute.Tensor, mOut: cute.Tensor, stream):
        b, h, s, d = mX.shape
        if const_expr(self.cfg.transpose):
            grid = [(mOut.shape[3] + TILE - 1) // TILE, (d + TILE - 1) // TILE, b * h]
        else:
            grid = [(s + ROWS - 1) // ROWS, 1, b * h]
        self.kernel(mX, mOut).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mOut: cute.Tensor):
        n_b, n_h, seqlen, d = mX.shape
        bx, by, bz = cute.arch.block_idx()
        b, h = bz // n_h, bz % n_h
        tidx = cute.arch.thread_idx()[0]
        if const_expr(self.cfg.transpose):
            self._transpose_tile(mX, mOut, b, h, bx * TILE, by * TILE, seqlen, n_b, tidx)
        else:
            self._split_rows(mX, mOut, b, h, bx * ROWS, seqlen, n_b, tidx)

    @cute.jit
    def _store(self, mOut, b, n_b, idx, x: Float32):
        hi = mma.round_tf32(x)
        mOut[(b, *idx)] = hi
        if const_expr(self.cfg.parts == 2):
            mOut[(b + n_b, *idx)] = mma.round_tf32(x - hi)

    @cute.jit
    def _split_rows(self, mX, mOut, b, h, s0, seqlen, n_b, tidx):
        D = self.cfg.head_dim
        for i in cutlass.range(tidx, ROWS * D, THREADS, unroll=1):
            s = s0 + i // D
            c = i % D
            if s < seqlen:
                self._store(mOut, b, n_b, (h, s, c), Float32(mX[b, h, s, c]))

    @cute.jit
    def _transpose_tile(self, mX, mOut, b, h, k0, d0, seqlen, n_b, tidx):
        D = self.cfg.head_dim
        smem = cutlass.utils.SmemAllocator()
        # (dims, keys) with a padded row: the column reads below hit 32 different banks.
        tile = smem.allocate_tensor(Float32, cute.make_layout((TILE, TILE + 1), stride=(TILE + 1, 1)), 16)
        warp, lane = tidx // 32, tidx % 32
        for i in cutlass.range_constexpr(TILE * 32 // THREADS):
            key = warp + i * (THREADS // 32)
            x = Float32(0.0)
            if k0 + key < seqlen and d0 + lane < D:
                x = Float32(mX[b, h, k0 + key, d0 + lane])    # a warp reads one row's 32 dims
            tile[lane, key] = x
        cute.arch.sync_threads()
        padded = mOut.shape[3]
        # Output position `lane` of the tile holds key key_order(lane).
        src = lane // 8 * 8 + 2 * (lane % 4) + lane % 8 // 4
        for i in cutlass.range_constexpr(TILE * 32 // THREADS):
            dim = warp + i * (THREADS // 32)
            if d0 + dim < D and k0 + lane < padded:
                self._store(mOut, b, n_b, (h, d0 + dim, k0 + lane), tile[dim, src])   # one row of V^T
