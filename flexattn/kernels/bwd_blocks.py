"""Which q blocks a backward CTA visits (the transpose of block_sparsity.py's question).

A backward CTA owns one kv block (tile_n keys) of one kv head and walks, for each query
head of its GQA group, the q blocks (tile_m rows) that can see it. The producer warp (TMA
loads) and the consumer warpgroups (MMAs) enumerate the same sequence with these classes.

* `DenseQBlocks`: q blocks `first .. n_m - 1` in ascending order. Under the causal
  structure `first` is the first block whose last row reaches the kv block, and blocks
  below `diag_end` cross the diagonal (the mask is evaluated only there).
* `SparseQBlocks`: the q-side lists of a FlexAttention BlockMask for (batch, q head, kv
  block): `q_num_blocks [B, H, nKV]`, `q_indices [B, H, nKV, nQ]` (partial: mask
  evaluated) and `full_q_num_blocks`, `full_q_indices` (full: no mask). BlockMask q blocks
  are `sparse_block_m` rows (128 in flexattn), the kernel's tile is `tile_m` rows: each
  listed block expands into `factor = sparse_block_m // tile_m` consecutive tiles. B and H
  may be 1 (broadcast). Visit order: the partial list, then the full list.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from flexattn.kernels.block_sparsity import _Staged


class DenseQBlocks(_Staged):
    _fields = ("first", "n_m", "diag_end")

    def __init__(self, first, n_m, diag_end):
        self.first = Int32(first)
        self.n_m = Int32(n_m)
        self.diag_end = Int32(diag_end)     # first q block that lies fully below the diagonal

    @property
    def count(self):
        return cutlass.max(self.n_m - self.first, 0)

    def at(self, i):
        return self.first + i


class SparseQBlocks(_Staged):
    _fields = ("n_partial", "n_full", "partial", "full")

    def __init__(self, tensors, batch, head, n_block, factor: int):
        q_num, q_idx, full_num, full_idx = tensors
        b = batch % q_num.shape[0]
        h = head % q_num.shape[1]
        self.factor = factor
        self.n_partial = Int32(q_num[b, h, n_block]) * factor
        self.n_full = Int32(full_num[b, h, n_block]) * factor
        self.partial = q_idx[b, h, n_block, None]
        self.full = full_idx[b, h, n_block, None]

    @property
    def count(self):
        return self.n_partial + self.n_full

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
        # Both reads stay in bounds (clamped); the select picks the list i falls in.
        ip = cutlass.max(cutlass.min(i, self.n_partial - 1), 0)
        jf = cutlass.max(i - self.n_partial, 0)
        p = self.partial_at(ip)
        f = self.full_at(jf)
        return p if i < self.n_partial else f
