"""The backward's pointwise math on an S^T / dP^T accumulator pair, whichever MMA made them
(`BwdPointwise`, mixed into the bf16 wgmma kernel `bwd/sm90.py` and the float32 warp-MMA
kernel `bwd/tf32_sync.py`): P^T = exp2(s' log2 e - lse_log2) with the forward's score mod,
mask and bounds re-applied exactly as the forward did; dS^T = P (dP - D) ds'/ds; the
captured float buffers' gradients scattered (fp32 reductions, or the deterministic mode's
fixed point), per element or per diagonal of a relative-position read.

A kernel provides `cfg` (a BwdConfig), `mods` (the hook), `acc_mn_view` (its accumulator
fragment as rows x cols) and `stats_in_registers` (LSE / D read into registers by the
caller, `_column_values`, or per element from shared memory).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from flexattn.kernels.blockmask.visit import band_bounds
from flexattn.kernels.emit.affine_index import AffineIndex
from flexattn.kernels.emit.mod_hook import kept_if
from flexattn.kernels.hopper.atomics import FIXED_WORDS, red_add_f32, red_add_fixed, st_shared_f32


@cute.jit
def _warp_sum(x: Float32) -> Float32:
    """Sum over the warp's lanes by a butterfly (the same order every run)."""
    for k in cutlass.range_constexpr(5):
        x = x + cute.arch.shuffle_sync_bfly(x, offset=16 >> k)
    return x


def _diagonal_key(coords, r, c, uniform: bool) -> int:
    """Fragment element (r, c)'s diagonal: thread 0's column - row (every thread's elements
    are thread 0's shifted by one (row, column) offset, so equal keys are equal q - kv for
    any thread); `uniform`: one key (0) for the whole fragment."""
    return 0 if uniform else coords.col0(c) - coords.row0(r)


def _diagonal_flushes(order: list, coords, uniform: bool) -> dict:
    """{position in `order`: diagonal key (`_diagonal_key`)} of the last element of each
    diagonal of a thread's fragment."""
    last = {}
    for i, (r, c) in enumerate(order):
        key = _diagonal_key(coords, r, c, uniform)
        if not isinstance(key, int):
            raise TypeError("fragment coordinates of thread 0 must be compile-time constants")
        last[key] = i
    return {i: key for key, i in last.items()}


def _element_order(n_rows: int, n_cols: int, rows_outer: bool) -> list:
    """(row, col) visiting order of a fragment's elements (a compile-time list)."""
    if rows_outer:
        return [(r, c) for r in range(n_rows) for c in range(n_cols)]
    return [(r, c) for c in range(n_cols) for r in range(n_rows)]


