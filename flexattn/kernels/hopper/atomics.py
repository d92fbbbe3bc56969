"""Global-memory reductions and flags for the backward, as inline PTX.

* `st_shared_f32`: a shared store the compiler keeps in place (not merged).
* fp32 reductions without a return value (`red.global.add`, for buffer gradients):
  `cute.arch.atomic_add` lowers to `atom.global.add.f32`, which returns the old value; the
  backward never reads it, so this emits the fire-and-forget `red` form directly.
* `bulk_add_f32`: a whole contiguous fp32 run from shared memory added into global memory
  by the TMA engine (`cp.reduce.async.bulk`), for the backward's dQ tiles.
* `bulk_load`: a contiguous run from global into shared memory by the TMA engine,
  completing on an mbarrier (the fused dQ finish reads a q tile back).
* The fused dQ finish's tile counts: `atom_add_release_s32` (returns the old count);
  `dq_first_store`'s tickets: `atom_add_acquire_s32`.
* The deterministic mode's dQ turn flags: `ld_acquire_s32` (spin reads) and
  `red_release_add_s32` (hand the turn on), the acquire / release pair of
  `cutlass::GenericBarrier` (wait_eq / arrive_inc).
* Order-independent (hence deterministic) buffer-gradient sums: `red_add_fixed` adds an
  fp32 value to a fixed-point accumulator (2^-64 resolution, |sum| < 2^63) kept as four
  int64 digit counters, with integer reductions that commute exactly and return nothing;
  `fixed_to_f32` reads one back. See `_FIXED_ADD` for the range and what is rounded.
"""

