"""Which kv blocks a CTA visits, and in what order.

Both the producer (TMA loads) and the consumers (MMAs) walk the same sequence; each
source below gives `count` and `at(i)` (the kv block index of the i-th visit).

* `DenseBlocks`: blocks n_max-1 down to 0 (the caller computes n_max, e.g. limited by the
  causal diagonal).
* `SparseBlocks`: one (batch, head, q-block) row of a FlexAttention-style BlockMask —
  `kv_num_blocks [B, H, nQ]`, `kv_indices [B, H, nQ, nKV]` (partial blocks: the mask must be
  evaluated) and `full_kv_num_blocks`, `full_kv_indices` (full blocks: no mask). The visit
  order is the partial list, then the full list, each in its stored order. B and H may be 1
  (broadcast). Blocks are tile_m rows by `factor` x tile_n keys: each listed kv block
  expands into `factor` consecutive kernel tiles (wide heads run 64-key tiles on
  128-key lists).
* `BandBlocks`: the same two lists for a mask that is a band of diagonals, ``lo <= q - kv
  <= hi`` (runtime bounds; `mods.structure.diagonal_band`), computed by arithmetic instead
  of read: the blocks crossing an edge of the band are partial, those inside it full.
"""

import copy

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from flexattn.mods.structure import band_values, diagonal_band


class _Staged:
    """Lets an object of runtime fields flow through dynamic `if`/`for` (CuTeDSL packs
    and unpacks its `_fields` as IR values)."""

    _fields: tuple = ()

    def __extract_mlir_values__(self):
        values, self._sizes = [], []
        for name in self._fields:
            v = cutlass.extract_mlir_values(getattr(self, name))
            values += v
            self._sizes.append(len(v))
        return values

    def __new_from_mlir_values__(self, values):
        obj, i = copy.copy(self), 0
        for name, n in zip(self._fields, self._sizes):
            setattr(obj, name, cutlass.new_from_mlir_values(getattr(self, name), values[i:i + n]))
            i += n
        return obj


class DenseBlocks(_Staged):
    _fields = ("count",)

    def __init__(self, n_block_max):
        self.count = Int32(n_block_max)

    def at(self, i):
        return self.count - 1 - i


