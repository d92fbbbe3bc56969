"""Tile states → FlexAttention's sorted block lists, on the GPU.

One warp per list line: a (batch, head, q block) row of the states for the kv-side lists,
a (batch, head, kv block) column for the q-side transposes — both sides in one launch.
Per line: count the partial and full tiles (ballots), then write every index to its
place in torch's order: the selected tiles ascending, then the others ascending. A tile
at position m with r selected tiles before it goes to r if selected, else to
count + (m - r) — a warp-wide prefix count (ballot & lanes-below, popc) per 32 tiles.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from flexattn.kernels.blockmask.classify import FULL, PARTIAL

WARPS_PER_CTA = 4


class BlockListCompactor:
    """``states`` int8 [B, H, nQ, nKV] → (kv_num, kv_idx, full_kv_num, full_kv_idx,
    q_num, q_idx, full_q_num, full_q_idx), int32, counts [B, H, n] and indices
    [B, H, n, m] (kv side: n = nQ, m = nKV; q side: n = nKV, m = nQ). ``full_as_partial``:
    full tiles are listed as partial (torch's ``separate_full_blocks=False``: the mask is
    evaluated on every visited tile; the full lists are empty) and rewritten as partial in
    ``states``."""

    def __init__(self, full_as_partial: bool = False):
        self.full_as_partial = full_as_partial

    @cute.jit
    def __call__(self, states: cute.Tensor, kv_lists, q_lists, stream):
        lines = states.shape[0] * states.shape[1] * (states.shape[2] + states.shape[3])
        grid = (lines + WARPS_PER_CTA - 1) // WARPS_PER_CTA
        self.kernel(states, kv_lists, q_lists).launch(
            grid=[grid, 1, 1], block=[WARPS_PER_CTA * 32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, states: cute.Tensor, kv_lists, q_lists):
        n_b, n_h, n_q, n_kv = states.shape
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(bidx * WARPS_PER_CTA + cute.arch.warp_idx())
        kv_lines = n_b * n_h * n_q
        if warp < kv_lines:
            row = warp % n_q
            bh = warp // n_q
            self._line(states, bh // n_h, bh % n_h, row, n_kv, kv_lists, False)
        elif warp < kv_lines + n_b * n_h * n_kv:
            w = warp - kv_lines
            col = w % n_kv
            bh = w // n_kv
            self._line(states, bh // n_h, bh % n_h, col, n_q, q_lists, True)

    @cute.jit
    def _line(self, states, b, h, line, length, lists, transposed: cutlass.Constexpr[bool]):
        num_p, idx_p, num_f, idx_f = lists
        lane = cute.arch.lane_idx()
        below = Int32(cute.arch.lanemask_lt())
        total_p = Int32(0)
        total_f = Int32(0)
        for base in cutlass.range(0, length, 32, unroll=1):
            m = base + lane
            s = self._state(states, b, h, line, cutlass.min(m, length - 1), transposed)
            valid = m < length
            total_p += cute.arch.popc(cute.arch.vote_ballot_sync(valid & (s == PARTIAL)))
            total_f += cute.arch.popc(cute.arch.vote_ballot_sync(valid & (s == FULL)))
        if lane == 0:
            num_p[b, h, line] = total_p
            num_f[b, h, line] = total_f
        seen_p = Int32(0)
        seen_f = Int32(0)
        for base in cutlass.range(0, length, 32, unroll=1):
            m = base + lane
            s = self._state(states, b, h, line, cutlass.min(m, length - 1), transposed)
            valid = m < length
            is_p = valid & (s == PARTIAL)
            is_f = valid & (s == FULL)
            ballot_p = cute.arch.vote_ballot_sync(is_p)
            ballot_f = cute.arch.vote_ballot_sync(is_f)
            rank_p = seen_p + cute.arch.popc(ballot_p & below)
            rank_f = seen_f + cute.arch.popc(ballot_f & below)
            if valid:
                idx_p[b, h, line, Int32(cutlass.select_(is_p, rank_p, total_p + m - rank_p))] = m
                idx_f[b, h, line, Int32(cutlass.select_(is_f, rank_f, total_f + m - rank_f))] = m
                if const_expr(self.full_as_partial and not transposed):
                    # The states say what the lists say (block_states(), the backward's
                    # transposes): full tiles become partial. The q-side lines may read
                    # either value; _state maps both to partial.
                    states[b, h, line, m] = cutlass.Int8(s)
            seen_p += cute.arch.popc(ballot_p)
            seen_f += cute.arch.popc(ballot_f)

    @cute.jit
    def _state(self, states, b, h, line, m, transposed: cutlass.Constexpr[bool]):
        s = Int32(states[b, h, m, line]) if const_expr(transposed) else Int32(states[b, h, line, m])
        if const_expr(self.full_as_partial):
            s = Int32(cutlass.select_(s == FULL, Int32(PARTIAL), s))
        return s
