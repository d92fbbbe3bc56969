"""KV caches for decoding: contiguous and paged, framework-neutral.

Both hold arrays of any framework that supports in-place item assignment (numpy, torch,
cupy) and a per-batch ``lengths`` vector (valid tokens). Decoding attends the last
``q_len`` tokens of each sequence — the ones just appended — to the valid part of the
cache, with mods seeing true positions (``flexattn.mods.positions``).

Paged layout (vLLM-style): ``k_pages, v_pages`` are [num_pages, page_size, H_kv, D];
``page_table[b, i]`` is the physical page holding logical tokens
``[i·page_size, (i+1)·page_size)`` of sequence ``b``. Mods and block masks are written in
logical indices and work unchanged.
"""

from __future__ import annotations

import numpy as np

from ..arrays import to_numpy


def _host_ints(x, what) -> np.ndarray:
    arr = np.asarray(to_numpy(x))
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    return arr.astype(np.int64)


def _check_new(new_k, new_v, batch, heads, head_dim, v_head_dim):
    for name, x, d in (("new_k", new_k, head_dim), ("new_v", new_v, v_head_dim)):
        if len(x.shape) != 4 or x.shape[0] != batch or x.shape[1] != heads or x.shape[3] != d:
            raise ValueError(f"{name} must be [B={batch}, H_kv={heads}, n, {d}], got {tuple(x.shape)}")
    if new_k.shape[2] != new_v.shape[2]:
        raise ValueError(f"new_k and new_v hold different token counts: {new_k.shape[2]} and {new_v.shape[2]}")
    return int(new_k.shape[2])


class KVCache:
    """Contiguous cache: ``k``, ``v`` [B, H_kv, capacity, D]; ``lengths`` [B] valid tokens."""

    def __init__(self, k, v, lengths):
        if len(k.shape) != 4 or len(v.shape) != 4 or tuple(k.shape[:3]) != tuple(v.shape[:3]):
            raise ValueError(f"k and v must be [B, H_kv, capacity, D] alike, got {tuple(k.shape)} and {tuple(v.shape)}")
        self.k, self.v, self.lengths = k, v, lengths
        n = _host_ints(lengths, "lengths")
        if n.shape[0] != k.shape[0] or np.any(n < 0) or np.any(n > k.shape[2]):
            raise ValueError(f"lengths must be [B={k.shape[0]}] within [0, capacity={k.shape[2]}], got {n.tolist()}")

    @property
    def capacity(self) -> int:
        return int(self.k.shape[2])

    def host_lengths(self) -> np.ndarray:
        return _host_ints(self.lengths, "lengths")

    def append(self, new_k, new_v) -> None:
        """Write ``new_k/new_v`` [B, H_kv, n, D] after each sequence's valid tokens."""
        B, H, _, D = (int(s) for s in self.k.shape)
        n = _check_new(new_k, new_v, B, H, D, int(self.v.shape[3]))
        lengths = self.host_lengths()
        if np.any(lengths + n > self.capacity):
            raise ValueError(f"appending {n} tokens overflows the cache (capacity {self.capacity}, lengths {lengths.tolist()})")
        for b, start in enumerate(lengths.tolist()):
            self.k[b, :, start:start + n] = new_k[b]
            self.v[b, :, start:start + n] = new_v[b]
        self.lengths += n

    def logical_kv(self):
        """(k, v) [B, H_kv, capacity, D] in logical order: the cache itself."""
        return self.k, self.v


class PagedKVCache:
    """Paged cache: ``k_pages``, ``v_pages`` [num_pages, page_size, H_kv, D],
    ``page_table`` [B, max_pages] (physical page of each logical page), ``lengths`` [B]."""

    def __init__(self, k_pages, v_pages, page_table, lengths):
        if len(k_pages.shape) != 4 or tuple(k_pages.shape[:3]) != tuple(v_pages.shape[:3]):
            raise ValueError(
                f"k_pages and v_pages must be [num_pages, page_size, H_kv, D] alike, got {tuple(k_pages.shape)} and {tuple(v_pages.shape)}"
            )
        if len(page_table.shape) != 2:
            raise ValueError(f"page_table must be [B, max_pages], got shape {tuple(page_table.shape)}")
        self.k_pages, self.v_pages, self.page_table, self.lengths = k_pages, v_pages, page_table, lengths
        table = np.asarray(to_numpy(page_table))
        if table.dtype.kind not in "iu" or np.any(table < 0) or np.any(table >= k_pages.shape[0]):
            raise ValueError(f"page_table must hold page numbers in [0, {k_pages.shape[0]})")
        n = _host_ints(lengths, "lengths")
        if n.shape[0] != table.shape[0] or np.any(n < 0) or np.any(n > self.capacity):
            raise ValueError(f"lengths must be [B={table.shape[0]}] within [0, capacity={self.capacity}], got {n.tolist()}")

    @property
    def page_size(self) -> int:
        return int(self.k_pages.shape[1])

    @property
    def capacity(self) -> int:
        """Logical tokens per sequence the page table can address."""
        return int(self.page_table.shape[1]) * self.page_size

    def host_lengths(self) -> np.ndarray:
        return _host_ints(self.lengths, "lengths")

    def assign(self, b: int, positions, new_k, new_v) -> None:
        """Write tokens [H_kv, n, D] of sequence ``b`` at logical ``positions`` (n ints)."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if np.any(pos < 0) or np.any(pos >= self.capacity):
            raise ValueError(f"positions must lie in [0, {self.capacity})")
        table = np.asarray(to_numpy(self.page_table))
        pages = table[b, pos // self.page_size].tolist()
        slots = (pos % self.page_size).tolist()
        self.k_pages[pages, slots] = new_k.swapaxes(0, 1)  # [n, H_kv, D]
        self.v_pages[pages, slots] = new_v.swapaxes(0, 1)

    def append(self, new_k, new_v) -> None:
        """Write ``new_k/new_v`` [B, H_kv, n, D] after each sequence's valid tokens."""
        B = int(self.page_table.shape[0])
        H, D = int(self.k_pages.shape[2]), int(self.k_pages.shape[3])
        n = _check_new(new_k, new_v, B, H, D, int(self.v_pages.shape[3]))
        lengths = self.host_lengths()
        if np.any(lengths + n > self.capacity):
            raise ValueError(f"appending {n} tokens overflows the page table (capacity {self.capacity}, lengths {lengths.tolist()})")
        for b, start in enumerate(lengths.tolist()):
            self.assign(b, np.arange(start, start + n), new_k[b], new_v[b])
        self.lengths += n

    def logical_kv(self):
        """(k, v) [B, H_kv, capacity, D] gathered in logical order (a materialized copy —
        for the reference and as a stopgap; the decode kernel reads pages in place)."""
        table = self.page_table

        def gather(pages):
            x = pages[table]  # [B, max_pages, page_size, H_kv, D]
            B, P, S, H, D = (int(s) for s in x.shape)
            return x.reshape(B, P * S, H, D).swapaxes(1, 2)

        return gather(self.k_pages), gather(self.v_pages)
