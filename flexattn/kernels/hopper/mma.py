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

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.nvgpu.warpgroup.mma import MmaF16BF16Trait, MmaOp, _cute_nvgpu_ir, _pack_shape, make_atom
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


@dataclass(frozen=True)
class MmaTF32Op(MmaOp):
    """wgmma m64nNk8 .tf32 (CuTeDSL's helpers stop at 16-bit and 8-bit inputs; the MLIR atom
    takes tf32): fp32 operands in shared memory or registers, read as tf32 (the low 13
    mantissa bits ignored), fp32 accumulator. Both operands must be K-major: PTX allows the
    transposed (MN-major) layouts for 16-bit types only."""

    descriptive_name = "warpgroup TF32 MMA Operation"

    def __init__(self, tile_n: int, a_src):
        K = cute.nvgpu.OperandMajorMode.K
        super().__init__(cutlass.TFloat32, cutlass.TFloat32, cutlass.Float32, (64, tile_n, 8), a_src, K, K)

    def _make_trait(self, *, loc=None, ip=None, **kwargs):
        shape_mnk = _pack_shape(self.shape_mnk, loc=loc, ip=ip)
        ty = _cute_nvgpu_ir.MmaAtomSM90Type.get(
            shape_mnk.type.attribute, self.a_major_mode._to_ir(), self.b_major_mode._to_ir(),
            self.a_dtype.mlir_type, self.b_dtype.mlir_type, self.acc_dtype.mlir_type, self.a_src._to_ir())
        return MmaF16BF16Trait(make_atom(ty, [cutlass.Boolean(False).ir_value(loc=loc, ip=ip)], loc=loc, ip=ip))