class BwdPointwise:
    """The pointwise half of a backward step (see the module doc)."""

    @cute.jit
    def _pointwise_at_edge(self, acc_S, acc_dP, sLSE, sDelta, coords, blk, scale_log2,
                           grad_args, mask: cutlass.Constexpr[bool],
                           causal: cutlass.Constexpr[bool], sDiag_thr=None):
        """`_pointwise`, with the KV_LEN test only in the CTA whose keys straddle KV_LEN
        (a CTA-uniform branch: the other CTAs skip one select per element)."""
        n_block, seqlen_k = blk[1], blk[5]
        if (n_block + 1) * self.cfg.tile_n > seqlen_k:
            self._pointwise(acc_S, acc_dP, sLSE, sDelta, coords, blk, scale_log2, grad_args,
                            mask, causal, True, sDiag_thr)
        else:
            self._pointwise(acc_S, acc_dP, sLSE, sDelta, coords, blk, scale_log2, grad_args,
                            mask, causal, False, sDiag_thr)

    @cute.jit
    def _pointwise(self, acc_S, acc_dP, sLSE, sDelta, coords, blk, scale_log2, grad_args,
                   mask: cutlass.Constexpr[bool], causal: cutlass.Constexpr[bool],
                   kv_edge: cutlass.Constexpr[bool], sDiag_thr=None):
        """acc_S (raw q.k, transposed) <- P^T = exp2(s' log2 e - lse_log2), with the score
        mod, mask and bounds in the forward's order (as apply_mods) on the clamped indices
        the forward's hook saw. If `acc_dP` is given (score-mod path) also
        acc_dP <- dS^T = P (dP - D) ds'/ds (0 where P == 0: the derivative may be inf or
        NaN at masked elements, unless it is a finite constant) and the buffer gradients
        are scattered."""
        m_block, n_block, head, batch, seqlen_q, seqlen_k, softmax_scale, mod_args = blk
        mods = self.mods
        cfg = self.cfg
        fused = acc_dP is not None
        s_mn = self.acc_mn_view(acc_S)
        dp_mn = self.acc_mn_view(acc_dP) if const_expr(fused) else None
        col_local0 = coords.col_offset()
        q_first = m_block * cfg.tile_m + col_local0
        kv_base = n_block * cfg.tile_n
        # Element order only changes register pressure (the consumers sit at 240 with
        # dK, dV = 128 fp32 each thread): measured with ptxas, rows-outer avoids a small
        # spill for softcap (two scalar captures), columns-outer for the buffer-gradient
        # scatters. Rows-outer re-reads LSE / D from smem per element (a broadcast
        # ld.shared); columns-outer reads them once per column.
        rows_outer = not cfg.buffer_grads
        order = _element_order(cute.size(s_mn.shape[0]), cute.size(s_mn.shape[1]), rows_outer)
        # Buffer reads indexed by q - kv only (relative-position tables, per-head slopes):
        # a thread's elements on one diagonal add into one element, so their contributions
        # are summed in registers and each diagonal costs one atomic, issued right after
        # its last element (`_diagonal_flushes`).
        diagonal = fused and cfg.buffer_grads and getattr(mods, "grad_reads_diagonal", False)
        uniform = diagonal and mods.grad_reads_uniform   # one element for the whole tile
        flushes = _diagonal_flushes(order, coords, uniform) if const_expr(diagonal) else None
        sums = {}
        lse = delta = None
        constant_grad = getattr(mods, "constant_score_grad", None) if fused else None
        # Indices only where something reads them (a score mod like softcap reads none):
        # ops per element of tracing that MLIR would delete again.
        # The band structure's mask is exactly its band: q - kv against the bounds (from the
        # captures, once per step) instead of the mask's expression on clamped indices.
        band = mask and cfg.band
        band_lo = band_hi = None
        if const_expr(band):
            band_lo, band_hi = band_bounds(mods, mod_args)
        hook_vars = mods.index_vars(mods.has_score, mask and not band)
        need_q = "q" in hook_vars or causal or diagonal or band
        need_kv = "kv" in hook_vars or causal or kv_edge or diagonal or band
        # Mods that convert kv - q to float (ALiBi) take q (the columns here) as base plus
        # offset: one conversion per row instead of one per element (affine_index).
        affine_q = "q" in hook_vars and mods.affine_index("q", mods.has_score, mask and not band)
        # The mask sees q unclamped where it reads no buffer at q: rows past Q_LEN have P = 0
        # whatever it keeps (their lse_log2 is +inf, and the mask only selects), and compares
        # of an unclamped AffineIndex with constants take one instruction per element
        # (``abs(q - kv) <= 512``: two compares of a base, no add; affine_index.py).
        mask_affine_q = mask and not band and mods.mask_takes_unclamped("q")
        for i in cutlass.range_constexpr(len(order)):
            r, c = order[i]
            q = q_hook = q_mask = kv = kv_hook = None
            if const_expr(need_q):
                q = q_first + coords.col0(c)
                q_hook = cutlass.min(q, seqlen_q - 1)
                if const_expr(affine_q):
                    q_hook = AffineIndex(q_first, coords.col0(c), hi=seqlen_q - 1)
                q_mask = AffineIndex(q_first, coords.col0(c)) if const_expr(mask_affine_q) else q_hook
            if const_expr(rows_outer or r == 0):
                lse = self._column(sLSE, c, col_local0, coords)
                if const_expr(fused):
                    delta = self._column(sDelta, c, col_local0, coords)
            if const_expr(need_kv):
                kv = kv_base + coords.row(r)
                kv_hook = cutlass.min(kv, seqlen_k - 1)
            x = s_mn[r, c]
            grad = None
            if const_expr(mods.has_score):
                s_scaled = x * softmax_scale
                s2, grad = mods.score_and_grad(s_scaled, batch, head, q_hook, kv_hook,
                                               mod_args)
                x = s2
            # One FFMA; the masks then replace the exponent (-inf - lse_log2 = -inf).
            x = x * scale_log2 - lse
            if const_expr(band):
                diag = q - kv
                x = kept_if(diag <= band_hi, x)
                x = kept_if(diag >= band_lo, x)
            elif const_expr(mask):
                keep = mods.mask(batch, head, q_mask, kv_hook, mod_args)
                x = kept_if(keep, x)
            if const_expr(causal):
                x = kept_if(q >= kv, x)
            if const_expr(kv_edge):
                # Keys past KV_LEN (zero-filled by TMA) must not count; rows past Q_LEN
                # have lse_log2 = +inf, so their P is 0 already.
                x = kept_if(kv < seqlen_k, x)
            p = cute.math.exp2(x, fastmath=True)
            s_mn[r, c] = p
            if const_expr(fused):
                ds = p * (dp_mn[r, c] - delta)           # dS' (w.r.t. the modded score)
                if const_expr(diagonal):
                    reads = mods.buffer_grads(s_scaled, batch, head, q_hook, kv_hook, mod_args)
                    key = _diagonal_key(coords, r, c, uniform)
                    for k in cutlass.range_constexpr(len(reads)):
                        # 0 where P == 0: the partial may be inf / NaN at masked elements
                        part = ds * reads[k][2] if p != Float32(0.0) else Float32(0.0)
                        if const_expr((k, key) in sums):
                            sums[(k, key)] = sums[(k, key)] + part
                        else:
                            sums[(k, key)] = part
                    if const_expr(i in flushes and sDiag_thr is not None):
                        # Entries are zero until written (the flush re-zeroes what it read),
                        # so a zero sum needs no store; the branch also keeps the
                        # scheduler from hoisting work across it (spills otherwise).
                        if const_expr(not 0 <= flushes[i] + 8 <= self.DIAG_ROW - 7):
                            raise ValueError(f"diagonal key {flushes[i]} outside sDiag's row")
                        total = sums.pop((0, flushes[i]))
                        if total != Float32(0.0):
                            st_shared_f32(sDiag_thr.iterator + (flushes[i] + 8), total)
                    elif const_expr(i in flushes):
                        # Unclamped coordinates: q - kv is the diagonal's own (an element
                        # past Q_LEN / KV_LEN adds 0, and a zero sum is not sent).
                        reads = mods.buffer_grads(s_scaled, batch, head, q, kv, mod_args)
                        for k in cutlass.range_constexpr(len(reads)):
                            total = sums.pop((k, flushes[i]))
                            if const_expr(uniform):
                                # One element per tile: the warp's sum (a fixed shuffle
                                # tree), one add by lane 0.
                                total = _warp_sum(total)
                                if cute.arch.lane_idx() == 0 and total != Float32(0.0):
                                    self._add_buffer_grad(reads[k][0], reads[k][1], total,
                                                          grad_args)
                            elif total != Float32(0.0):
                                self._add_buffer_grad(reads[k][0], reads[k][1], total, grad_args)
                elif const_expr(cfg.buffer_grads):
                    self._scatter_buffer_grads(ds, p, s_scaled, batch, head, q_hook,
                                               kv_hook, mod_args, grad_args)
                if const_expr(constant_grad is not None):
                    # A finite constant ds'/ds (additive mods): masked elements give
                    # 0 * c = 0 unguarded, and c = 1 multiplies by nothing.
                    dp_mn[r, c] = ds if const_expr(constant_grad == 1.0) else ds * Float32(constant_grad)
                else:
                    ds = ds * grad
                    dp_mn[r, c] = Float32(cutlass.select_(p == Float32(0.0), Float32(0.0), ds))

    @cute.jit
    def _column_values(self, sStat, coords):
        """This thread's columns of a per-row statistic (LSE or D of the stage) read from
        shared memory into registers."""
        n = cute.size(coords.t_mn.shape[1])
        vals = cute.make_rmem_tensor(cute.make_layout(n), Float32)
        col_local0 = coords.col_offset()
        for c in cutlass.range_constexpr(n):
            vals[c] = sStat[col_local0 + coords.col0(c)]
        return vals

    def _column(self, stat, c, col_local0, coords):
        """Fragment column c's value of a statistic: from `_column_values`' registers or
        from its shared-memory row (score-mod paths, which never read into registers)."""
        if const_expr(self.stats_in_registers):
            return stat[c]
        return stat[col_local0 + coords.col0(c)]

    @cute.jit
    def _ds_from_p(self, acc_P, acc_dP, sDelta, coords):
        """No score mod: acc_dP (dP^T) <- dS^T = P * (dP - D)."""
        p_mn = self.acc_mn_view(acc_P)
        dp_mn = self.acc_mn_view(acc_dP)
        col_local0 = coords.col_offset()
        for c in cutlass.range_constexpr(cute.size(p_mn.shape[1])):
            delta = self._column(sDelta, c, col_local0, coords)
            for r in cutlass.range_constexpr(cute.size(p_mn.shape[0])):
                dp_mn[r, c] = p_mn[r, c] * (dp_mn[r, c] - delta)

    @cute.jit
    def _scatter_buffer_grads(self, ds, p, s, batch, head, q, kv, mod_args, grad_args):
        """grad[slot][idx] += dS' * ds'/d buf[idx] for each float-buffer read of the mod.
        Deterministic: into the slot's 128-bit fixed-point accumulator for idx instead
        (row offsets[slot] + the element's offset in the contiguous fp32 grad)."""
        if p != Float32(0.0):
            reads = self.mods.buffer_grads(s, batch, head, q, kv, mod_args)
            for k in cutlass.range_constexpr(len(reads)):   # Python list: unrolled
                slot, index, partial = reads[k]
                self._add_buffer_grad(slot, index, ds * partial, grad_args)

    @cute.jit
    def _add_buffer_grad(self, slot, index, value, grad_args):
        """grad[slot][index] += value (fp32 reduction; deterministic: exact fixed point)."""
        position = {s: i for i, s in enumerate(self.mods.grad_slots)}
        crd = index if const_expr(len(index) > 1) else index[0]
        if const_expr(self.cfg.deterministic):
            grads, fixed, offsets = grad_args
            grad = grads[position[slot]]
            e = cute.crd2idx(crd, grad.layout)
            red_add_fixed(fixed.iterator + FIXED_WORDS * (offsets[position[slot]] + e),
                          grad.iterator + e, value)
        else:
            grad = grad_args[position[slot]]
            red_add_f32(grad.iterator + cute.crd2idx(crd, grad.layout), value)
