"""The float32 backward (issue 25): FlashAttention's backward on warp-level tf32 MMAs.

Why not the bf16 kernel's wgmma: wgmma reads tf32 operands K-major only, so every
transposed operand of the backward (Q^T and dO^T for dK / dV, K^T for dQ) would need its
own copy in shared memory, and 3xTF32 doubles each again: at head dim 128 the tiles do not
fit 227 KB (docs/KERNELS.md). `mma.sync.m16n8k8.tf32` reads its operands from registers,
loaded from shared memory by plain 32-bit loads, so one fp32 copy of each tile serves both
orientations, and the (hi, lo) tf32 parts of 3xTF32 are split in registers.

One CTA = 64 keys (tile_n) of one kv head of one batch, 8 warps, no warp
specialization. It loops over the q heads of its GQA group and, per head, over the q
blocks of `tile_m` rows (32; 64 where a head dim is not a multiple of 32) that see its
keys (the bf16 kernel's walks, bwd/q_blocks.BwdWalks: dense, causal, band, block-sparse
lists). Per visit (warps as `warp_layouts` places them):

    cp.async   the next visit's Q, dO, LSE, D into the other stage (two stages where they fit)
    S^T  = K Q^T,  dP^T = V dO^T          [64, tile_m]   warps 4 (keys) x 2 (q)
    P^T, dS^T                              the bf16 kernel's pointwise math (bwd/pointwise.py:
                                           mods, masks, score-mod derivative, buffer grads)
    P^T, dS^T -> shared memory; barrier
    dV += P^T dO,  dK += dS^T Q            [64, D]        warps 2 (keys) x 4 (head dim)
    dQ_tile = dS K -> fp32 atomics into dq_accum (plain [B, H, Sq_pad, D] rows)
    barrier

dK (x scale) and dV are stored from registers at the end (rows past KV_LEN skipped); the
postprocess (`bwd/postprocess.Fp32Postprocess`) writes dQ = scale * dq_accum.

Shared memory holds fp32 rows padded by 4 floats (`PAD`): a fragment load (8 rows x 4
columns of a warp) then hits 32 distinct banks. Where a GEMM reads a tile transposed (its K
dimension runs down the rows: dO and Q for dV / dK, K and dS for dQ), its K index is
permuted within each 8 (`_k_permuted`: logical k -> row 2 (k % 4) + (k % 8) // 4), on both
operands alike (a K permutation does not change the product), which makes those loads
conflict-free as well.

Precision: `tf32_passes` 1 rounds every operand to tf32 (cvt.rna); 3 adds the two cross
products of the (hi, lo) parts, small ones first (`mma.SPLIT_PASSES`), as the forward, and
sums the long chains in pieces (`tf32_gemm`'s promote, `FlashBwdTf32.promote`).
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp

from flexattn.kernels.hopper import mma
from flexattn.kernels.blockmask.visit import band_bounds
from flexattn.kernels.hopper.atomics import red_add_v2_f32
from flexattn.kernels.hopper.tile_scheduler import LongestFirst, TileSpace
from flexattn.kernels.emit.mod_hook import FragmentCoords
from flexattn.kernels.bwd.pointwise import BwdPointwise
from flexattn.kernels.bwd.q_blocks import BwdWalks
from flexattn.kernels.bwd.sm90 import LOG2_E, SMEM_CAPACITY, FlashBwdSm90

PAD = 4            # fp32 of padding per shared-memory row (see the module doc)
NUM_WARPS = 8


def sync_acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    """A warp-MMA (m16n8) accumulator fragment ((2 columns, 2 rows 8 apart), M, N) viewed
    as (rows, cols) of this thread: ((2, M), (2, N))."""
    layout = acc.layout
    compact = cute.make_layout(layout.shape)
    s, d = compact.shape, compact.stride
    mn = cute.make_layout(((s[0][1], s[1]), (s[0][0], s[2])),
                          stride=((d[0][1], d[1]), (d[0][0], d[2])))
    return cute.make_tensor(acc.iterator, cute.composition(layout, mn))


def padded_layout(rows: int, cols: int, stages: int | None = None) -> cute.Layout:
    """(rows, cols[, stages]) fp32, rows PAD floats longer than cols (16-byte aligned)."""
    row = cols + PAD
    if stages is None:
        return cute.make_layout((rows, cols), stride=(row, 1))
    return cute.make_layout((rows, cols, stages), stride=(row, 1, rows * row))


def _k_permuted(row_stride: int, k_extent: int):
    """The K mode of a transposed operand view: logical k -> row 2 (k % 4) + (k % 8) // 4
    + 8 (k // 8), as a (4, 2, k / 8) mode of row strides."""
    return (4, 2, k_extent // 8), (2 * row_stride, row_stride, 8 * row_stride)


def transposed_view(ptr, rows: int, cols: int, row_stride: int) -> cute.Tensor:
    """A (rows, cols) row-major tile (rows on a GEMM's K) as the (cols, rows) operand
    (N or M = cols, K = rows permuted as `_k_permuted`)."""
    k_shape, k_stride = _k_permuted(row_stride, rows)
    return cute.make_tensor(ptr, cute.make_layout((cols, k_shape), stride=(1, k_stride)))


def k_permuted_view(ptr, rows: int, cols: int, row_stride: int) -> cute.Tensor:
    """A (rows, cols) row-major tile whose *columns* are a GEMM's K, permuted as the
    transposed operand it meets (`transposed_view`)."""
    k_shape, k_stride = _k_permuted(1, cols)
    return cute.make_tensor(ptr, cute.make_layout((rows, k_shape), stride=(row_stride, k_stride)))


def shared_bytes(cfg, num_stages: int | None = None) -> int:
    """The kernel's shared memory: K, V; Q, dO, LSE, D per stage; P^T and dS^T."""
    stages = cfg.num_stages if num_stages is None else num_stages
    tm, tn, d, dv = cfg.tile_m, cfg.tile_n, cfg.head_dim, cfg.head_dim_v
    floats = (tn * (d + PAD) + tn * (dv + PAD) + stages * tm * (d + PAD + dv + PAD)
              + 2 * tn * (tm + PAD) + 2 * stages * tm)
    return 4 * floats + 1024


def default_fp32_stages(cfg) -> int:
    """Two Q / dO stages (the next visit's loads overlap this one's GEMMs) where they fit."""
    return 2 if shared_bytes(cfg, 2) <= SMEM_CAPACITY else 1


@cute.jit
def _tf32_parts(src: cute.Tensor, n: cutlass.Constexpr[int]):
    """This thread's operand values (a slice of a shared-memory partition) -> registers as
    `n` tf32 parts whose sum approximates them: part 0 rounded to tf32, each next one the
    rounded remainder (2 parts: 3xTF32's (hi, lo); 3 parts hold every bit of an fp32)."""
    x = cute.make_rmem_tensor(cute.make_layout(src.shape), Float32)
    cute.autovec_copy(src, x)
    parts = [cute.make_rmem_tensor(cute.make_layout(src.shape), cutlass.TFloat32) for _ in range(n)]
    views = [cute.recast_tensor(t, Float32) for t in parts]
    for i in cutlass.range_constexpr(cute.size(x)):
        rest = x[i]
        for j in cutlass.range_constexpr(n):
            part = mma.round_tf32(rest)
            views[j][i] = part
            if const_expr(j + 1 < n):
                rest = rest - part          # exact in fp32
    return parts


def split_pairs(passes: int) -> tuple:
    """The (A part, B part) products a GEMM sums, small ones first: one pass (0, 0);
    3xTF32 `mma.SPLIT_PASSES`."""
    if passes == 1:
        return ((0, 0),)
    return mma.SPLIT_PASSES


@cute.jit
def tf32_gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
              passes: cutlass.Constexpr[int], promote: cutlass.Constexpr[int] = 0,
              pieces: cutlass.Constexpr[int] = 1):
    """acc += A B over K, warp-level tf32 MMAs. tA (V, M, K) and tB (V, N, K): this thread's
    partitions of fp32 shared-memory operands, loaded one k-block at a time and split into
    tf32 parts in registers (`split_pairs` says which products are summed).

    `promote` > 0: every `promote` k-blocks are summed in a fresh accumulator that is then
    added into `acc` with fp32 adds. The tensor cores' own accumulation loses more than IEEE
    adds over long chains (the forward's `promote_pv`): 3xTF32's dK / dV summed over all
    the q rows in one accumulator were 20x further from float64 than torch flex's float32
    (B4 S4096, H100), which makes the "highest" precision's error no worse than flex's.

    `pieces` > 1 (with `promote`): the fresh accumulator covers 1 / pieces of acc's N
    tiles (the most up to `pieces` that divide the N tiles), the pieces one after
    another, each reloading A: beyond head dim 128 an acc-sized second accumulator spills
    (dK / dV at 192/192: 124 bytes).

    The fresh sums are added element by element: as one vector add (`mma.add_into`, which
    the forward's P V pieces need) ptxas allocated other registers here and neither the
    error nor the step's time moved (H200, 2026-11-30, docs/experiments.md)."""
    pairs = split_pairs(passes)
    n_parts = 1 if const_expr(passes == 1) else 2
    n_k = cute.size(tA.shape[2])
    chunk = promote if const_expr(promote > 0) else n_k
    n_tiles = cute.size(tB.shape[1])
    pieces = max(p for p in range(1, pieces + 1) if n_tiles % p == 0)   # (whole N tiles per piece)
    width = n_tiles // pieces
    assert pieces == 1 or promote > 0, (pieces, promote)
    for j in cutlass.range_constexpr(pieces):
        tBj = tB
        if const_expr(pieces > 1):
            tBj = _n_tiles(tB, j * width, width)
        for k0 in cutlass.range_constexpr(0, n_k, chunk):
            dst = acc
            if const_expr(promote > 0):
                dst = cute.make_rmem_tensor(cute.make_layout((acc.shape[0], acc.shape[1], width)), Float32)
                dst.fill(0.0)
            for k in cutlass.range_constexpr(k0, min(k0 + chunk, n_k)):
                a = _tf32_parts(tA[None, None, k], n_parts)
                b = _tf32_parts(tBj[None, None, k], n_parts)
                for ia, ib in pairs:
                    cute.gemm(tiled_mma, dst, a[ia], b[ib], dst)
            if const_expr(promote > 0):
                # acc is compact with N outermost: piece j is its registers [j n, (j + 1) n)
                n = cute.size(dst)
                for i in cutlass.range_constexpr(n):
                    acc[j * n + i] = acc[j * n + i] + dst[i]


def _n_tiles(t: cute.Tensor, first: int, count: int) -> cute.Tensor:
    """The (V, count, K) slice of a (V, N, K) operand partition from N tile `first` on."""
    shape, stride = t.layout.shape, t.layout.stride
    assert isinstance(shape[1], int), shape   # (a flat N mode: one stride)
    return cute.make_tensor(t.iterator + first * stride[1],
                            cute.make_layout((shape[0], count, shape[2]), stride=(stride[0], stride[1], stride[2])))


def _aligned16(t: cute.Tensor) -> cute.Tensor:
    """A global 16-byte run the compiler cannot prove aligned (the from_dlpack runner's
    views have dynamic row strides), declared aligned: the runners check that rows are
    multiples of 8 elements apart and that bases are 16-byte aligned."""
    ptr = cute.make_ptr(t.element_type, t.iterator.toint(), t.iterator.memspace, assumed_align=16)
    return cute.make_tensor(ptr, t.layout)


def warp_mma(warps_m: int, warps_n: int) -> cute.TiledMma:
    return cute.make_tiled_mma(warp.MmaTF32Op((16, 8, 8)), (warps_m, warps_n, 1))


def wide_n(cfg) -> bool:
    """Head dims that are multiples of 32 let the dK / dV / dQ GEMMs put 4 warps on the
    head dim (N tiles of 32: each warp's B operand is loaded by 2 warps instead of 4);
    others (48, 80, 112, ...) put 2 (N tiles of 16) and need tile_m 64 for dQ's."""
    return cfg.head_dim % 32 == 0 and cfg.head_dim_v % 32 == 0


def warp_layouts(cfg) -> tuple:
    """(S^T / dP^T, dK / dV, dQ) warps as (M, N): S^T [64 keys, tile_m] 4 x 2; dK / dV
    [64 keys, D] 2 x 4 (or 4 x 2, `wide_n`); dQ [tile_m, D] 2 x 4 at tile_m 32, 4 x 2 at 64."""
    md = (2, 4) if cfg.tile_m == 32 else (4, 2)
    return (4, 2), ((2, 4) if wide_n(cfg) else (4, 2)), md


class FlashBwdTf32(BwdPointwise, BwdWalks):
    """Compile with the bf16 kernel's arguments (`FlashBwdSm90.__call__`; dq_accum here in
    plain row order, dq_semaphore, dq and grad_fixed None) for a `BwdConfig(dtype="fp32")`.
    Shares the bf16 kernel's pointwise math (bwd/pointwise.py: the forward's mods
    re-applied, the score mod's derivative, buffer gradients) and q-block walks
    (bwd/q_blocks.BwdWalks)."""

    num_threads = 32 * NUM_WARPS
    acc_mn_view = staticmethod(sync_acc_mn_view)

    def __init__(self, config):
        if config.dtype != "fp32":
            raise ValueError("FlashBwdTf32 is the float32 backward")
        self.cfg = config
        self.dtype = Float32
        self.mods = config.mods

    @property
    def q_row_bytes(self) -> int:
        """What the CTAs of a kv head share per query row (the causal CTA order's L2
        sections): its Q and dO rows, its dq_accum row, LSE and D."""
        cfg = self.cfg
        return 4 * (2 * cfg.head_dim + cfg.head_dim_v) + 8

    @property
    def promote(self) -> tuple:
        """`tf32_gemm`'s promote for (S^T and dP^T, dK and dV, dQ) under 3xTF32: S^T's and
        dP^T's chains over the head dim in pieces of `BwdConfig.chain_promote` k-blocks (2
        up to head dim 128: dS = P (dP - D) cancels in rows with few keys, where one
        accumulator's truncation put dQ 4x further from float64 than flex's), dK / dV once
        per visit (their sum over every q row is the long chain) and dQ's key chain in
        pieces of `BwdConfig.dq_promote` (4). One tf32 pass rounds its operands far above
        any of these. Beyond head dim 128, dK / dV per visit in column pieces
        (`BwdConfig.dkv_pieces`), S^T / dP^T as below, and dQ's chain in one accumulator:
        second accumulators of the whole size spill there (ptxas, 256/256: 884 bytes for
        dK / dV; dQ's pieces on top of the others 164-276)."""
        cfg = self.cfg
        if cfg.tf32_passes != 3:
            return cfg.chain_promote, 0, 0
        per_visit = cfg.tile_m // 8 if cfg.dkv_pieces else 0
        dq = cfg.dq_promote if max(cfg.head_dim, cfg.head_dim_v) <= 128 else 0
        return cfg.chain_promote, per_visit, dq

    @property
    def dkv_pieces(self) -> int:
        """`tf32_gemm`'s pieces for dK / dV (`BwdConfig.dkv_pieces`; 1 where unpromoted)."""
        return max(self.cfg.dkv_pieces, 1)

    @property
    def stats_in_registers(self) -> bool:
        return False        # LSE and D are read from shared memory per column

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE: cute.Tensor, mDelta: cute.Tensor, mdQacc: cute.Tensor, mdQsem, mdQ,
                 mdK: cute.Tensor, mdV: cute.Tensor, softmax_scale: Float32, mod_args, grad_args,
                 grad_fixed, block_sparse, stream: cuda.CUstream):
        cfg = self.cfg
        for t in (mQ, mK, mV, mdO, mdK, mdV, mLSE, mDelta, mdQacc):
            if const_expr(t.element_type != Float32):
                raise TypeError(f"expected Float32, got {t.element_type}")
        if const_expr(cfg.block_sparse != (block_sparse is not None)):
            raise ValueError("block_sparse tensors must be given iff cfg.block_sparse")
        if const_expr(cfg.buffer_grads != (grad_args is not None)):
            raise ValueError("grad_args must be given iff the score mod reads float buffers")
        if const_expr(mdQsem is not None or grad_fixed is not None or mdQ is not None):
            raise ValueError("the float32 backward has no deterministic mode and no dq_finish")

        tm, tn, D, Dv, stages = cfg.tile_m, cfg.tile_n, cfg.head_dim, cfg.head_dim_v, cfg.num_stages
        sQ_layout = padded_layout(tm, D, stages)
        sdO_layout = padded_layout(tm, Dv, stages)
        sK_layout = padded_layout(tn, D)
        sV_layout = padded_layout(tn, Dv)
        sP_layout = padded_layout(tn, tm)         # P^T and dS^T: keys x q rows
        sStat_layout = cute.make_layout((tm, stages))

        @cute.struct
        class SharedStorage:
            sK: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sK_layout)], 128]
            sV: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sV_layout)], 128]
            sQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sQ_layout)], 128]
            sdO: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdO_layout)], 128]
            sP: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sP_layout)], 128]
            sdS: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sP_layout)], 128]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sStat_layout)], 128]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sStat_layout)], 128]

        self.smem_bytes = SharedStorage.size_in_bytes()
        if const_expr(self.smem_bytes > SMEM_CAPACITY):
            raise ValueError(f"float32 backward shared memory: {self.smem_bytes} bytes > {SMEM_CAPACITY} ({cfg})")

        scale_log2 = Float32(LOG2_E)
        if const_expr(not self.mods.has_score):
            scale_log2 = softmax_scale * Float32(LOG2_E)
        seqlen_k, kv_heads, batches = mK.shape[2], mK.shape[1], mK.shape[0]
        grid = ((seqlen_k + tn - 1) // tn, kv_heads, batches)
        if const_expr(cfg.order == "longest_first"):
            grid = (grid[0] * grid[1] * grid[2], 1, 1)
        nm, nd, md = warp_layouts(cfg)
        self.kernel(mQ, mK, mV, mdO, mLSE, mDelta, mdQacc, mdK, mdV,
                    warp_mma(*nm), warp_mma(*nd), warp_mma(*md),
                    sQ_layout, sdO_layout, sK_layout, sV_layout, sP_layout, sStat_layout,
                    softmax_scale, scale_log2, mod_args, grad_args, block_sparse, SharedStorage,
                    ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
               mLSE: cute.Tensor, mDelta: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
               mdV: cute.Tensor, mma_nm: cute.TiledMma, mma_nd: cute.TiledMma, mma_md: cute.TiledMma,
               sQ_layout: cute.Layout, sdO_layout: cute.Layout, sK_layout: cute.Layout,
               sV_layout: cute.Layout, sP_layout: cute.Layout, sStat_layout: cute.Layout,
               softmax_scale: Float32, scale_log2: Float32, mod_args, grad_args, block_sparse,
               SharedStorage: cutlass.Constexpr):
        cfg = self.cfg
        tm, tn, D, Dv = cfg.tile_m, cfg.tile_n, cfg.head_dim, cfg.head_dim_v
        tidx = cute.arch.thread_idx()[0]
        if const_expr(cfg.band):
            block_sparse = band_bounds(self.mods, mod_args)   # (lo, hi): BandQBlocks walks by them
        if const_expr(mod_args is None):
            mod_args = ()
        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        sK = storage.sK.get_tensor(sK_layout)
        sV = storage.sV.get_tensor(sV_layout)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sdO = storage.sdO.get_tensor(sdO_layout)
        sP = storage.sP.get_tensor(sP_layout)
        sdS = storage.sdS.get_tensor(sP_layout)
        sLSE = storage.sLSE.get_tensor(sStat_layout)
        sDelta = storage.sDelta.get_tensor(sStat_layout)

        seqlen_q, num_q_heads = mQ.shape[2], mQ.shape[1]
        seqlen_k = mK.shape[2]
        group = num_q_heads // mK.shape[1]
        if const_expr(cfg.order == "longest_first"):
            tiles = TileSpace((seqlen_k + tn - 1) // tn, mK.shape[1], mK.shape[0], seqlen_q * group)
            n_block, head_kv, batch = LongestFirst(self.q_row_bytes, last_row_first=False).tile(tiles.first, tiles)
        else:
            n_block, head_kv, batch = cute.arch.block_idx()

        # K, V of this CTA (rows past KV_LEN read the last key: finite, and masked).
        kv_first = n_block * tn
        self._load_rows(mK[batch, head_kv, None, None], sK, kv_first, seqlen_k, tidx)
        self._load_rows(mV[batch, head_kv, None, None], sV, kv_first, seqlen_k, tidx)
        cute.arch.cp_async_commit_group()

        thr_nd = mma_nd.get_slice(tidx)
        coords = FragmentCoords(mma_nm.get_slice(tidx), tn, tm, sync_acc_mn_view)
        acc_dK = cute.make_rmem_tensor(thr_nd.partition_shape_C((tn, D)), Float32)
        acc_dV = cute.make_rmem_tensor(thr_nd.partition_shape_C((tn, Dv)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        mods = self.mods
        for g in cutlass.range(group, unroll=1):
            head = head_kv * group + g
            blocks = self._q_blocks(block_sparse, batch, head, n_block, seqlen_q)
            n_masked, count = self._n_masked(blocks), blocks.count
            ctx = ((mma_nm, mma_nd, mma_md), coords, acc_dK, acc_dV, (sK, sV, sQ, sdO, sP, sdS, sLSE, sDelta),
                   mQ, mdO, mLSE, mDelta, mdQacc, n_block, head, batch, seqlen_q, seqlen_k,
                   softmax_scale, scale_log2, mod_args, grad_args, tidx)
            if count > 0:
                self._load_visit(ctx, self._m_block(blocks, 0), 0)
            for i in cutlass.range(count, unroll=1):
                stage = i % cfg.num_stages if const_expr(cfg.num_stages > 1) else 0
                if const_expr(cfg.num_stages > 1):
                    if i + 1 < count:
                        self._load_visit(ctx, self._m_block(blocks, i + 1), 1 - stage)
                        cute.arch.cp_async_wait_group(1)
                    else:
                        cute.arch.cp_async_wait_group(0)
                else:
                    if i > 0:
                        self._load_visit(ctx, self._m_block(blocks, i), 0)
                    cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()
                m_block = self._m_block(blocks, i)
                if i < n_masked:
                    # causal: the hook's mask if any (it is the causal mask), else the built-in
                    self._step(ctx, m_block, stage, mask=mods.has_mask, causal=cfg.causal and not mods.has_mask)
                else:
                    self._step(ctx, m_block, stage, mask=False, causal=False)
                cute.arch.barrier()       # sP / sdS and this stage are free again

        cute.arch.cp_async_wait_group(0)
        self._store_dk_dv(acc_dK, acc_dV, thr_nd, mdK, mdV, n_block, head_kv, batch, seqlen_k, softmax_scale)

    # --------------------------------------------------------------- the walk
    def _n_masked(self, blocks):
        """How many of a walk's visits evaluate the mask: they come first (`blocks.at`:
        the partial list, then the full one; causal: the diagonal's blocks)."""
        cfg = self.cfg
        if const_expr(cfg.block_sparse or cfg.band):
            return blocks.n_partial
        if const_expr(cfg.causal):
            return cutlass.max(cutlass.min(blocks.diag_end, blocks.n_m) - blocks.first, 0)
        return blocks.count if const_expr(self.mods.has_mask) else Int32(0)

    def _m_block(self, blocks, i):
        """The q block of visit i: the walk's own `at` (in-bounds list reads, partial list
        first), or under causal first + i (`at`'s modulo by the count costs the masked step
        registers there: 1-pass D 128 spilled 72 bytes with it, none without)."""
        if const_expr(self.cfg.causal):
            return blocks.first + i
        return blocks.at(i)

    # --------------------------------------------------------------- loads
    @cute.jit
    def _load_rows(self, src: cute.Tensor, dst: cute.Tensor, first_row, n_rows, tidx):
        """dst (rows, cols) <- src rows first_row.. (clamped to n_rows - 1), 16 bytes per
        cp.async (the caller commits)."""
        rows, cols = cute.size(dst.shape[0]), cute.size(dst.shape[1])
        per_row = cols // 4
        total = rows * per_row
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=128)
        for c in cutlass.range_constexpr((total + self.num_threads - 1) // self.num_threads):
            idx = tidx + c * self.num_threads
            if const_expr(total % self.num_threads == 0) or idx < total:
                r = idx // per_row
                col = idx - r * per_row
                row = cutlass.min(first_row + r, n_rows - 1)
                cute.copy(atom, _aligned16(cute.local_tile(src[row, None], (4,), (col,))),
                          cute.local_tile(dst[r, None], (4,), (col,)))

    @cute.jit
    def _load_stat(self, src: cute.Tensor, dst: cute.Tensor, first_row, thread):
        """tile_m fp32 of a padded workspace row (always in range) by tile_m / 4 threads."""
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=128)
        if thread >= 0 and thread < self.cfg.tile_m // 4:
            cute.copy(atom, _aligned16(cute.local_tile(src, (4,), (first_row // 4 + thread,))),
                      cute.local_tile(dst, (4,), (thread,)))

    @cute.jit
    def _load_visit(self, ctx, m_block, stage):
        """One visit's Q, dO (rows past Q_LEN read the last row), LSE and D into `stage`;
        one cp.async group."""
        (_, _, _, _, (_, _, sQ, sdO, _, _, sLSE, sDelta), mQ, mdO, mLSE, mDelta, _, _, head, batch,
         seqlen_q, _, _, _, _, _, tidx) = ctx
        tm = self.cfg.tile_m
        first = m_block * tm
        self._load_rows(mQ[batch, head, None, None], sQ[None, None, stage], first, seqlen_q, tidx)
        self._load_rows(mdO[batch, head, None, None], sdO[None, None, stage], first, seqlen_q, tidx)
        self._load_stat(mLSE[batch, head, None], sLSE[None, stage], first, tidx)
        self._load_stat(mDelta[batch, head, None], sDelta[None, stage], first, tidx - tm // 4)
        cute.arch.cp_async_commit_group()

    # --------------------------------------------------------------- one visit
    @cute.jit
    def _step(self, ctx, m_block, stage, mask: cutlass.Constexpr[bool], causal: cutlass.Constexpr[bool]):
        ((mma_nm, mma_nd, mma_md), coords, acc_dK, acc_dV, (sK, sV, sQ, sdO, sP, sdS, sLSE, sDelta),
         mQ, mdO, mLSE, mDelta, mdQacc, n_block, head, batch, seqlen_q, seqlen_k,
         softmax_scale, scale_log2, mod_args, grad_args, tidx) = ctx
        cfg = self.cfg
        tm, tn, D, Dv = cfg.tile_m, cfg.tile_n, cfg.head_dim, cfg.head_dim_v
        passes = cfg.tf32_passes
        thr_nm, thr_nd, thr_md = (m.get_slice(tidx) for m in (mma_nm, mma_nd, mma_md))
        sQs, sdOs = sQ[None, None, stage], sdO[None, None, stage]

        # S^T = K Q^T, dP^T = V dO^T
        shape_nm = thr_nm.partition_shape_C((tn, tm))
        acc_S = cute.make_rmem_tensor(shape_nm, Float32)
        acc_dP = cute.make_rmem_tensor(shape_nm, Float32)
        acc_S.fill(0.0)
        acc_dP.fill(0.0)
        chain, per_visit, chain_dq = self.promote
        tf32_gemm(mma_nm, acc_S, thr_nm.partition_A(sK), thr_nm.partition_B(sQs), passes, chain)
        tf32_gemm(mma_nm, acc_dP, thr_nm.partition_A(sV), thr_nm.partition_B(sdOs), passes, chain)

        # P^T, dS^T (unscaled: dK and dQ take the scale at the end)
        lse, delta = sLSE[None, stage], sDelta[None, stage]
        blk = (m_block, n_block, head, batch, seqlen_q, seqlen_k, softmax_scale, mod_args)
        if const_expr(self.mods.has_score):
            self._pointwise(acc_S, acc_dP, lse, delta, coords, blk, scale_log2, grad_args,
                            mask, causal, True, None)
        else:
            self._pointwise_at_edge(acc_S, None, lse, None, coords, blk, scale_log2, grad_args,
                                    mask, causal)
            self._ds_from_p(acc_S, acc_dP, delta, coords)
        cute.autovec_copy(acc_S, thr_nm.partition_C(sP))
        cute.autovec_copy(acc_dP, thr_nm.partition_C(sdS))
        cute.arch.barrier()

        # dV += P^T dO, dK += dS^T Q (K = the q rows, permuted alike in both operands)
        rows_p, rows_q, rows_do = tm + PAD, D + PAD, Dv + PAD
        tf32_gemm(mma_nd, acc_dV, thr_nd.partition_A(k_permuted_view(sP.iterator, tn, tm, rows_p)),
                  thr_nd.partition_B(transposed_view(sdOs.iterator, tm, Dv, rows_do)), passes, per_visit,
                  self.dkv_pieces)
        tf32_gemm(mma_nd, acc_dK, thr_nd.partition_A(k_permuted_view(sdS.iterator, tn, tm, rows_p)),
                  thr_nd.partition_B(transposed_view(sQs.iterator, tm, D, rows_q)), passes, per_visit,
                  self.dkv_pieces)

        # dQ tile = dS K (K = the keys, permuted alike), added into dq_accum
        acc_dQ = cute.make_rmem_tensor(thr_md.partition_shape_C((tm, D)), Float32)
        acc_dQ.fill(0.0)
        tf32_gemm(mma_md, acc_dQ, thr_md.partition_A(transposed_view(sdS.iterator, tn, tm, rows_p)),
                  thr_md.partition_B(transposed_view(sK.iterator, tn, D, rows_q)), passes, chain_dq)
        gdQ = cute.local_tile(mdQacc[batch, head, None, None], (tm, D), (m_block, 0))
        tdQ = thr_md.partition_C(gdQ)
        # Value pairs (mode 0's first level) are adjacent columns: one 8-byte reduction each.
        for i in cutlass.range_constexpr(cute.size(acc_dQ) // 2):
            red_add_v2_f32(tdQ.iterator + cute.crd2idx(2 * i, tdQ.layout), acc_dQ[2 * i], acc_dQ[2 * i + 1])

    # --------------------------------------------------------------- epilogue
    @cute.jit
    def _store_dk_dv(self, acc_dK, acc_dV, thr_nd, mdK, mdV, n_block, head_kv, batch, seqlen_k,
                     softmax_scale):
        """dK * scale and dV from registers, rows past KV_LEN skipped (8-byte stores)."""
        cfg = self.cfg
        for acc, m, d, scale in ((acc_dK, mdK, cfg.head_dim, softmax_scale),
                                 (acc_dV, mdV, cfg.head_dim_v, None)):
            g = thr_nd.partition_C(cute.local_tile(m[batch, head_kv, None, None], (cfg.tile_n, d), (n_block, 0)))
            ident = thr_nd.partition_C(cute.make_identity_tensor((cfg.tile_n, d)))
            for i in cutlass.range_constexpr(cute.size(acc)):
                if n_block * cfg.tile_n + ident[i][0] < seqlen_k:
                    g[i] = acc[i] * scale if const_expr(scale is not None) else acc[i]


def backward_kernel(config):
    """The backward main kernel for a `BwdConfig`: this float32 one or the bf16 / fp16 wgmma
    kernel (`FlashBwdSm90`)."""
    return FlashBwdTf32(config) if config.dtype == "fp32" else FlashBwdSm90(config)