from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _f32_to_address(asm: str, ptr_constraint: str, ptr, value, loc, ip) -> None:
    """One side-effecting instruction `asm` on ($0: ptr's address, $1...: fp32 values;
    `value` one, or a tuple of them)."""
    values = value if isinstance(value, tuple) else (value,)
    llvm.inline_asm(
        None,
        [ptr.toint(loc=loc, ip=ip).ir_value()] + [Float32(v).ir_value(loc=loc, ip=ip) for v in values],
        asm,
        ptr_constraint + ",f" * len(values),
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def red_add_f32(ptr, value, *, loc=None, ip=None) -> None:
    """*ptr += value (global fp32)."""
    _f32_to_address("red.global.add.f32 [$0], $1;", "l", ptr, value, loc, ip)


@dsl_user_op
def red_add_v2_f32(ptr, x, y, *, loc=None, ip=None) -> None:
    """ptr[0] += x, ptr[1] += y (global fp32, ptr 8-byte aligned): one vector reduction
    (sm_90) instead of two."""
    _f32_to_address("red.global.add.v2.f32 [$0], {$1, $2};", "l", ptr, (x, y), loc, ip)


@dsl_user_op
def st_shared_f32(ptr, value, *, loc=None, ip=None) -> None:
    """*ptr = value (shared fp32), where the program puts it: an ordinary store may be
    merged with a neighbour's, which keeps the earlier value alive until the later one is
    ready (the backward's per-diagonal sums spilled that way)."""
    _f32_to_address("st.shared.f32 [$0], $1;", "r", ptr, value, loc, ip)


def _bulk_to_global(asm: str, gmem_ptr, smem_ptr, num_bytes: int, loc, ip) -> None:
    """One shared -> global bulk copy `asm` ($0 global, $1 shared, $2 bytes)."""
    llvm.inline_asm(
        None,
        [gmem_ptr.toint(loc=loc, ip=ip).ir_value(), smem_ptr.toint(loc=loc, ip=ip).ir_value(),
         Int32(num_bytes).ir_value(loc=loc, ip=ip)],
        asm,
        "l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def bulk_add_f32(gmem_ptr, smem_ptr, num_bytes: int, *, loc=None, ip=None) -> None:
    """gmem[i] += smem[i] for num_bytes / 4 contiguous fp32, as one asynchronous bulk copy
    (TMA engine; both addresses 16-byte aligned, num_bytes a multiple of 16). Joins the
    thread's current bulk group: commit, then `cp_async_bulk_wait_group`."""
    _bulk_to_global("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
                    gmem_ptr, smem_ptr, num_bytes, loc, ip)


@dsl_user_op
def bulk_store(gmem_ptr, smem_ptr, num_bytes: int, *, loc=None, ip=None) -> None:
    """gmem[i] = smem[i] for num_bytes contiguous bytes, as one asynchronous bulk copy
    (`bulk_add_f32`'s store twin: the first visitor of a dQ tile, BwdConfig.dq_first_store)."""
    _bulk_to_global("cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], $2;", gmem_ptr, smem_ptr, num_bytes,
                    loc, ip)


# ---------------------------------------------------------------------------- turn flags
@dsl_user_op
def ld_acquire_s32(ptr, *, loc=None, ip=None) -> Int32:
    """*ptr (global int32), with acquire semantics at GPU scope: memory operations after
    it are ordered after the writes released by the `red_release_add_s32` it observes."""
    return _load_s32("ld.acquire.gpu.global.b32 $0, [$1];", ptr, loc, ip)


@dsl_user_op
def ld_relaxed_s32(ptr, *, loc=None, ip=None) -> Int32:
    """*ptr (global int32) by a relaxed GPU-scope load: the value in L2, never a stale L1
    line; no ordering beyond the data dependencies on it."""
    return _load_s32("ld.relaxed.gpu.global.b32 $0, [$1];", ptr, loc, ip)


@dsl_user_op
def st_relaxed_s32(ptr, value, *, loc=None, ip=None) -> None:
    """*ptr = value (global int32) by a relaxed GPU-scope store: nothing comes back, so the
    thread need not wait for it (an atomic exchange returns the old value: a round trip)."""
    _s32_at("st.relaxed.gpu.global.b32 [$0], $1;", ptr, value, False, loc, ip)


def _load_s32(asm: str, ptr, loc, ip) -> Int32:
    """One int32 load `asm` ($0 the value, $1 ptr's address)."""
    return Int32(llvm.inline_asm(T.i32(), [ptr.toint(loc=loc, ip=ip).ir_value()], asm, "=r,l",
                                 has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def _s32_at(asm: str, ptr, value, returns: bool, loc, ip):
    """One int32 access `asm` (an atomic, a reduction, a store) on ptr's address ($0, or $1 after the
    result) and `value`."""
    operands = [ptr.toint(loc=loc, ip=ip).ir_value(), Int32(value).ir_value(loc=loc, ip=ip)]
    result = llvm.inline_asm(T.i32() if returns else None, operands, asm, "=r,l,r" if returns else "l,r",
                             has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return Int32(result) if returns else None


@dsl_user_op
def red_release_add_s32(ptr, value, *, loc=None, ip=None) -> None:
    """*ptr += value (global int32), with release semantics at GPU scope: the writes that
    precede it (in this thread, or in threads ordered before it by a CTA barrier: release
    is cumulative) are visible to whoever acquires the new value."""
    _s32_at("red.release.gpu.global.add.s32 [$0], $1;", ptr, value, False, loc, ip)


@dsl_user_op
def atom_add_release_s32(ptr, value, *, loc=None, ip=None) -> Int32:
    """old = *ptr; *ptr += value (global int32), release at GPU scope: the fused dQ
    finish's tile counts (bwd/sm90.py) — the writes that precede it are published with the
    new count; the finisher that sees the final count acquires with a fence."""
    return _s32_at("atom.release.gpu.global.add.s32 $0, [$1], $2;", ptr, value, True, loc, ip)


@dsl_user_op
def atom_add_acquire_s32(ptr, value, *, loc=None, ip=None) -> Int32:
    """old = *ptr; *ptr += value (global int32), acquire at GPU scope: a ticket that also
    reads the flag's published bits (what follows it is ordered after the writes released
    with the value it saw). Acquire orders only what comes after, so it does not wait for
    this thread's bulk copies in flight (a release would)."""
    return _s32_at("atom.acquire.gpu.global.add.s32 $0, [$1], $2;", ptr, value, True, loc, ip)


@dsl_user_op
def bulk_load(smem_ptr, gmem_ptr, num_bytes: int, mbar_ptr, *, loc=None, ip=None) -> None:
    """smem[i] = gmem[i] for num_bytes contiguous bytes, one asynchronous bulk copy (TMA
    engine, no tensor map; 16-byte aligned, a multiple of 16) that completes `num_bytes`
    of transactions on the mbarrier at `mbar_ptr` (arm it with expect_tx first)."""
    llvm.inline_asm(
        None,
        [smem_ptr.toint(loc=loc, ip=ip).ir_value(), gmem_ptr.toint(loc=loc, ip=ip).ir_value(),
         Int32(num_bytes).ir_value(loc=loc, ip=ip), mbar_ptr.toint(loc=loc, ip=ip).ir_value()],
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
        "r,l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def trap(*, loc=None, ip=None) -> None:
    """Abort the kernel (the launch fails with an error instead of hanging)."""
    llvm.inline_asm(None, [], "trap;", "", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


# ------------------------------------------------------------ fixed-point sums
# x (fp32) -> |x| rounded toward zero to a multiple of 2^-64 -> four 32-bit digits
# d0..d3 (|x| = sum d_i 2^(32 i - 64)), each with x's sign -> `red.add.u64` of each nonzero
# digit into its own int64 counter S_i (a 24-bit mantissa spans at most two digits, so at
# most two reductions, and none returns a value: no round trip). Integer additions
# commute, so the counters do not depend on the order; the value sum S_i 2^(32 i - 64) is
# assembled in 128 bits when read (`fixed_to_f32`). Each counter takes < 2^32 per add, so
# the sums are exact for fewer than 2^31 additions into one element while |sum| < 2^63.
# Non-finite x (inf, NaN) go to the fp32 array instead (red.add.f32, which the final
# conversion adds to): their sum (inf, -inf or NaN) does not depend on the order either.
FIXED_WORDS = 4      # int64 counters per accumulator

_FIXED_ADD = """{
.reg .pred %fx_fin, %fx_neg, %fx_nz;
.reg .f32 %fx_a, %fx_fl, %fx_fr;
.reg .b64 %fx_hi, %fx_lo, %fx_d;
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
and.b64 %fx_d, %fx_lo, 4294967295;
@%fx_neg neg.s64 %fx_d, %fx_d;
setp.ne.u64 %fx_nz, %fx_d, 0;
@%fx_nz red.global.add.u64 [$0], %fx_d;
shr.u64 %fx_d, %fx_lo, 32;
@%fx_neg neg.s64 %fx_d, %fx_d;
setp.ne.u64 %fx_nz, %fx_d, 0;
@%fx_nz red.global.add.u64 [$0+8], %fx_d;
and.b64 %fx_d, %fx_hi, 4294967295;
@%fx_neg neg.s64 %fx_d, %fx_d;
setp.ne.u64 %fx_nz, %fx_d, 0;
@%fx_nz red.global.add.u64 [$0+16], %fx_d;
shr.u64 %fx_d, %fx_hi, 32;
@%fx_neg neg.s64 %fx_d, %fx_d;
setp.ne.u64 %fx_nz, %fx_d, 0;
@%fx_nz red.global.add.u64 [$0+24], %fx_d;
}"""


@dsl_user_op
def red_add_fixed(acc_ptr, f32_ptr, value, *, loc=None, ip=None) -> None:
    """acc += value, exactly and order-independently, for a fixed-point accumulator at
    `acc_ptr` (global memory, 8-byte aligned: FIXED_WORDS zero-initialized int64 digit
    counters). `value` is rounded toward zero to a multiple of 2^-64 (~5e-20) and its
    magnitude clamped below 2^63. Non-finite values are added to the fp32 element at
    `f32_ptr` instead (`fixed_to_f32`'s caller adds the accumulator to it)."""
    llvm.inline_asm(
        None,
        [acc_ptr.toint(loc=loc, ip=ip).ir_value(), f32_ptr.toint(loc=loc, ip=ip).ir_value(),
         Float32(value).ir_value(loc=loc, ip=ip)],
        _FIXED_ADD,
        "l,l,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


# X = S0 + S1 2^32 + S2 2^64 + S3 2^96 in 128 bits (lo + carry into hi), then
# hi + lo 2^-64 through fp64 (hi signed, lo unsigned).
_FIXED_READ = """{
.reg .b64 %fx_s0, %fx_s1, %fx_s2, %fx_s3, %fx_lo, %fx_hi, %fx_t;
.reg .f64 %fx_h, %fx_l;
ld.global.b64 %fx_s0, [$1];
ld.global.b64 %fx_s1, [$1+8];
ld.global.b64 %fx_s2, [$1+16];
ld.global.b64 %fx_s3, [$1+24];
shl.b64 %fx_t, %fx_s1, 32;
shr.s64 %fx_hi, %fx_s0, 63;
add.cc.u64 %fx_lo, %fx_s0, %fx_t;
shr.s64 %fx_t, %fx_s1, 32;
addc.u64 %fx_hi, %fx_hi, %fx_t;
add.u64 %fx_hi, %fx_hi, %fx_s2;
shl.b64 %fx_t, %fx_s3, 32;
add.u64 %fx_hi, %fx_hi, %fx_t;
cvt.rn.f64.s64 %fx_h, %fx_hi;
cvt.rn.f64.u64 %fx_l, %fx_lo;
fma.rn.f64 %fx_h, %fx_l, 0d3BF0000000000000, %fx_h;
cvt.rn.f32.f64 $0, %fx_h;
}"""


@dsl_user_op
def fixed_to_f32(acc_ptr, *, loc=None, ip=None) -> Float32:
    """The value of a `red_add_fixed` accumulator, rounded to fp32 (via fp64)."""
    return Float32(llvm.inline_asm(
        T.f32(),
        [acc_ptr.toint(loc=loc, ip=ip).ir_value()],
        _FIXED_READ,
        "=f,l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    ))
