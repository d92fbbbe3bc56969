"""fp32 reductions into global memory (no return value), as PTX `red.global.add`.

`cute.arch.atomic_add` lowers to `atom.global.add.f32`, which returns the old value; the
backward never reads it, so these emit the fire-and-forget `red` form directly (and its
sm_90 two-element vector form, for two adjacent accumulator columns: half the
instructions for dQ).
"""

from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def red_add_f32(ptr, value, *, loc=None, ip=None) -> None:
    """*ptr += value (global fp32)."""
    llvm.inline_asm(
        None,
        [ptr.toint(loc=loc, ip=ip).ir_value(), Float32(value).ir_value(loc=loc, ip=ip)],
        "red.global.add.f32 [$0], $1;",
        "l,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def red_add_v2_f32(ptr, a, b, *, loc=None, ip=None) -> None:
    """ptr[0] += a, ptr[1] += b (global fp32, ptr 8-byte aligned; sm_90+)."""
    llvm.inline_asm(
        None,
        [ptr.toint(loc=loc, ip=ip).ir_value(), Float32(a).ir_value(loc=loc, ip=ip),
         Float32(b).ir_value(loc=loc, ip=ip)],
        "red.global.add.v2.f32 [$0], {$1, $2};",
        "l,f,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
