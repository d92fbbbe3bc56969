"""Reads from another CTA's shared memory in the cluster (distributed shared memory), as
inline PTX: ``mapa`` turns a shared::cta address into the same offset in CTA ``rank``'s
window, ``ld.shared::cluster`` reads it. The decode kernel's cluster merge
(`decode.sm90`) reads every split's partial row this way.

The loads are side-effecting asm on purpose: they must stay between the cluster barriers
that publish the data and retire the reads (the compiler may not move them across).
"""

from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def load_f32s_in_rank(smem_ptr, rank, n: int, *, loc=None, ip=None) -> list:
    """`n` (1, 2 or 4) consecutive fp32 at `smem_ptr`'s offset in cluster CTA `rank`'s
    shared memory, as one (vector) load; `smem_ptr` aligned to 4 * n bytes."""
    assert n in (1, 2, 4), n
    outs = ", ".join(f"${i}" for i in range(n))
    dest, width = (outs, "") if n == 1 else (f"{{{outs}}}", f".v{n}")
    res = llvm.inline_asm(
        T.f32() if n == 1 else llvm.StructType.get_literal([T.f32()] * n),
        [smem_ptr.toint(loc=loc, ip=ip).ir_value(), Int32(rank).ir_value(loc=loc, ip=ip)],
        f"{{ .reg .b32 a; mapa.shared::cluster.u32 a, ${n}, ${n + 1}; "
        f"ld.shared::cluster{width}.f32 {dest}, [a]; }}",
        ",".join(["=f"] * n + ["r", "r"]),
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    if n == 1:
        return [Float32(res)]
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(n)]


def load_f32s_in_rank_chunked(smem_ptr, rank, n: int) -> list:
    """`n` consecutive fp32 (any count) at `smem_ptr`'s offset in CTA `rank`'s shared memory,
    in the widest vector loads that `n` and the pointer's alignment (4 * n bytes, as a
    lane's run of n columns has) allow: 8 -> two v4, 6 -> three v2, 3 or 5 -> scalars."""
    width = 4 if n % 4 == 0 else 2 if n % 2 == 0 else 1
    out = []
    for i in range(0, n, width):
        out += load_f32s_in_rank(smem_ptr + i, rank, width)
    return out


__all__ = ["load_f32s_in_rank", "load_f32s_in_rank_chunked"]
