"""Global-memory reductions and flags for the backward, as inline PTX.

* fp32 reductions without a return value (`red.global.add`, for buffer gradients):
  `cute.arch.atomic_add` lowers to `atom.global.add.f32`, which returns the old value; the
  backward never reads it, so this emits the fire-and-forget `red` form directly.
* `bulk_add_f32`: a whole contiguous fp32 run from shared memory added into global memory
  by the TMA engine (`cp.reduce.async.bulk`), for the backward's dQ tiles.
* The deterministic mode's dQ turn flags: `ld_acquire_s32` (spin reads) and
  `red_release_add_s32` (hand the turn on), the acquire / release pair of
  `cutlass::GenericBarrier` (wait_eq / arrive_inc).
* Order-independent (hence deterministic) buffer-gradient sums: `red_add_fixed128` adds an
  fp32 value to a 128-bit two's-complement fixed-point accumulator (64 integer bits, 64
  fraction bits) with integer atomics, which commute exactly; `fixed128_to_f32` reads one
  back. See `red_add_fixed128` for the range and what is rounded.
"""

from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


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
def bulk_add_f32(gmem_ptr, smem_ptr, num_bytes: int, *, loc=None, ip=None) -> None:
    """gmem[i] += smem[i] for num_bytes / 4 contiguous fp32, as one asynchronous bulk copy
    (TMA engine; both addresses 16-byte aligned, num_bytes a multiple of 16). Joins the
    thread's current bulk group: commit, then `cp_async_bulk_wait_group`."""
    llvm.inline_asm(
        None,
        [gmem_ptr.toint(loc=loc, ip=ip).ir_value(), smem_ptr.toint(loc=loc, ip=ip).ir_value(),
         Int32(num_bytes).ir_value(loc=loc, ip=ip)],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        "l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


# ---------------------------------------------------------------------------- turn flags
@dsl_user_op
def ld_acquire_s32(ptr, *, loc=None, ip=None) -> Int32:
    """*ptr (global int32), with acquire semantics at GPU scope: memory operations after
    it are ordered after the writes released by the `red_release_add_s32` it observes."""
    return Int32(llvm.inline_asm(
        T.i32(),
        [ptr.toint(loc=loc, ip=ip).ir_value()],
        "ld.acquire.gpu.global.b32 $0, [$1];",
        "=r,l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


@dsl_user_op
def red_release_add_s32(ptr, value, *, loc=None, ip=None) -> None:
    """*ptr += value (global int32), with release semantics at GPU scope: the writes that
    precede it (in this thread, or in threads ordered before it by a CTA barrier: release
    is cumulative) are visible to whoever acquires the new value."""
    llvm.inline_asm(
        None,
        [ptr.toint(loc=loc, ip=ip).ir_value(), Int32(value).ir_value(loc=loc, ip=ip)],
        "red.release.gpu.global.add.s32 [$0], $1;",
        "l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def trap(*, loc=None, ip=None) -> None:
    """Abort the kernel (the launch fails with an error instead of hanging)."""
    llvm.inline_asm(None, [], "trap;", "", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


# ------------------------------------------------------------ 128-bit fixed-point sums
# x (fp32) -> round toward zero to a multiple of 2^-64 -> 128-bit two's complement
# (hi: integer part, lo: fraction * 2^64) -> lo += (atom, returns the old value: the carry
# out of lo is computed from it) and hi += hi(x) + carry (red, skipped when 0). Integer
# additions modulo 2^128 commute, so the sum does not depend on the order of the atomics.
# Non-finite x (inf, NaN) go to the fp32 array instead (red.add.f32, which the final
# conversion adds to): their sum (inf, -inf or NaN) does not depend on the order either.
_FIXED128_ADD = """{
.reg .pred %fx_fin, %fx_neg, %fx_z, %fx_c, %fx_nz;
.reg .f32 %fx_a, %fx_fl, %fx_fr;
.reg .b64 %fx_hi, %fx_lo, %fx_old, %fx_sum;
testp.finite.f32 %fx_fin, $2;
@!%fx_fin red.global.add.f32 [$1], $2;
abs.f32 %fx_a, $2;
min.f32 %fx_a, %fx_a, 0f5EFFFFFF;
selp.f32 %fx_a, %fx_a, 0f00000000, %fx_fin;
cvt.rmi.f32.f32 %fx_fl, %fx_a;
sub.f32 %fx_fr, %fx_a, %fx_fl;
mul.f32 %fx_fr, %fx_fr, 0f5F800000;
cvt.rzi.u64.f32 %fx_hi, %fx_fl;
cvt.rzi.u64.f32 %fx_lo, %fx_fr;
setp.lt.f32 %fx_neg, $2, 0f00000000;
and.pred %fx_neg, %fx_neg, %fx_fin;
@%fx_neg neg.s64 %fx_lo, %fx_lo;
@%fx_neg not.b64 %fx_hi, %fx_hi;
setp.eq.u64 %fx_z, %fx_lo, 0;
and.pred %fx_z, %fx_z, %fx_neg;
@%fx_z add.u64 %fx_hi, %fx_hi, 1;
atom.global.add.u64 %fx_old, [$0], %fx_lo;
add.u64 %fx_sum, %fx_old, %fx_lo;
setp.lt.u64 %fx_c, %fx_sum, %fx_lo;
@%fx_c add.u64 %fx_hi, %fx_hi, 1;
setp.ne.u64 %fx_nz, %fx_hi, 0;
@%fx_nz red.global.add.u64 [$0+8], %fx_hi;
}"""


@dsl_user_op
def red_add_fixed128(acc_ptr, f32_ptr, value, *, loc=None, ip=None) -> None:
    """acc += value, exactly and order-independently, for a 128-bit fixed-point
    accumulator at `acc_ptr` (global memory, 8-byte aligned: int64 lo = fraction * 2^64,
    then int64 hi = integer part, two's complement; zero-initialized). `value` is rounded
    toward zero to a multiple of 2^-64 (~5e-20) and its magnitude clamped below 2^63;
    the sum is exact while |sum| < 2^63. Non-finite values are added to the fp32 element
    at `f32_ptr` instead (`fixed128_to_f32`'s caller adds the accumulator to it)."""
    llvm.inline_asm(
        None,
        [acc_ptr.toint(loc=loc, ip=ip).ir_value(), f32_ptr.toint(loc=loc, ip=ip).ir_value(),
         Float32(value).ir_value(loc=loc, ip=ip)],
        _FIXED128_ADD,
        "l,l,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def fixed128_to_f32(acc_ptr, *, loc=None, ip=None) -> Float32:
    """The value of a `red_add_fixed128` accumulator, rounded to fp32 (via fp64)."""
    return Float32(llvm.inline_asm(
        T.f32(),
        [acc_ptr.toint(loc=loc, ip=ip).ir_value()],
        "{\n.reg .b64 %fx_lo, %fx_hi;\n.reg .f64 %fx_h, %fx_l;\n"
        "ld.global.b64 %fx_lo, [$1];\nld.global.b64 %fx_hi, [$1+8];\n"
        "cvt.rn.f64.s64 %fx_h, %fx_hi;\ncvt.rn.f64.u64 %fx_l, %fx_lo;\n"
        "fma.rn.f64 %fx_h, %fx_l, 0d3BF0000000000000, %fx_h;\n"
        "cvt.rn.f32.f64 $0, %fx_h;\n}",
        "=f,l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    ))
