"""Hopper (sm_90a) warpgroup-MMA building blocks shared by the attention kernels.

* shared-memory layouts for K-major (row-major, head-dim contiguous) tiles,
* tiled MMAs for S = Q K^T (both operands in smem) and O += P V (P in registers),
* one `gemm` that issues a chain of wgmma instructions,
* the epilogue pieces: stmatrix of a 16-bit accumulator-shaped fragment to smem, and the
  TMA store of an smem tile,
* two register *views* of an accumulator fragment: rows x cols (for softmax and the
  mods) and "operand A" (so the fp32 S fragment, converted to 16 bit, feeds PV directly).

Fragment geometry (one warpgroup, wgmma m64nNk16, fp32 accumulator): a thread holds
((2, 2, N/8), MMA_M, MMA_N) values: mode 0 is (2 adjacent columns, 2 rows 8 apart,
N/8 column groups 8 apart).
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.utils import LayoutEnum

SMEM_CAPACITY = 227 * 1024   # sm_90 shared memory per CTA (the opt-in maximum)


def smem_layout(dtype, rows: int, cols: int, stages: int | None = None, atom_cols: int | None = None):
    """Swizzled smem layout for a (rows, cols) tile whose `cols` dim is contiguous,
    optionally with a trailing stage mode. wgmma and TMA both read it. The swizzle is the
    widest whose atom divides `atom_cols` (default `cols`): an MMA that reads the tile
    MN-major in slices of `atom_cols` columns needs its atom to divide them (the
    backward's dQ = dS K splits the head dim between two warpgroups: 96 -> 48 columns)."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, atom_cols or cols), dtype
    )
    shape = (rows, cols) if stages is None else (rows, cols, stages)
    order = (0, 1) if stages is None else (0, 1, 2)
    return cute.tile_to_shape(atom, shape, order=order)


def make_qk_mma(dtype, tile_m: int, tile_n: int):
    """S[tile_m, tile_n] = Q K^T; one warpgroup per 64 rows; Q and K both K-major in smem."""
    return sm90_helpers.make_trivial_tiled_mma(
        dtype, dtype,
        warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
        cutlass.Float32,
        atom_layout_mnk=(tile_m // 64, 1, 1),
        tiler_mn=(64, tile_n),
    )


def make_pv_mma(dtype, tile_m: int, head_dim: int):
    """O[tile_m, head_dim] += P V; P from registers, V^T read MN-major from V's smem tile."""
    return sm90_helpers.make_trivial_tiled_mma(
        dtype, dtype,
        warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
        cutlass.Float32,
        atom_layout_mnk=(tile_m // 64, 1, 1),
        tiler_mn=(64, head_dim),
        a_source=warpgroup.OperandSource.RMEM,
    )


@cute.jit
def gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
         zero_init: cutlass.Constexpr[bool], wait: cutlass.Constexpr[int] = 0):
    """acc (+)= A B over all k-blocks as one committed wgmma group; `wait` >= 0 waits until
    at most that many groups are in flight, -1 returns with the group in flight."""
    warpgroup.fence()
    # A fresh atom per call: its ACCUMULATE field is mutated below.
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tCrA.shape[2])):
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if const_expr(wait >= 0):
        warpgroup.wait_group(wait)


def stmatrix_copy(tiled_mma: cute.TiledMma, dtype, tidx, transpose: bool = False, wg_cols: int = 16):
    """Thread `tidx`'s slice of the stmatrix copy that writes a 16-bit fragment shaped like
    `tiled_mma`'s accumulator to shared memory (`cute.copy(r2s, r2s.retile(frag),
    r2s.partition_D(smem_tile))`): the epilogues' and the backward's dS^T register stores.
    `transpose`: stmatrix .trans, for a tile stored with the fragment's *rows* contiguous
    (partition a `transpose_view` of it). `wg_cols`: the accumulator columns of one
    warpgroup's MMA; four 8x8 matrices per store span 16 of them, so a slice that is not a
    multiple of 16 (the backward's dQ halves at head dims 48, 80, 112) stores two at a
    time (four would write past the tile)."""
    atom = cute.make_copy_atom(
        cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=transpose, num_matrices=4 if wg_cols % 16 == 0 else 2), dtype)
    return cute.make_tiled_copy_C(atom, tiled_mma).get_slice(tidx)