class SparseBlocks(_Staged):
    _fields = ("n_partial", "n_full", "count", "partial", "full")

    def __init__(self, tensors, batch, head, m_block, factor: int = 1, with_partial: bool = True):
        kv_num, kv_idx, full_num, full_idx = tensors
        b = batch % kv_num.shape[0]
        h = head % kv_num.shape[1]
        self.factor = factor
        # with_partial=False: the lists hold no partial block (the planner knows it), so
        # the partial count is not read and every visit is a full one.
        self.with_partial = with_partial
        self.n_partial = Int32(kv_num[b, h, m_block]) * factor if with_partial else Int32(0)
        self.n_full = Int32(full_num[b, h, m_block]) * factor
        self.count = self.n_partial + self.n_full
        self.partial = kv_idx[b, h, m_block, None]
        self.full = full_idx[b, h, m_block, None]

    def _expand(self, lst, i):
        f = self.factor
        if cutlass.const_expr(f == 1):
            return Int32(lst[i])
        return Int32(lst[i // f]) * f + i % f

    def partial_at(self, i):
        return self._expand(self.partial, i)

    def full_at(self, i):
        return self._expand(self.full, i)

    @cute.jit
    def at(self, i):
        if cutlass.const_expr(not self.with_partial):
            return self.full_at(i)
        # Both reads stay in bounds (clamped); the select picks the list i falls in.
        ip = cutlass.max(cutlass.min(i, self.n_partial - 1), 0)
        jf = cutlass.max(i - self.n_partial, 0)
        p = self.partial_at(ip)
        f = self.full_at(jf)
        return p if i < self.n_partial else f


# An open side of a band: far past any sequence position, and still clear of int32 overflow
# when a tile's row or column is added to or taken from it.
OPEN_BAND_SIDE = 1 << 30


def band_of(mods):
    """The band of diagonals (``mods.structure.Band``) a mask hook's mask is, or None."""
    expr = getattr(mods, "mask_expr", None)
    band = None if expr is None else diagonal_band(expr)
    return None if band is None or band.empty else band


def band_bounds(mods, mod_args):
    """The band's ``(lo, hi)`` as kernel Int32 values, from the mask's runtime captures
    (an open side becomes `OPEN_BAND_SIDE` away)."""
    lo, hi = band_values(band_of(mods), mods.mask_args(mod_args), as_int=Int32)
    return (Int32(-OPEN_BAND_SIDE if lo is None else lo), Int32(OPEN_BAND_SIDE if hi is None else hi))


def band_block_ranges(lo, hi, m_block, tile_m: int, tile_n: int, seqlen_k, ops=None):
    """``(n_lo, n_end, f_lo, f_end)`` for q tile `m_block` under ``lo <= q - kv <= hi``:
    the kv blocks with any visible element are ``[n_lo, n_end)``, the full ones ``[f_lo,
    f_end)`` inside it (``f_lo == f_end == n_end`` when there are none). ``ops``: (max,
    min, select) — the kernel's, or Python's (the default) for host code and tests."""
    max_, min_, select = ops or (max, min, lambda c, a, b: a if c else b)
    q0 = m_block * tile_m
    q1 = q0 + tile_m - 1
    # Visible columns: q0 - hi <= kv <= q1 - lo, within [0, KV_LEN).
    n_lo = max_(q0 - hi, 0) // tile_n
    n_end = max_(min_((max_(q1 - lo + 1, 0) + tile_n - 1) // tile_n, (seqlen_k + tile_n - 1) // tile_n), n_lo)
    # Full blocks n: every row and column inside the band, i.e. n * tile_n >= q1 - hi and
    # (n + 1) * tile_n - 1 <= q0 - lo.
    f_lo = max_((max_(q1 - hi, 0) + tile_n - 1) // tile_n, n_lo)
    f_end = min_(max_(q0 - lo + 1, 0) // tile_n, n_end)
    none = f_end <= f_lo
    return n_lo, n_end, select(none, n_end, f_lo), select(none, n_end, f_end)


def _kernel_ops():
    return (cutlass.max, cutlass.min, lambda c, a, b: Int32(cutlass.select_(c, Int32(a), Int32(b))))


class BandBlocks(_Staged):
    """The kv blocks of q tile `m_block` under the band ``lo <= q - kv <= hi``, with the
    interface of `SparseBlocks`: partial blocks first (those crossing the band's upper
    edge, from the diagonal down, then those crossing its lower edge), then the full ones
    (descending). Blocks past KV_LEN are never listed; a full block may straddle KV_LEN
    (the kernels check that at run time, as for a BlockMask's full blocks)."""

    _fields = ("n_partial", "n_full", "count", "n_upper", "n_lo", "n_end", "f_end")

    def __init__(self, bounds, m_block, tile_m: int, tile_n: int, seqlen_k):
        n_lo, n_end, f_lo, f_end = band_block_ranges(*bounds, m_block, tile_m, tile_n, seqlen_k, _kernel_ops())
        self.n_lo = Int32(n_lo)
        self.n_end = Int32(n_end)
        self.f_end = Int32(f_end)
        self.n_upper = Int32(n_end - f_end)
        self.n_full = Int32(f_end - f_lo)
        self.n_partial = self.n_upper + Int32(f_lo - n_lo)
        self.count = self.n_partial + self.n_full

    def partial_at(self, i):
        return Int32(cutlass.select_(i < self.n_upper, self.n_end - 1 - i, self.n_lo + (i - self.n_upper)))

    def full_at(self, i):
        return self.f_end - 1 - i

    def at(self, i):
        return Int32(cutlass.select_(i < self.n_partial, self.partial_at(i), self.full_at(i - self.n_partial)))
