"""Online softmax over the rows of an S fragment, fp32, exp2 with the scale folded in.

State per row: the running max m (in score units) and the running sum l of
exp2((s - m) * scale_log2). A row's four lanes (a "quad") share a row; the max is
reduced across the quad each step, the sum only once at the end.

A row that has seen only -inf keeps m = -inf; the exponent then uses 0 in place of m so
that exp2(-inf) = 0 and no inf - inf appears. At the end such a row has l = 0: its output
is 0 and its LSE -inf.

With a rescale threshold t (FA4's trick on Blackwell), the exponents' reference m moves
only when some row of the warp has outgrown it by more than 2^t in exp2 units; otherwise
the probabilities run up to 2^t (256 at t = 8: exact in fp32, bf16 and fp16 alike) and
the output and the sums keep their scale, so the caller skips O's rescale (one multiply
per O register) on that branch. m stays at most t above the reference by construction,
and l and O share the reference, so O / l and the LSE (m + log2 l) are unchanged.

`step_on_demand` keeps that invariant without the block's maxima: the exponentials go
against the current reference, and since each is at most its row's sum, row sums within
2^t prove every probability is; only a warp where some sum is not (or a row has no
reference yet) computes the maxima and its exponentials again.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, const_expr

from flexattn.kernels.hopper.mma import acc_as_a_view, acc_mn_view, pack_pair_into

LN2 = math.log(2.0)


class OnlineSoftmax:
    """Row statistics of one thread; `scale_log2` multiplies scores inside exp2."""

    def __init__(self, scale_log2: Float32, num_rows: int, defer_o_scale: bool = False,
                 rescale_threshold: float = 0.0, track_max: bool = False):
        self.scale_log2 = scale_log2
        # With a threshold: the exponents' reference (module docstring); else the max.
        self.row_max = cute.make_rmem_tensor(num_rows, Float32)
        self.row_sum = cute.make_rmem_tensor(num_rows, Float32)
        # `defer_o_scale`: the last step's row scale, held until the caller applies it to
        # O (FwdConfig.rescale_o_early); 1 where nothing is pending. With a threshold,
        # `o_pending` holds whether it is to be applied (1) or is all ones (0).
        self.o_scale = cute.make_rmem_tensor(num_rows, Float32) if defer_o_scale else None
        self.threshold = float(rescale_threshold)
        self.o_pending = None
        self.true_max = None
        if const_expr(self.threshold > 0.0):
            # The reference moves when a row's max exceeds it by this much in score units
            # (scale_log2 = 0 gives inf: clamped, so a reference of -inf still moves).
            self.threshold_scores = cute.arch.fmin(Float32(self.threshold) / scale_log2, Float32(3.0e38))
            if const_expr(defer_o_scale):
                self.o_pending = cute.make_rmem_tensor(1, Int32)
            # `track_max`: the true running max, for `max_scores` (the reference lags it).
            if const_expr(track_max):
                self.true_max = cute.make_rmem_tensor(num_rows, Float32)

    def o_scale_due(self):
        """Whether the deferred row scale (`o_scale`) is due: None (always) without a
        rescale threshold, else the flag the last step stored (warp-uniform: one vote)."""
        if self.o_pending is None:
            return None
        return self.o_pending[0] != Int32(0)

    def reset(self):
        """State before any block: max -inf, sum 0 (needed when the first visited block
        is not known at compile time)."""
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)
        if const_expr(self.o_scale is not None):
            self.o_scale.fill(1.0)
        if const_expr(self.o_pending is not None):
            self.o_pending.fill(0)
        if const_expr(self.true_max is not None):
            self.true_max.fill(-Float32.inf)

    @cute.jit
    def step(self, acc_S: cute.Tensor, is_first: cutlass.Constexpr[bool]):
        """Turn the scores in `acc_S` into unnormalised probabilities (in place) and
        return (per row, the factor by which the output accumulated so far must shrink;
        whether it must: a warp-uniform Boolean with a rescale threshold, else None for
        always). The first block's factors are 1."""
        if const_expr(self.threshold > 0.0 and not is_first):
            return self._step_lazy(acc_S)
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
            m_safe = _exponent_base(m_cur)
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
        if const_expr(self.true_max is not None):
            for r in cutlass.range_constexpr(cute.size(self.row_max)):
                self.true_max[r] = self.row_max[r]
        return row_scale, None

    @cute.jit
    def _step_lazy(self, acc_S: cute.Tensor):
        """`step` after the first block with a rescale threshold: the maxima first, then
        one vote of the warp on whether the reference moves (its rows' rescales, and O's,
        are then one branch for all 32 lanes), then the exponentials."""
        s_mn = acc_mn_view(acc_S)
        n = cute.size(self.row_max)
        row_scale = cute.make_rmem_tensor_like(self.row_max, Float32)
        block_max = cute.make_rmem_tensor_like(self.row_max, Float32)
        for r in cutlass.range_constexpr(n):
            block_max[r] = _row_max(s_mn[r, None].load())
        m_new, rescale = self._vote_on_references(block_max)
        for r in cutlass.range_constexpr(n):
            m_prev = self.row_max[r]
            m_ref = m_new[r] if rescale else m_prev
            self.row_max[r] = m_ref
            m_safe = _exponent_base(m_ref)
            # 1 where the reference stays (0 for a row with nothing yet: its sum is 0)
            row_scale[r] = cute.math.exp2((m_prev - m_safe) * self.scale_log2, fastmath=True)
            p = cute.math.exp2(s_mn[r, None].load() * self.scale_log2 - m_safe * self.scale_log2, fastmath=True)
            s_mn[r, None].store(p)
            self.row_sum[r] = p.reduce(cute.ReductionOp.ADD, self.row_sum[r] * row_scale[r], 0)
        return row_scale, rescale

    @cute.jit
    def _vote_on_references(self, block_max: cute.Tensor):
        """Per row, the running max with this block's (`block_max`: over this thread's
        columns; reduced over the row's quad here), and one vote of the warp: whether some
        row outgrew its reference by more than the threshold (a reference of -inf:
        -inf + the finite threshold, so any finite max moves it). Keeps the true max."""
        m_new = self._running_maxima(block_max)
        grows = Boolean(False)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            grows = grows | (m_new[r] > self.row_max[r] + self.threshold_scores)
            if const_expr(self.true_max is not None):
                self.true_max[r] = cute.arch.fmax(self.true_max[r], m_new[r])
        return m_new, cute.arch.vote_any_sync(grows)

    @cute.jit
    def _running_maxima(self, block_max: cute.Tensor) -> cute.Tensor:
        """Per row, the running max with this block's (`block_max`: over this thread's
        columns), reduced over the row's quad."""
        m_new = cute.make_rmem_tensor_like(self.row_max, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            m_new[r] = cute.arch.warp_reduction_max(cute.arch.fmax(block_max[r], self.row_max[r]), threads_in_group=4)
        return m_new

    @cute.jit
    def step_on_demand(self, acc_S: cute.Tensor, tOrP: cute.Tensor, may_be_first: cutlass.Constexpr[bool]):
        """`step` after the first block with a rescale threshold, its maxima only where
        needed: the exponentials against the current references, pair by pair into P's
        16-bit registers (P V's operand must be free; S stays intact beside P), and one
        vote of the warp on whether some row's sum over this thread's columns passed 2^t
        (each exponential is at most that sum, so otherwise all are within 2^t: the
        references stand, nothing rescales), passed it by overflowing, or a row has no
        reference yet (-inf: nothing but masked scores so far; its exponentials against 0
        may all have underflowed to a sum of 0). On that vote the warp takes the block's
        maxima, moves its references as `_step_lazy` does and computes the exponentials
        and P again from S. `may_be_first`: this step may be a row's first visit (a block
        list's, or one step serving every block): a vote before the exponentials sends a
        warp with a row at -inf to the slow path at once, without a wasted pass. Returns
        (row scales, whether to apply them: the vote). Not with `track_max` (there is no
        max to track on the fast path)."""
        assert self.true_max is None, "step_on_demand keeps no true max"
        n = cute.size(self.row_max)
        row_scale = cute.make_rmem_tensor_like(self.row_max, Float32)
        refs = cute.make_rmem_tensor_like(self.row_max, Float32)
        fresh = Boolean(False)
        for r in cutlass.range_constexpr(n):
            refs[r] = _exponent_base(self.row_max[r]) * self.scale_log2
            row_scale[r] = Float32(1.0)
            fresh = fresh | (self.row_max[r] == -Float32.inf)
        # (the branches carry tensors and scalars, not this object)
        row_sum, scale_log2 = self.row_sum, self.scale_log2
        added = cute.make_rmem_tensor_like(row_sum, Float32)
        bound = Float32(2.0 ** self.threshold)
        if const_expr(may_be_first):
            rescale = cute.arch.vote_any_sync(fresh)
            if not rescale:
                rescale = cute.arch.vote_any_sync(_exp2_sums_outgrow(acc_S, tOrP, refs, scale_log2, added, bound))
        else:
            outgrown = _exp2_sums_outgrow(acc_S, tOrP, refs, scale_log2, added, bound)
            rescale = cute.arch.vote_any_sync(outgrown | fresh)
        if rescale:
            self._move_references(acc_S, refs, row_scale)
            again = _exp2_into_p(acc_S, tOrP, refs, scale_log2)
            for r in cutlass.range_constexpr(n):
                row_sum[r] = row_sum[r] * row_scale[r] + again[r]
        else:
            for r in cutlass.range_constexpr(n):
                row_sum[r] = row_sum[r] + added[r]
        return row_scale, rescale

    @cute.jit
    def _move_references(self, acc_S: cute.Tensor, refs: cute.Tensor, row_scale: cute.Tensor):
        """The on-demand slow path's first half: the block's maxima, the running maxima
        moved to them (as `_step_lazy` does), each row's scale from the old reference to
        the new and the new exponent offsets into `refs`."""
        s_mn = acc_mn_view(acc_S)
        n = cute.size(self.row_max)
        block_max = cute.make_rmem_tensor_like(self.row_max, Float32)
        for r in cutlass.range_constexpr(n):
            block_max[r] = _row_max(s_mn[r, None].load())
        m_new = self._running_maxima(block_max)
        for r in cutlass.range_constexpr(n):
            m_prev = self.row_max[r]
            self.row_max[r] = m_new[r]
            ref = _exponent_base(m_new[r])
            row_scale[r] = cute.math.exp2((m_prev - ref) * self.scale_log2, fastmath=True)
            refs[r] = ref * self.scale_log2

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
        nothing. (With a rescale threshold: the instance must track it, `track_max`.)"""
        assert self.threshold == 0.0 or self.true_max is not None, "OnlineSoftmax(track_max=True)"
        running = self.row_max if const_expr(self.true_max is None) else self.true_max
        out = cute.make_rmem_tensor_like(self.row_max, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            out[r] = running[r] * (self.scale_log2 * Float32(LN2))
        return out


def _exp2_into_p(acc_S: cute.Tensor, tOrP: cute.Tensor, refs: cute.Tensor, scale_log2: Float32) -> cute.Tensor:
    """P = exp2(S * scale_log2 - refs[row]) written two at a time into the 16-bit A
    fragment `tOrP` (`mma.pack_pair_into`'s order: pairs of adjacent columns, alternating
    between the thread's two rows), so no fp32 copy of P is held beside S. Returns each
    row's sum of the fp32 values, in two chains a row (short dependence paths, nothing
    held for a tree). Plain Python: unrolled while tracing."""
    src = acc_as_a_view(acc_S)
    n = cute.size(refs)
    chains = 2

    def exp2(j, r):
        return cute.math.exp2(src[j] * scale_log2 - refs[r], fastmath=True)

    parts = [[None] * chains for _ in range(n)]
    for i in range(cute.size(src) // 2):
        r, k = i % n, (i // n) % chains
        p0, p1 = exp2(2 * i, r), exp2(2 * i + 1, r)
        pack_pair_into(tOrP, i, p0, p1)
        pair = p0 + p1
        parts[r][k] = pair if parts[r][k] is None else parts[r][k] + pair
    sums = cute.make_rmem_tensor_like(refs, Float32)
    for r in range(n):
        sums[r] = _fold([v for v in parts[r] if v is not None], lambda a, b: a + b)
    return sums


@cute.jit
def _exp2_sums_outgrow(acc_S: cute.Tensor, tOrP: cute.Tensor, refs: cute.Tensor, scale_log2: Float32,
                       sums: cute.Tensor, bound: Float32) -> Boolean:
    """`step_on_demand`'s fast path: the exponentials into P (`_exp2_into_p`), each row's
    sum over this thread's columns into `sums`; whether one of them passed `bound` (an
    overflowed sum is inf: it does too)."""
    added = _exp2_into_p(acc_S, tOrP, refs, scale_log2)
    outgrown = Boolean(False)
    for r in cutlass.range_constexpr(cute.size(refs)):
        sums[r] = added[r]
        outgrown = outgrown | (added[r] > bound)
    return outgrown


def _fold(vals: list, op):
    """op over `vals` as a pairwise tree (plain Python, unrolled while tracing)."""
    while len(vals) > 1:
        vals = [op(vals[t], vals[t + 1]) if t + 1 < len(vals) else vals[t] for t in range(0, len(vals), 2)]
    return vals[0]


@cute.jit
def _exponent_base(m: Float32) -> Float32:
    """The max an exponent subtracts: `m`, or 0 for a row with nothing but -inf so far
    (exp2(-inf - 0) = 0, no inf - inf)."""
    return Float32(0.0) if m == -Float32.inf else m


def _row_max(row: cute.TensorSSA) -> Float32:
    """Max over a row of this thread's fragment (loaded as a vector): a pairwise tree
    (depth log2(cols)) of `max.f32`. A generic MAX reduce emits `max.NaN.f32`, with which
    ptxas left half of the O rescale after the exp2s (SASS). Plain Python: unrolled while
    tracing; the elements are read from the vector (one op each, where indexing the
    fragment costs several)."""
    return _fold(_elements(row), cute.arch.fmax)


@cute.jit
def rescale_rows(acc: cute.Tensor, row_scale: cute.Tensor, needed=None):
    """acc[r, :] *= row_scale[r] for an sm90 accumulator fragment; with `needed` (a
    warp-uniform Boolean from `OnlineSoftmax.step`) only where it is true."""
    if const_expr(needed is None):
        _scale_rows(acc, row_scale)
    else:
        if needed:
            _scale_rows(acc, row_scale)


@cute.jit
def _scale_rows(acc: cute.Tensor, row_scale: cute.Tensor):
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
