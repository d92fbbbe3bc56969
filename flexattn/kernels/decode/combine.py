"""Merge the split-KV partial results of a decode step (see decode/sm90.py).

Split s of a row holds O_s (normalized over its own keys, fp32) and its natural-log
LSE_s. The full row is

    LSE = log(sum_s exp(LSE_s)),   O = sum_s exp(LSE_s - LSE) * O_s,

computed with the max subtracted first (exp2 with log2(e) folded in). Splits that saw no
key have LSE_s = -inf and weigh nothing; a row no split attended gets O = 0, LSE = -inf,
as in the forward.

`merge_splits` merges one row with one warp: each lane owns D/32 consecutive columns, so
every split's row is read as one coalesced 256/512-byte segment. It is latency-bound
(one L2 round trip per dependent load): the LSEs are read across lanes and the partials
in chunks of loads in flight together (a serialized loop cost ~13 us on the H100 at 16
splits). The decode kernel runs it in the last split CTA of each group. A separate
combine kernel (a second launch) was measured slower on every benchmark shape — 3.3-8 us
after the decode kernel against 1.6-4.6 us for the in-kernel merge (benchmarks/RESULTS.md,
decode, 2026-11-21 21:19 UTC) — and was removed.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

LOG2_E = math.log2(math.e)
LN2 = math.log(2.0)
CHUNK = 16   # splits whose partial rows a lane has in flight at once (4 fp32 each at D 128)


@cute.jit
def merge_splits(lse_parts: cute.Tensor, o_parts: cute.Tensor, out_row: cute.Tensor, lane: Int32,
                 head_dim: cutlass.Constexpr[int]) -> Float32:
    """One warp merges one row: ``lse_parts`` [splits] and ``o_parts`` [splits, D] (fp32,
    visible to this warp) into ``out_row`` [D] (each lane its D/32 columns, in out_row's
    dtype); returns the row's natural-log LSE (-inf: no split saw a key).

    Latency is what counts (a few rows, each a handful of dependent L2 round trips): the
    partials are read CHUNK splits at a time, branch-free (indices past the last split
    are clamped and weigh 0), so a chunk's loads are in flight together; the first chunk
    is issued before the LSEs are reduced, so up to CHUNK splits cost one round trip."""
    per_lane = lane_columns(head_dim)
    num_splits = cute.size(lse_parts.shape)
    first = [_partial(o_parts, Int32(j), num_splits, lane, head_dim) for j in range(CHUNK)]
    # The LSEs across lanes (lane i: splits i, i + 32, ...): warp max, then sum of weights
    # (the second pass re-reads from L1). m_safe: 0 when no split saw a key, so every
    # weight is exp2(-inf) = 0 and no -inf - -inf appears.
    m = -Float32.inf
    for s0 in cutlass.range(0, num_splits, 32, unroll=1):
        if s0 + lane < num_splits:
            m = cute.arch.fmax(m, Float32(lse_parts[s0 + lane]))
    m = cute.arch.warp_reduction_max(m)
    m_safe = log2_shift(m)
    total = Float32(0.0)
    for s0 in cutlass.range(0, num_splits, 32, unroll=1):
        if s0 + lane < num_splits:
            total = total + cute.math.exp2(Float32(lse_parts[s0 + lane]) * Float32(LOG2_E) - m_safe, fastmath=True)
    total = cute.arch.warp_reduction_sum(total)

    acc = cute.make_rmem_tensor(per_lane, Float32)
    acc.fill(0.0)
    for j in cutlass.range_constexpr(CHUNK):
        acc.store(acc.load() + first[j] * _weight(lse_parts, Int32(j), num_splits, m_safe))
    for s0 in cutlass.range(CHUNK, num_splits, CHUNK, unroll=1):
        parts = [_partial(o_parts, s0 + j, num_splits, lane, head_dim) for j in range(CHUNK)]
        for j in cutlass.range_constexpr(CHUNK):
            acc.store(acc.load() + parts[j] * _weight(lse_parts, s0 + j, num_splits, m_safe))
    inv, lse = inverse_and_lse(m, total)
    if const_expr(head_dim % 32 == 0):
        out = cute.local_tile(out_row, (per_lane,), (lane,))
        out.store((acc.load() * inv).to(out_row.element_type))
    else:
        for i in cutlass.range_constexpr(per_lane):
            if lane + 32 * i < head_dim:
                out_row[lane + 32 * i] = (acc[i] * inv).to(out_row.element_type)
    return lse


def lane_columns(head_dim: int) -> int:
    """Columns of a merged row each of a warp's 32 lanes owns: D/32 contiguous ones, or, for
    head dims that are not multiples of 32, ceil(D/32) strided by 32 (lane + 32 i, the
    last ones past D masked)."""
    return head_dim // 32 if head_dim % 32 == 0 else -(-head_dim // 32)


@cute.jit
def log2_shift(m: Float32) -> Float32:
    """The exponent offset of a row whose splits' largest natural-log LSE is `m`: m *
    log2(e), or 0 when no split saw a key (m = -inf), so every weight exp2(LSE_s * log2(e)
    - shift) is 0 and no -inf - -inf appears."""
    return Float32(0.0) if m == -Float32.inf else m * Float32(LOG2_E)


@cute.jit
def inverse_and_lse(m: Float32, total: Float32):
    """(1 / total or 0, the row's natural-log LSE or -inf) from the max `m` and the sum of
    weights `total` (relative to `log2_shift(m)`): a row no split attended gets O = 0 and
    LSE = -inf."""
    inv = Float32(0.0) if total == Float32(0.0) else Float32(1.0) / total
    lse = -Float32.inf
    if total > Float32(0.0):
        lse = m + cute.math.log2(total, fastmath=True) * Float32(LN2)
    return inv, lse


def _partial(o_parts, s, num_splits, lane, head_dim: int):
    """This lane's columns (``lane_columns``) of split s's partial (s clamped to the last
    split; strided columns past D read column D - 1 and count as 0)."""
    row = o_parts[cutlass.min(s, num_splits - 1), None]
    per_lane = lane_columns(head_dim)
    if head_dim % 32 == 0:
        return cute.local_tile(row, (per_lane,), (lane,)).load()
    vals = cute.make_rmem_tensor(per_lane, Float32)
    for i in range(per_lane):
        c = lane + 32 * i
        vals[i] = cutlass.select_(c < head_dim, Float32(row[cutlass.min(c, head_dim - 1)]), Float32(0.0))
    return vals.load()


def _weight(lse_parts, s, num_splits, m_safe):
    """exp2(LSE_s * log2(e) - m_safe) for s < num_splits, else 0 (a clamped read)."""
    w = cute.math.exp2(Float32(lse_parts[cutlass.min(s, num_splits - 1)]) * Float32(LOG2_E) - m_safe, fastmath=True)
    return cutlass.select_(s < num_splits, w, Float32(0.0))


__all__ = ["lane_columns", "merge_splits", "log2_shift", "inverse_and_lse"]