def tma_store_tile(tma_atom: cute.CopyAtom, s_tile: cute.Tensor, g_tile: cute.Tensor):
    """Issue the TMA store of one (rows, cols) smem tile into the matching global tile (of
    the TMA tensor the atom was made with). One thread's call; the caller commits the bulk
    group and waits for it as it needs."""
    ts, tg = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1),
                                   cute.group_modes(s_tile, 0, 2), cute.group_modes(g_tile, 0, 2))
    cute.copy(tma_atom, ts, tg)


def transpose_view(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a (possibly swizzled) smem tensor: V (n, d, stage) -> V^T."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def select_modes(t: cute.Tensor, modes) -> cute.Tensor:
    """Tensor view with its modes reordered, e.g. [B, H, S, D] -> (S, D, H, B)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def _acc_mn_layout(acc_layout: cute.Layout) -> cute.Layout:
    # ((2, 2, V), M, N) -> ((2, M), (2, V, N)): rows first, columns second.
    col_major = cute.make_layout(acc_layout.shape)
    s, d = col_major.shape, col_major.stride
    mn = cute.make_layout(
        ((s[0][1], s[1]), (s[0][0], s[0][2], s[2])),
        stride=((d[0][1], d[1]), (d[0][0], d[0][2], d[2])),
    )
    return cute.composition(acc_layout, mn)


def acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    """View an sm90 accumulator fragment as (rows, cols) of this thread."""
    return cute.make_tensor(acc.iterator, _acc_mn_layout(acc.layout))


@cute.jit
def _acc_as_a_layout(acc_layout: cute.Layout) -> cute.Layout:
    # ((2, 2, V), M, N) -> ((2, 2, 2), M, (V/2, N)): two adjacent 8-column groups form the
    # k=16 slice a 16-bit wgmma A operand wants (V is even for every tile_n we use).
    div = cute.logical_divide(acc_layout, ((None, None, 2), None, None))
    s, d = div.shape, div.stride
    return cute.make_layout(
        ((s[0][0], s[0][1], s[0][2][0]), s[1], (s[0][2][1], s[2])),
        stride=((d[0][0], d[0][1], d[0][2][0]), d[1], (d[0][2][1], d[2])),
    )


def acc_as_a_view(acc: cute.Tensor) -> cute.Tensor:
    """View an sm90 accumulator fragment in the register layout of a wgmma A operand."""
    return cute.make_tensor(acc.iterator, _acc_as_a_layout(acc.layout))


@dsl_user_op
def _pack_pair(lo, hi, dtype, *, loc=None, ip=None) -> Int32:
    # cvt.rn.{bf16x2,f16x2}.f32 d, a, b puts a in the upper half and b in the lower one.
    kind = "bf16x2" if dtype is cutlass.BFloat16 else "f16x2"
    return Int32(llvm.inline_asm(
        T.i32(),
        [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
        f"cvt.rn.{kind}.f32 $0, $1, $2;",
        "=r,f,f",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


@cute.jit
def convert_into(dst: cute.Tensor, src: cute.Tensor):
    """dst[i] = src[i] for a 16-bit register fragment `dst` and an fp32 one of the same
    size, two elements per cvt instruction.

    Why not `dst.store(src.load().to(dtype))`: LLVM then hoists the conversion of the new
    P above the wait for the P V GEMM still reading the old P (it cannot see that
    dependence), leaving ptxas a copy of P to park in registers and a schedule that runs
    the O rescale after every exp2. The inline conversions stay where they are written."""
    dst32 = cute.recast_tensor(dst, Int32)
    for i in cutlass.range_constexpr(cute.size(dst32)):
        dst32[i] = _pack_pair(src[2 * i], src[2 * i + 1], dst.element_type)
