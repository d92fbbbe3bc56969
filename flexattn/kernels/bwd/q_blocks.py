"""Which q blocks a backward CTA visits (the transpose of blockmask/visit.py's question).

A backward CTA owns one kv block (tile_n keys) of one kv head and walks, for each query
head of its GQA group, the q blocks (tile_m rows) that can see it. The producer warp (TMA
loads) and the consumer warpgroups (MMAs) enumerate the same sequence with these classes.

* `DenseQBlocks`: q blocks `first .. n_m - 1` in ascending order. Under the causal
  structure `first` is the first block whose last row reaches the kv block, and blocks
  below `diag_end` cross the diagonal (the mask is evaluated only there).

Rotation (`rot`, non-causal, non-deterministic): the walk starts `rot` blocks in and wraps
around (each list on its own). The CTAs of one head run side by side and would otherwise
reach the same q tile together, and all add their dQ tiles into it at once: the L2 then
serializes those bulk reductions of the same lines. Starting kv block n at its diagonal
tile (rot = n * tile_n // tile_m) spreads them over the tiles.
* `SparseQBlocks`: the q-side lists of a FlexAttention BlockMask for (batch, q head, kv
  block): `q_num_blocks [B, H, nKV]`, `q_indices [B, H, nKV, nQ]` (partial: mask
  evaluated) and `full_q_num_blocks`, `full_q_indices` (full: no mask). BlockMask q blocks
  are `sparse_block_m` rows (128 in flexattn), the kernel's tile is `tile_m` rows: each
  listed block expands into `factor = sparse_block_m // tile_m` consecutive tiles. B and H
  may be 1 (broadcast). Visit order: the partial list, then the full list; deterministic
  mode merges them in ascending q order (`merged_at`, bwd.sm90._visit).

* `BandQBlocks`: the same two lists for a mask that is a band of diagonals (``lo <= q -
  kv <= hi``, runtime bounds), by arithmetic: the forward's `band_block_ranges` with the
  roles of q and kv swapped (``-hi <= kv - q <= -lo``), in tile_m rows directly. Partial:
  the q tiles crossing the band's lower edge, then its upper edge; full: those inside.

The transposed question, for the deterministic dQ order (bwd/sm90.py): how many kv blocks
*after* n visit q tile m (`KvVisitors.after`). Dense: every kv block visits every tile.
Causal: kv blocks 0 .. last(m) (those whose `first` is <= m). Block-sparse: the kv blocks
in the BlockMask's kv-side lists (partial + full) of q block m // factor, counted by one
warp (the lists need not be sorted; they must be the exact transposes of the q-side ones,
as `BlockMask` builds both from one tile-state array).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from flexattn.kernels.blockmask.visit import SparseBlocks, _Staged, _kernel_ops, band_block_ranges


def _rotated(i, rot, n):
    """(i + rot) mod n (n may be 0 when no element is read)."""
    return (i + rot) % cutlass.max(n, 1)


class DenseQBlocks(_Staged):
    _fields = ("first", "n_m", "diag_end", "rot")

    def __init__(self, first, n_m, diag_end, rot=0):
        self.first = Int32(first)
        self.n_m = Int32(n_m)
        self.diag_end = Int32(diag_end)     # first q block that lies fully below the diagonal
        self.rot = Int32(rot)

    @property
    def count(self):
        return cutlass.max(self.n_m - self.first, 0)

    def at(self, i):
        return self.first + _rotated(i, self.rot, self.count)


class SparseQBlocks(SparseBlocks):
    """The forward's `SparseBlocks` on the q-side lists (the same row reads, expansion and
    `at`), each list walked from `rot` on."""

    _fields = SparseBlocks._fields + ("rot",)

    def __init__(self, tensors, batch, head, n_block, factor: int, rot=0, with_partial: bool = True):
        super().__init__(tensors, batch, head, n_block, factor, with_partial)
        self.rot = Int32(rot)

    def partial_at(self, i):
        return self._expand(self.partial, _rotated(i, self.rot, self.n_partial))

    def full_at(self, i):
        return self._expand(self.full, _rotated(i, self.rot, self.n_full))

    @cute.jit
    def merged_at(self, taken_partial, taken_full):
        """Both lists merged in ascending order (BlockMask sorts them): the next q block
        after `taken_partial` partial and `taken_full` full ones, and 1 if it is partial."""
        p = self.partial_at(cutlass.max(cutlass.min(taken_partial, self.n_partial - 1), 0))
        f = self.full_at(cutlass.max(cutlass.min(taken_full, self.n_full - 1), 0))
        partial = Int32(1) if p < f else Int32(0)
        partial = Int32(1) if taken_full >= self.n_full else partial
        partial = partial if taken_partial < self.n_partial else Int32(0)
        return (p if partial != 0 else f), partial


class BandQBlocks(_Staged):
    _fields = ("n_partial", "n_full", "n_lower", "m_lo", "f_lo", "f_end", "rot")

    def __init__(self, bounds, n_block, tile_m: int, tile_n: int, seqlen_q, rot=0):
        lo, hi = bounds
        m_lo, m_end, f_lo, f_end = band_block_ranges(-hi, -lo, n_block, tile_n, tile_m, seqlen_q, _kernel_ops())
        self.m_lo = Int32(m_lo)
        self.f_lo = Int32(f_lo)
        self.f_end = Int32(f_end)
        self.n_lower = Int32(f_lo - m_lo)
        self.n_partial = self.n_lower + Int32(m_end - f_end)
        self.n_full = Int32(f_end - f_lo)
        self.rot = Int32(rot)

    @property
    def count(self):
        return self.n_partial + self.n_full

    def partial_at(self, i):
        j = _rotated(i, self.rot, self.n_partial)
        return Int32(cutlass.select_(j < self.n_lower, self.m_lo + j, self.f_end + (j - self.n_lower)))

    def full_at(self, i):
        return self.f_lo + _rotated(i, self.rot, self.n_full)

    def at(self, i):
        return Int32(cutlass.select_(i < self.n_partial, self.partial_at(i), self.full_at(i - self.n_partial)))


def last_visitor(m_block, tile_m: int, tile_n: int, n_kv, causal: bool, min_=min):
    """The highest kv block whose `DenseQBlocks` walk visits q tile `m_block` (dense: the
    last; causal: the last n with (n tile_n) // tile_m <= m_block); kv blocks 0 .. it do."""
    if causal:
        return min_(n_kv - 1, ((m_block + 1) * tile_m - 1) // tile_n)
    return n_kv - 1


def visitor_count(m_block, tile_m: int, tile_n: int, seqlen_k, causal: bool = False, band=None, ops=None):
    """How many kv blocks visit q tile `m_block` — the transpose of `DenseQBlocks`
    (`last_visitor` + 1) and of `BandQBlocks` (`band` = (lo, hi): the forward's kv-block
    range of that tile). ``ops``: (max, min, select), the kernel's or Python's (the default,
    for tests)."""
    if band is not None:
        n_lo, n_end, _, _ = band_block_ranges(band[0], band[1], m_block, tile_m, tile_n, seqlen_k, ops)
        return n_end - n_lo
    min_ = ops[1] if ops else min
    return last_visitor(m_block, tile_m, tile_n, (seqlen_k + tile_n - 1) // tile_n, causal, min_) + 1


class KvVisitors(_Staged):
    """Which kv blocks visit a q tile: `after(m_block, n_block)` = how many kv blocks with
    a higher index than `n_block` visit tile `m_block` of (batch, head). For the sparse
    structure it is warp-collective (all 32 lanes call it, all get the count)."""

    def __init__(self, cfg, n_kv_blocks, kv_lists=None, batch=None, head=None):
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.causal = cfg.causal
        self.factor = cfg.sparse_block_m // cfg.tile_m
        self.kv_sub = cfg.sparse_block_n // cfg.tile_n     # CTAs per BlockMask kv block
        self.n_kv_blocks = Int32(n_kv_blocks)
        self.kv_lists = kv_lists           # (kv_num_blocks, kv_indices, full_kv_*) or None
        self.batch, self.head = batch, head
        self._fields = ("n_kv_blocks",) if kv_lists is None else (
            "n_kv_blocks", "kv_lists", "batch", "head")

    @cute.jit
    def after(self, m_block, n_block):
        if cutlass.const_expr(self.kv_lists is not None):
            if cutlass.const_expr(self.kv_sub == 1):
                return self._after_sparse(m_block // self.factor, n_block)
            # 64-key CTAs: every CTA of each later listed kv block, and this block's later
            # ones, less those past the last key (the last kv block may have fewer CTAs).
            parent = n_block // self.kv_sub
            last = (self.n_kv_blocks - 1) // self.kv_sub
            missing = (last + 1) * self.kv_sub - self.n_kv_blocks
            later, last_listed = self._after_sparse(m_block // self.factor, parent, last)
            missing = missing if (last_listed != 0 or last == parent) else Int32(0)
            return later * self.kv_sub + (self.kv_sub - 1 - n_block % self.kv_sub) - missing
        return last_visitor(m_block, self.tile_m, self.tile_n, self.n_kv_blocks, self.causal, cutlass.min) - n_block

    @cute.jit
    def _after_sparse(self, q_block, n_block, watch=None):
        """Listed kv blocks above `n_block` for `q_block`; with `watch`, also (as a second
        result) how many list entries equal `watch`."""
        kv_num, kv_idx, full_num, full_idx = self.kv_lists
        b = self.batch % kv_num.shape[0]
        h = self.head % kv_num.shape[1]
        lane = cute.arch.lane_idx()
        count = Int32(0)
        # Both lists in one loop: their two loads per lane are in flight together (two
        # round trips per count instead of four; this is on the dQ writer's path).
        n_partial = Int32(kv_num[b, h, q_block])
        n_full = Int32(full_num[b, h, q_block])
        seen = Int32(0)
        for i in cutlass.range(lane, cutlass.max(n_partial, n_full), 32, unroll=1):
            if i < n_partial:
                kv = Int32(kv_idx[b, h, q_block, i])
                if kv > n_block:
                    count += 1
                if cutlass.const_expr(watch is not None):
                    if kv == watch:
                        seen += 1
            if i < n_full:
                kv = Int32(full_idx[b, h, q_block, i])
                if kv > n_block:
                    count += 1
                if cutlass.const_expr(watch is not None):
                    if kv == watch:
                        seen += 1
        if cutlass.const_expr(watch is not None):
            return cute.arch.warp_reduction_sum(count), cute.arch.warp_reduction_sum(seen)
        return cute.arch.warp_reduction_sum(count)


class BwdWalks:
    """A backward kernel's q-block walks (mixed into both backward kernels): which q blocks
    kv block `n_block` visits for a q head, by the config's block structure, and where each
    walk starts. Needs `cfg` (a BwdConfig) and, for the band structure, the band's bounds
    passed in place of the lists."""

    @cute.jit
    def _dense_blocks(self, n_block: Int32, seqlen_q: Int32) -> DenseQBlocks:
        cfg = self.cfg
        n_m = (seqlen_q + cfg.tile_m - 1) // cfg.tile_m
        first = Int32(0)
        diag_end = Int32(0)
        if const_expr(cfg.causal):
            # Top-left aligned causal (kv <= q): rows below the block's first key see
            # nothing of it; rows below its last key see all of it.
            first = (n_block * cfg.tile_n) // cfg.tile_m
            diag_end = ((n_block + 1) * cfg.tile_n + cfg.tile_m - 2) // cfg.tile_m
        return DenseQBlocks(first, n_m, diag_end, self._rotation(n_block))

    def _sparse_blocks(self, block_sparse, batch, head, n_block) -> SparseQBlocks:
        """The lists of the BlockMask kv block holding this CTA's keys (a 64-key CTA walks
        its 128-key block's: its keys see at most those q blocks; the full ones entirely)."""
        cfg = self.cfg
        kv_block = n_block if const_expr(cfg.sparse_block_n == cfg.tile_n) else n_block // (cfg.sparse_block_n // cfg.tile_n)
        return SparseQBlocks(block_sparse[:4], batch, head, kv_block,
                             cfg.sparse_block_m // cfg.tile_m, self._rotation(n_block),
                             with_partial=cfg.partial_blocks)

    def _q_blocks(self, block_sparse, batch, head, n_block, seqlen_q):
        """The q blocks kv block `n_block` visits for q head `head`, by block structure
        (`block_sparse`: the lists, or the band's bounds under cfg.band)."""
        cfg = self.cfg
        if const_expr(cfg.block_sparse):
            return self._sparse_blocks(block_sparse, batch, head, n_block)
        if const_expr(cfg.band):
            return BandQBlocks(block_sparse, n_block, cfg.tile_m, cfg.tile_n, seqlen_q, self._rotation(n_block))
        return self._dense_blocks(n_block, seqlen_q)

    @cute.jit
    def _visit(self, blocks, i, walk):
        """The i-th visit: (q block, 1 if partial (mask evaluated) else 0, walk state).
        Deterministic block-sparse walks both lists merged in ascending order (the dQ turns
        of a banded mask would otherwise wait for whole list lengths); otherwise the
        partial list, then the full one. `walk` = (partial, full) blocks taken so far.
        Only the merged walk's consumers read the partial flag (the others loop over the
        two lists separately), so elsewhere it is a constant 0."""
        if const_expr(self.cfg.block_sparse and self.cfg.deterministic):
            m_block, partial = blocks.merged_at(walk[0], walk[1])
            return m_block, partial, (walk[0] + partial, walk[1] + 1 - partial)
        return blocks.at(i), Int32(0), walk

    def _rotation(self, n_block):
        """Where the q-block walk starts (bwd/q_blocks.py): at the kv block's diagonal
        tile, except under causal (the walk starts there anyway, diagonal blocks first)
        and in deterministic mode (the dQ turns assume ascending walks)."""
        cfg = self.cfg
        if const_expr(cfg.causal or cfg.deterministic):
            return 0
        if const_expr(cfg.cluster_n > 1):
            n_block = n_block - n_block % cfg.cluster_n    # one walk for the cluster's CTAs
        if const_expr(cfg.tile_n % cfg.tile_m):
            return (n_block * cfg.tile_n) // cfg.tile_m
        return n_block * (cfg.tile_n // cfg.tile_m)
