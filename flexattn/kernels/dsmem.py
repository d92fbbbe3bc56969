"""Reads from another CTA's shared memory in the cluster (distributed shared memory), as
inline PTX: ``mapa`` turns a shared::cta address into the same offset in CTA ``rank``'s
window, ``ld.shared::cluster`` reads it. The decode kernel's cluster merge
(`decode_sm90`) reads every split's partial row this way.

The loads are side-effecting asm on purpose: they must stay between the cluster barriers
that publish the data and retire the reads (the compiler may not move them across).
"""

from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def load_f32_in_rank(smem_ptr, rank, *, loc=None, ip=None) -> Float32:
    """The fp32 at `smem_ptr`'s offset in cluster CTA `rank`'s shared memory."""
    return Float32(llvm.inline_asm(
        T.f32(),
        [smem_ptr.toint(loc=loc, ip=ip).ir_value(), Int32(rank).ir_value(loc=loc, ip=ip)],
        "{ .reg .b32 a; mapa.shared::cluster.u32 a, $1, $2; ld.shared::cluster.f32 $0, [a]; }",
        "=f,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


@dsl_user_op
def load_f32x4_in_rank(smem_ptr, rank, *, loc=None, ip=None) -> tuple:
    """Four consecutive fp32 (16-byte aligned) at `smem_ptr`'s offset in CTA `rank`."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        [smem_ptr.toint(loc=loc, ip=ip).ir_value(), Int32(rank).ir_value(loc=loc, ip=ip)],
        "{ .reg .b32 a; mapa.shared::cluster.u32 a, $4, $5; ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [a]; }",
        "=f,=f,=f,=f,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def load_f32x2_in_rank(smem_ptr, rank, *, loc=None, ip=None) -> tuple:
    """Two consecutive fp32 (8-byte aligned) at `smem_ptr`'s offset in CTA `rank`."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 2),
        [smem_ptr.toint(loc=loc, ip=ip).ir_value(), Int32(rank).ir_value(loc=loc, ip=ip)],
        "{ .reg .b32 a; mapa.shared::cluster.u32 a, $2, $3; ld.shared::cluster.v2.f32 {$0, $1}, [a]; }",
        "=f,=f,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(2))


def load_row_in_rank(smem_ptr, rank, n: int) -> list:
    """`n` (1, 2 or 4) consecutive fp32 at `smem_ptr`'s offset in CTA `rank`, one load."""
    if n == 4:
        return list(load_f32x4_in_rank(smem_ptr, rank))
    if n == 2:
        return list(load_f32x2_in_rank(smem_ptr, rank))
    assert n == 1, n
    return [load_f32_in_rank(smem_ptr, rank)]


__all__ = ["load_f32_in_rank", "load_f32x4_in_rank", "load_f32x2_in_rank", "load_row_in_rank"]