def _tf32_tiled_mma(tile_m: int, tile_n: int, a_src):
    return cute.make_tiled_mma(cute.make_mma_atom(MmaTF32Op(tile_n, a_src)), (tile_m // 64, 1, 1))


def make_qk_mma(dtype, tile_m: int, tile_n: int):
    """S[tile_m, tile_n] = Q K^T; one warpgroup per 64 rows; Q and K both K-major in smem
    (fp32 inputs: tf32 MMAs)."""
    if dtype is cutlass.Float32:
        return _tf32_tiled_mma(tile_m, tile_n, warpgroup.OperandSource.SMEM)
    return sm90_helpers.make_trivial_tiled_mma(
        dtype, dtype,
        warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
        cutlass.Float32,
        atom_layout_mnk=(tile_m // 64, 1, 1),
        tiler_mn=(64, tile_n),
    )


def make_pv_mma(dtype, tile_m: int, head_dim: int):
    """O[tile_m, head_dim] += P V; P from registers, V^T read MN-major from V's smem tile
    (fp32 inputs: tf32 MMAs reading a K-major V^T tile, see ``acc_as_tf32_a_view``)."""
    if dtype is cutlass.Float32:
        return _tf32_tiled_mma(tile_m, head_dim, warpgroup.OperandSource.RMEM)
    return sm90_helpers.make_trivial_tiled_mma(
        dtype, dtype,
        warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
        cutlass.Float32,
        atom_layout_mnk=(tile_m // 64, 1, 1),
        tiler_mn=(64, head_dim),
        a_source=warpgroup.OperandSource.RMEM,
    )


# 3xTF32: A B = (a_hi + a_lo)(b_hi + b_lo) without a_lo b_lo (below fp32's rounding), the
# small products first: (part of A, part of B) per pass.
SPLIT_PASSES = ((1, 0), (0, 1), (0, 0))


def k_range(tCrA, k_blocks=None) -> tuple:
    """(start, stop) of a GEMM's k-blocks: ``k_blocks``, or all of A's (a tuple: of its parts)."""
    if k_blocks is not None:
        return k_blocks
    return 0, cute.size((tCrA[0] if isinstance(tCrA, tuple) else tCrA).shape[2])


@cute.jit
def gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA, tCrB,
         zero_init: cutlass.Constexpr[bool], wait: cutlass.Constexpr[int] = 0, k_blocks: cutlass.Constexpr = None):
    """acc (+)= A B over all k-blocks (or the range ``k_blocks`` = (start, stop)) as one
    committed wgmma group; `wait` >= 0 waits until at most that many groups are in flight,
    -1 returns with the group in flight. A and B given as (hi, lo) pairs of tf32 parts:
    the three passes of ``SPLIT_PASSES``."""
    warpgroup.fence()
    # A fresh atom per call: its ACCUMULATE field is mutated below.
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    first, stop = k_range(tCrA, k_blocks)
    if const_expr(isinstance(tCrA, tuple)):
        for ia, ib in SPLIT_PASSES:
            for k in cutlass.range_constexpr(first, stop):
                cute.gemm(atom, acc, tCrA[ia][None, None, k], tCrB[ib][None, None, k], acc)
                atom.set(warpgroup.Field.ACCUMULATE, True)
    else:
        for k in cutlass.range_constexpr(first, stop):
            cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if const_expr(wait >= 0):
        warpgroup.wait_group(wait)


def add_into(acc: cute.Tensor, first: int, part: cute.Tensor):
    """acc's registers [first, first + size(part)) += part (both compact fragments), as one
    vector add over a view of acc: written element by element, ptxas moved acc's registers
    around, and in the forward's 3xTF32 P V pieces then serialized every wgmma of the kernel
    for want of registers (C7511)."""
    view = cute.make_tensor(acc.iterator + first, part.layout)
    view.store(view.load() + part.load())


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


@cute.jit
def _acc_as_tf32_a_layout(acc_layout: cute.Layout) -> cute.Layout:
    # ((2, 2, V), M, N) -> ((2, 2), M, (V, N)) with the first two modes swapped: a thread's
    # accumulator holds columns (2c, 2c+1) of rows (r, r+8) in each 8-column group, a
    # tf32 A operand rows (r, r+8) of columns (c, c+4) of each k-block of 8. Reading
    # accumulator column 2c + j as A column c + 4j works once V's keys are stored in that
    # order (kernels/fwd/fp32_operands.py: key 2(p % 4) + p // 4 at position p of each 8).
    s, d = acc_layout.shape, acc_layout.stride
    return cute.make_layout(
        ((s[0][1], s[0][0]), s[1], (s[0][2], s[2])),
        stride=((d[0][1], d[0][0]), d[1], (d[0][2], d[2])),
    )


def acc_as_tf32_a_view(acc: cute.Tensor) -> cute.Tensor:
    """View an sm90 fp32 accumulator fragment as a tf32 wgmma A operand (keys permuted
    within each 8, see ``_acc_as_tf32_a_layout``)."""
    return cute.make_tensor(acc.iterator, _acc_as_tf32_a_layout(acc.layout))


@dsl_user_op
def round_tf32(x, *, loc=None, ip=None) -> Float32:
    """x rounded to the nearest tf32 (ties away from zero), as an fp32 bit pattern."""
    bits = llvm.inline_asm(
        T.i32(), [Float32(x).ir_value(loc=loc, ip=ip)], "cvt.rna.tf32.f32 $0, $1;", "=r,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return Float32(llvm.bitcast(T.f32(), bits, loc=loc, ip=ip))


@cute.jit
def split_tf32_into(hi: cute.Tensor, src: cute.Tensor, lo):
    """hi[i] = src[i] rounded to tf32; lo[i] = src[i] - hi[i] (exact in fp32, then rounded
    to tf32) if ``lo`` is given: the two tf32 parts of a 3xTF32 product. Inline conversions, for the reason
    ``convert_into`` gives."""
    for i in cutlass.range_constexpr(cute.size(hi)):
        h = round_tf32(src[i])
        hi[i] = h
        if const_expr(lo is not None):
            lo[i] = round_tf32(src[i] - h)   # rounded: the MMA would truncate it


def pack_pair_into(dst: cute.Tensor, i: int, lo, hi):
    """Pair `i` of a 16-bit register fragment (its elements 2i and 2i + 1, as
    `convert_into` pairs them) from two fp32 values."""
    cute.recast_tensor(dst, Int32)[i] = _pack_pair(lo, hi, dst.element_type)


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
