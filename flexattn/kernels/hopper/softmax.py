"""Online softmax over the rows of an S fragment, fp32, exp2 with the scale folded in.

State per row: the running max m (in score units) and the running sum l of
exp2((s - m) * scale_log2). A row's four lanes (a "quad") share a row; the max is
reduced across the quad each step, the sum only once at the end.

A row that has seen only -inf keeps m = -inf; the exponent then uses 0 in place of m so
that exp2(-inf) = 0 and no inf - inf appears. At the end such a row has l = 0: its output
is 0 and its LSE -inf.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from flexattn.kernels.hopper.mma import acc_mn_view

LN2 = math.log(2.0)


class OnlineSoftmax:
    """Row statistics of one thread; `scale_log2` multiplies scores inside exp2."""

    def __init__(self, scale_log2: Float32, num_rows: int, defer_o_scale: bool = False):
        self.scale_log2 = scale_log2
        self.row_max = cute.make_rmem_tensor(num_rows, Float32)
        self.row_sum = cute.make_rmem_tensor(num_rows, Float32)
        # `defer_o_scale`: the last step's row scale, held until the caller applies it to
        # O (FwdConfig.rescale_o_early); 1 where nothing is pending.
        self.o_scale = cute.make_rmem_tensor(num_rows, Float32) if defer_o_scale else None

    def reset(self):
        """State before any block: max -inf, sum 0 (needed when the first visited block
        is not known at compile time)."""
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)
        if const_expr(self.o_scale is not None):
            self.o_scale.fill(1.0)

    @cute.jit
    def step(self, acc_S: cute.Tensor, is_first: cutlass.Constexpr[bool]) -> cute.Tensor:
        """Turn the scores in `acc_S` into unnormalised probabilities (in place) and
        return, per row, the factor by which the output accumulated so far must shrink."""
        s_mn = acc_mn_view(acc_S)
        row_scale = cute.make_rmem_tensor_like(self.row_max, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            row = s_mn[r, None].load()
            m_cur = _row_max(row)
            if const_expr(not is_first):
                m_cur = cute.arch.fmax(m_cur, self.row_max[r])
            m_cur = cute.arch.warp_reduction_max(m_cur, threads_in_group=4)
            m_prev = self.row_max[r]
            self.row_max[r] = m_cur
            # Safe max for exponents: a row with nothing but -inf so far uses 0.
            m_safe = Float32(0.0) if m_cur == -Float32.inf else m_cur
            m_scaled = m_safe * self.scale_log2
            # The sum starts from the rescaled old sum: the row's O factor is then needed
            # (and computed) before its exponentials, and ptxas interleaves the O rescale
            # (FMUL) with the exp2s (MUFU) instead of running it after the last one (SASS).
            sum_init = Float32(0.0)
            if const_expr(is_first):
                row_scale[r] = Float32(1.0)
            else:
                # m_prev = -inf gives exp2(-inf) = 0: nothing accumulated yet.
                row_scale[r] = cute.math.exp2((m_prev - m_safe) * self.scale_log2, fastmath=True)
                sum_init = self.row_sum[r] * row_scale[r]
            p = cute.math.exp2(row * self.scale_log2 - m_scaled, fastmath=True)
            s_mn[r, None].store(p)
            self.row_sum[r] = p.reduce(cute.ReductionOp.ADD, sum_init, 0)
        return row_scale

    @cute.jit
    def finalize(self, exact: cutlass.Constexpr[bool] = False) -> tuple:
        """Return (per-row 1/l, or 0 for empty rows; per-row natural-log LSE, -inf for
        empty rows). `exact` (float32 "highest"): the first is l itself (1 for empty rows,
        whose O is 0) for `divide_rows`' IEEE division, and the LSE's log2 is the precise
        one: an approximate reciprocal and its multiply cost O up to ~1.5 ulp."""
        inv_sum = cute.make_rmem_tensor_like(self.row_sum, Float32)
        lse = cute.make_rmem_tensor_like(self.row_sum, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            l = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=4)
            empty = l == Float32(0.0) or l != l
            if const_expr(exact):
                inv_sum[r] = Float32(1.0) if empty else l
            else:
                inv_sum[r] = Float32(0.0) if empty else cute.arch.rcp_approx(l)
            m_scaled = self.row_max[r] * self.scale_log2
            lse[r] = (
                -Float32.inf if empty
                else (m_scaled + cute.math.log2(l, fastmath=not exact)) * Float32(LN2)
            )
        return inv_sum, lse

    @cute.jit
    def max_scores(self) -> cute.Tensor:
        """Per row, the max score in natural units of the softmax's input (the scaled,
        modded scores): the running max times scale_log2 · ln 2; -inf for a row that saw
        nothing."""
        out = cute.make_rmem_tensor_like(self.row_max, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            out[r] = self.row_max[r] * (self.scale_log2 * Float32(LN2))
        return out


def _row_max(row: cute.TensorSSA) -> Float32:
    """Max over a row of this thread's fragment (loaded as a vector): a pairwise tree
    (depth log2(cols)) of `max.f32`. A generic MAX reduce emits `max.NaN.f32`, with which
    ptxas left half of the O rescale after the exp2s (SASS). Plain Python: unrolled while
    tracing; the elements are read from the vector (one op each, where indexing the
    fragment costs several)."""
    vals = _elements(row)
    while len(vals) > 1:
        nxt = [cute.arch.fmax(vals[i], vals[i + 1]) for i in range(0, len(vals) - 1, 2)]
        if len(vals) % 2:
            nxt.append(vals[-1])
        vals = nxt
    return vals[0]


@cute.jit
def rescale_rows(acc: cute.Tensor, row_scale: cute.Tensor):
    """acc[r, :] *= row_scale[r] for an sm90 accumulator fragment."""
    acc_mn = acc_mn_view(acc)
    for r in cutlass.range_constexpr(cute.size(row_scale)):
        acc_mn[r, None].store(acc_mn[r, None].load() * row_scale[r])


@cute.jit
def divide_rows(acc: cute.Tensor, row_div: cute.Tensor):
    """acc[r, :] /= row_div[r] (IEEE division, correctly rounded) for an sm90 accumulator
    fragment."""
    acc_mn = acc_mn_view(acc)
    for r in cutlass.range_constexpr(cute.size(row_div)):
        acc_mn[r, None].store(acc_mn[r, None].load() / row_div[r])


def _elements(row: cute.TensorSSA) -> list:
    """The elements of a vector, in flat index order, as Float32 scalars."""
    from cutlass._mlir.dialects import vector

    v = row.ir_value() if hasattr(row, "ir_value") else row
    return [Float32(vector.extract(v, [], [i])) for i in range(cute.size(row.shape))]
