"""Which kv blocks a CTA visits, and in what order.

Both the producer (TMA loads) and the consumers (MMAs) walk the same sequence; each
source below gives `count` and `at(i)` (the kv block index of the i-th visit).

* `DenseBlocks`: blocks n_max-1 down to 0 (the caller computes n_max, e.g. limited by the
  causal diagonal).
* `SparseBlocks`: one (batch, head, q-block) row of a FlexAttention-style BlockMask —
  `kv_num_blocks [B, H, nQ]`, `kv_indices [B, H, nQ, nKV]` (partial blocks: the mask must be
  evaluated) and `full_kv_num_blocks`, `full_kv_indices` (full blocks: no mask). The visit
  order is the partial list, then the full list, each in its stored order. B and H may be 1
  (broadcast). Block sizes are the kernel's tile_m x tile_n.
"""

import copy

import cutlass
import cutlass.cute as cute
from cutlass import Int32


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

    def __init__(self, tensors, batch, head, m_block):
        kv_num, kv_idx, full_num, full_idx = tensors
        b = batch % kv_num.shape[0]
        h = head % kv_num.shape[1]
        self.n_partial = Int32(kv_num[b, h, m_block])
        self.n_full = Int32(full_num[b, h, m_block])
        self.count = self.n_partial + self.n_full
        self.partial = kv_idx[b, h, m_block, None]
        self.full = full_idx[b, h, m_block, None]

    def partial_at(self, i):
        return Int32(self.partial[i])

    def full_at(self, i):
        return Int32(self.full[i])

    @cute.jit
    def at(self, i):
        # Both reads stay in bounds (clamped); the select picks the list i falls in.
        ip = cutlass.max(cutlass.min(i, self.n_partial - 1), 0)
        jf = cutlass.max(i - self.n_partial, 0)
        p = Int32(self.partial[ip])
        f = Int32(self.full[jf])
        return p if i < self.n_partial else f
