"""The block-sparse layout of a mask, in FlexAttention's format.

The attention matrix is cut into ``BLOCK_SIZE = (q_block, kv_block)`` tiles. Each tile is
*empty* (skipped), *full* (computed without evaluating the mask) or *partial* (computed
with the mask). Per (b, h, q-block) we store the partial kv-blocks
(``kv_num_blocks``, ``kv_indices``) and the full ones (``full_kv_*``); per kv-block the
q-side transposes (``q_*``, ``full_q_*``) serve the backward. Index lists are sorted
like torch's: the listed blocks in ascending order first, the rest after.
"""

from __future__ import annotations

import copy
import weakref
from typing import NamedTuple

import numpy as np

from ..arrays import dtype_name, to_numpy, to_numpy_all
from ..bounded import keep_bounded
from ..mods import MaskMod, as_mask, full
from ..mods.mod import LIVE_OBJECTS

EMPTY, PARTIAL, FULL = 0, 1, 2

_LIST_NAMES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
               "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


class ColumnVisits(NamedTuple):
    """``BlockMask.column_visits``: q tiles per kv-block column, max / mean and mean."""

    balance: float
    mean: float


class BlockCounts(NamedTuple):
    num_blocks: np.ndarray  # [..., rows]
    indices: np.ndarray  # [..., rows, cols]


_NOT_COMPUTED = object()  # BlockMask._tile_balance (and friends) before its first computation


def _balance(counts) -> float | None:
    """max / mean of visit counts (None when nothing is visited)."""
    mean = float(counts.mean()) if counts.size else 0.0
    return float(counts.max()) / mean if mean > 0 else None


class BlockMask:
    """Which tiles of the [Q_LEN, KV_LEN] score matrix to compute, with which mask."""

    # A slice by a device index (``_device_rows``): (the sliced mask, its picks); else None.
    _row_source = None

    def __init__(self, states: np.ndarray, seq_lengths, block_size, mask_mod: MaskMod | None, num_allowed=None):
        LIVE_OBJECTS[id(self)] = self  # see mods.mod.LIVE_OBJECTS
        states = np.asarray(states, dtype=np.int8)
        if states.ndim != 4:
            raise ValueError(f"block states must be [B, H, Q_BLOCKS, KV_BLOCKS], got shape {states.shape}")
        self.seq_lengths = tuple(int(s) for s in seq_lengths)
        self.BLOCK_SIZE = tuple(int(s) for s in block_size)
        self.mask_mod = mask_mod if mask_mod is not None else full()
        self.device = "cpu"
        self._states = states
        self._batch_heads = states.shape[:2]
        self._num_allowed = num_allowed  # [B, H] exact count of attended (q, kv) pairs, if known
        self._count_allowed = None  # computes it on demand (GPU-built masks)
        self._rebuild = None  # new captures -> the block mask of the same structure (update)
        self._row_counts = None  # GPU-built: polls of the per-row counts' copies (tile_balance)
        # True when the lists were derived from mask_mod alone (create_block_mask): the mask
        # then defines the attention exactly, and a kernel may iterate by the mask's own
        # structure (core/kernel_path.py) instead of reading the lists.
        self.from_mask = False
        self._tile_balance = _NOT_COMPUTED
        self._column_visits = _NOT_COMPUTED
        self._row_pairs = _NOT_COMPUTED
        self._states_copy = None   # GPU-built: a poll of the states' host copy (_landed_states)
        partial, fullb = states == PARTIAL, states == FULL
        self._lists = dict(zip(_LIST_NAMES, (*_lists(partial), *_lists(fullb), *_lists(partial.swapaxes(-1, -2)),
                                             *_lists(fullb.swapaxes(-1, -2)))))

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_kv_blocks(cls, kv_num_blocks, kv_indices, full_kv_num_blocks=None, full_kv_indices=None,
                       BLOCK_SIZE=128, mask_mod=None, seq_lengths=None, compute_q_blocks=True, *,
                       dq_write_order=None, dq_write_order_full=None, dq_kv_order=None):
        """From kv-side lists (e.g. computed elsewhere). Lists may leave out leading dims as
        torch's do: [Q_BLOCKS, KV_BLOCKS] or [H, Q_BLOCKS, KV_BLOCKS] indices.
        ``compute_q_blocks=False``: the q-side attributes read None, as torch's do; the
        kernels still derive the q-side lists from the block states, so the backward runs
        (torch's would need them). ``dq_write_order``, ``dq_write_order_full`` and
        ``dq_kv_order`` (torch 2.13's hints for its backward's dQ writes) are accepted and
        unused: our backward plans its own order from the lists."""
        qb, kvb = _block_size(BLOCK_SIZE)
        kv_num = np.asarray(to_numpy(kv_num_blocks), dtype=np.int64)
        kv_idx = np.asarray(to_numpy(kv_indices), dtype=np.int64)
        if 2 <= kv_idx.ndim < 4 and kv_num.ndim == kv_idx.ndim - 1:   # leading (batch, head) dims of 1
            kv_idx = kv_idx.reshape((1,) * (4 - kv_idx.ndim) + kv_idx.shape)
            kv_num = kv_num.reshape(kv_idx.shape[:3])
            if full_kv_num_blocks is not None:
                full_kv_num_blocks = np.asarray(to_numpy(full_kv_num_blocks)).reshape(kv_idx.shape[:3])
                full_kv_indices = np.asarray(to_numpy(full_kv_indices)).reshape(
                    kv_idx.shape[:3] + np.shape(to_numpy(full_kv_indices))[-1:])
        if kv_idx.ndim != 4 or kv_num.shape != kv_idx.shape[:3]:
            raise ValueError(
                f"kv_indices must be [B, H, Q_BLOCKS, KV_BLOCKS] and kv_num_blocks [B, H, Q_BLOCKS];"
                f" got {kv_idx.shape} and {kv_num.shape}"
            )
        states = np.zeros(kv_idx.shape, dtype=np.int8)
        _scatter(states, kv_num, kv_idx, PARTIAL, "kv_indices")
        if full_kv_num_blocks is not None:
            _scatter(states, np.asarray(to_numpy(full_kv_num_blocks), dtype=np.int64),
                     np.asarray(to_numpy(full_kv_indices), dtype=np.int64), FULL, "full_kv_indices")
        if seq_lengths is None:
            seq_lengths = (states.shape[2] * qb, states.shape[3] * kvb)
        made = cls(states, seq_lengths, (qb, kvb), as_mask(mask_mod) if mask_mod is not None else None)
        made._q_lists_unset = not compute_q_blocks
        return made

    @classmethod
    def _on_device(cls, arrays: dict, seq_lengths, block_size, mask_mod, device, count_allowed=None):
        """A block mask whose states and lists are the device arrays in ``arrays`` (as the
        GPU builder returns them); host views are copied on demand."""
        self = cls.__new__(cls)
        LIVE_OBJECTS[id(self)] = self
        self.seq_lengths = tuple(int(s) for s in seq_lengths)
        self.BLOCK_SIZE = tuple(int(s) for s in block_size)
        self.mask_mod = mask_mod if mask_mod is not None else full()
        self.device = device
        self._states = None
        self._device_states = arrays["states"]
        self._batch_heads = tuple(int(s) for s in arrays["states"].shape[:2])
        self._num_allowed = None
        self._count_allowed = count_allowed
        self._rebuild = None
        self._row_counts = None
        self.from_mask = False
        self._tile_balance = _NOT_COMPUTED
        self._column_visits = _NOT_COMPUTED
        self._row_pairs = _NOT_COMPUTED
        self._states_copy = None
        self._lists = {name: arrays[name] for name in _LIST_NAMES}
        return self

    # -- the lists -----------------------------------------------------------------------------
    # ``kv_num_blocks`` … ``full_q_indices`` (torch's attribute names) are properties over
    # ``_present``: the arrays as kept (numpy for host-built masks, the framework's device
    # arrays for GPU-built ones), or as an adapter presents them (flexattn.torch: tensors).
    # The kernels read ``list_array``, the arrays as kept (host lists are copied to the
    # GPU once per array, which a fresh tensor per access would defeat).

    def list_array(self, name: str):
        """List ``name`` as kept: a read-only int32 numpy array, or a device array."""
        return self._lists[name]

    def _present(self, name: str):
        return self._lists[name]

    def update(self, *captures) -> "BlockMask":
        """The block mask of the same mask structure with new captured values (e.g. next
        step's document boundaries; for ``varlen_block_mask``, new offsets): no
        re-tracing, a GPU-built mask is rebuilt on its device by the kernels compiled for
        the old values, and attention kernels compiled for them serve the new ones."""
        if self._rebuild is not None:
            rebuilt = self._rebuild(*captures)
            rebuilt.from_mask = self.from_mask
            return as_class(rebuilt, type(self))
        b, h, q, kv = self.shape
        from .build import create_block_mask

        return as_class(create_block_mask(self.mask_mod.with_captures(captures), b, h, q, kv,
                                          BLOCK_SIZE=self.BLOCK_SIZE,
                                          device=None if self.device == "cpu" else self.device), type(self))

    # -- the mask applied inside partial tiles -------------------------------------------------
    @property
    def mask_mod(self) -> MaskMod:
        if self._mask_mod is None:
            raise ValueError("this block mask was sliced (block_mask[...]): its mask_mod is unset, as torch's is;"
                             " set block_mask.mask_mod to the mask of the sliced rows (e.g. shifted to their"
                             " positions) before using it")
        return self._mask_mod

    @mask_mod.setter
    def mask_mod(self, value):
        """Any mask mod or function. A mask other than the one the lists were derived from
        (another structure, or other captured values) ends ``from_mask``: the lists then
        keep their meaning, as in torch."""
        new = as_mask(value, "block_mask.mask_mod") if value is not None else full()
        old = self.__dict__.get("_mask_mod")
        if old is not None and not _same_mask(old, new):
            self.from_mask = False
        self._mask_mod = new

    # -- views ---------------------------------------------------------------------------------
    @property
    def shape(self):
        return tuple(self._batch_heads) + self.seq_lengths

    def numel(self) -> int:
        """B * H * Q_LEN * KV_LEN (torch's: not accounting for sparsity)."""
        return int(np.prod(self.shape, dtype=np.int64))

    def __getitem__(self, index) -> "BlockMask":
        """torch's slicing over (batch, head, q block): ints keep their dimension (as
        torch's do), slices and index arrays select; ``seq_lengths`` stay, and the mask_mod
        is unset — set ``mask_mod`` for the sliced rows before use, as torch requires."""
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > 3:
            raise IndexError(f"a block mask is indexed by (batch, head, q block), got {len(index)} indices")
        devices = [_device_index(i) for i in index]
        if any(d is not None for d in devices):
            sliced = self._device_rows(index, devices)
            if sliced is not None:
                return sliced
        states = self._host_states()
        picks, key = [], []
        for dim, i in enumerate(index):
            if isinstance(i, (int, np.integer)) and not isinstance(i, bool):
                n = states.shape[dim]
                if not -n <= int(i) < n:
                    raise IndexError(f"index {int(i)} out of range for dimension {dim} of size {n}")
                i = slice(int(i) % n, int(i) % n + 1)
                key.append((i.start,))                # (the row an index array [i] names too)
            elif not isinstance(i, slice):
                i = np.asarray(to_numpy(i)).astype(np.int64).reshape(-1)
                key.append(tuple(i.tolist()))
            else:
                key.append(("slice", i.start, i.stop, i.step))
            picks.append(i)
        # A decoder slices the row of its position every step: the rows' states, lists and
        # walk tables are kept on this (immutable) mask and shared by its slices alike.
        shared = self.__dict__.setdefault("_slices", {})
        template = shared.get(tuple(key))
        if template is None:   # (never handed out: each slice is a shallow copy of it)
            picked = states
            for dim, i in enumerate(picks):
                picked = picked[(slice(None),) * dim + (i,)]
            template = type(self)(picked, self.seq_lengths, self.BLOCK_SIZE, None)
            template._mask_mod = None   # unset, as torch leaves it (its getter names the fix)
            template._kv_tables = {}    # shared by the copies (it depends on the states alone)
            keep_bounded(shared, tuple(key), template, _SLICES_KEPT)
        return _copy_of(template)

    def _device_rows(self, index: tuple, devices: list) -> "BlockMask | None":
        """``self[index]`` where one index is an integer array on a GPU (gpt-fast's
        ``block_mask[:, :, input_pos // 128]``, its position on the device): the states are
        indexed there and the lists compacted there when first read (``GpuBuilder.compact``),
        so slicing neither copies the index to the host nor waits for the GPU. The slice
        keeps ``_row_source = (self, picks)`` (``picks``: per dim a slice or the device
        index) for adapters that walk the parent's rows on the device. None where no GPU
        builder serves the index's device, or for several array indices (their host path
        slices dim by dim). ``devices``: ``_device_index`` of each index."""
        picks, where = [], None
        for dim, (i, device) in enumerate(zip(index, devices)):
            if device is not None:
                if where is not None:
                    return None
                where, where_index, i = device, i, i.reshape(-1)
            elif isinstance(i, (int, np.integer)) and not isinstance(i, bool):
                n = self._batch_heads[dim] if dim < 2 else self.num_blocks[0]
                if not -n <= int(i) < n:
                    raise IndexError(f"index {int(i)} out of range for dimension {dim} of size {n}")
                i = slice(int(i) % n, int(i) % n + 1)
            elif not isinstance(i, slice):
                return None
            picks.append(i)
        found = self._states_on_device(where)
        if found is None or _framework(found[1]) != _framework(where_index):
            return None   # (no adapter there, or a CuPy index into torch's states: the host path)
        device, states = found
        for dim, i in enumerate(picks):   # (one array index: dim by dim is numpy's meaning)
            if not (isinstance(i, slice) and i == slice(None)):
                states = states[(slice(None),) * dim + (i,)]
        if hasattr(states, "contiguous"):   # (torch: the compactor reads dense states)
            states = states.contiguous()
        templates = self.__dict__.setdefault("_device_row_templates", {})
        template = templates.get(device)
        if template is None:   # (never handed out: each slice is a shallow copy of it)
            template = templates[device] = type(self)._on_device(
                {"states": states, **dict.fromkeys(_LIST_NAMES)}, self.seq_lengths, self.BLOCK_SIZE, None, device)
            template._mask_mod = None   # unset, as torch leaves it (its getter names the fix)
        made = _copy_of(template)
        made._device_states, made._batch_heads = states, tuple(int(n) for n in states.shape[:2])
        made._lists = _CompactedOnRead(lambda: _compacted(states, device))
        made._row_source = (self, tuple(picks))
        return made

    def _states_on_device(self, device: str):
        """``(device, states)``: the tile states as a device array — a GPU-built mask's own
        (on its device), a host-built one's copied to ``device`` once; None where no
        adapter serves ``device``."""
        if self.__dict__.get("_device_states") is not None:
            return self.device, self._device_states
        copies = self.__dict__.setdefault("_device_copies", {})
        if device not in copies:
            from .device import gpu_builder

            builder, arrays = gpu_builder(device)
            if builder is None:
                return None
            copies[device] = arrays.to_device(self._states)
        return device, copies[device]

    def _adjust(self, new_q_len: int, new_kv_len: int) -> "BlockMask":
        """torch's ``_adjust``: the same mask for new lengths, keeping the tiles of the
        first ceil(new_q_len / q_block) rows and ceil(new_kv_len / kv_block) columns (what
        torch's lists keep); tiles beyond the old lengths, if the new ones are longer, empty."""
        qb, kvb = self.BLOCK_SIZE
        rows, cols = -(-int(new_q_len) // qb), -(-int(new_kv_len) // kvb)
        states = self._host_states()
        adjusted = np.zeros(states.shape[:2] + (rows, cols), np.int8)
        r, c = min(rows, states.shape[2]), min(cols, states.shape[3])
        adjusted[:, :, :r, :c] = states[:, :, :r, :c]
        out = type(self)(adjusted, (new_q_len, new_kv_len), self.BLOCK_SIZE, None)
        out._mask_mod = self._mask_mod
        return out

    @property
    def num_allowed(self):
        """[B, H] exact count of attended (q, kv) pairs (FLOP accounting), or None if unknown.
        GPU-built masks count on first access (a second kernel pass without early exit)."""
        if self._num_allowed is None and self._count_allowed is not None:
            self._num_allowed = self._count_allowed()
        return self._num_allowed

    def _host_states(self) -> np.ndarray:
        if self._states is None:  # GPU-built: one host copy, on demand
            self._states = np.asarray(to_numpy(self._device_states), dtype=np.int8)
        return self._states

    @property
    def num_blocks(self) -> tuple:
        """(Q_BLOCKS, KV_BLOCKS) of the lists (without a GPU-built mask's host copy)."""
        states = self._states if self._states is not None else self._device_states
        return tuple(int(n) for n in states.shape[2:])

    def block_states(self) -> np.ndarray:
        """[B, H, Q_BLOCKS, KV_BLOCKS] int8: 0 empty, 1 partial, 2 full."""
        return self._host_states().copy()

    def kv_block_table(self, batch: int):
        """``(table, counts, full_but_last)`` for a walk over the listed kv blocks of a block
        mask with one row of q blocks whose heads all list the same blocks (a decoding
        step's; torch's ``PagedAttention`` pages): ``table`` int32 [batch, most blocks
        listed], each sequence's kv blocks, full ones first (ascending), then partial ones;
        ``counts`` int32 [batch] how many it lists; ``full_but_last``: no sequence lists a
        partial block before its last. Read-only, computed once per batch size; None for
        other block masks."""
        tables = self.__dict__.setdefault("_kv_tables", {})
        if batch not in tables:
            states = self._host_states()
            b, h, rows, cols = states.shape
            table = None
            if rows == 1 and b in (1, batch) and (h == 1 or np.all(states == states[:, :1])):
                row = np.broadcast_to(states[:, 0, 0, :], (batch, cols))
                counts = (row != EMPTY).sum(axis=1).astype(np.int32)
                table = np.zeros((batch, max(1, int(counts.max(initial=0)))), np.int32)
                for i in range(batch):
                    blocks = np.concatenate([np.flatnonzero(row[i] == FULL), np.flatnonzero(row[i] == PARTIAL)])
                    table[i, :blocks.size] = blocks
                table.flags.writeable = counts.flags.writeable = False   # device copies may be cached
                table = (table, counts, bool(np.all((row == PARTIAL).sum(axis=1) <= 1)))
            tables[batch] = table
        return tables[batch]

    def to_dense(self) -> np.ndarray:
        """[B, H, Q_BLOCKS, KV_BLOCKS] int32: 1 where a tile is computed (partial or full)."""
        return (self._host_states() != EMPTY).astype(np.int32)

    def sparsity(self) -> float:
        """Percentage of tiles skipped (torch's definition)."""
        return 100.0 * (1.0 - float(self.to_dense().mean()))

    def tile_balance(self) -> float | None:
        """max / mean of the tiles each (batch, head, q block) row visits (partial + full),
        or None for one that visits nothing or cannot be known yet without waiting for the
        GPU. 1.0: every row does the same work. From the host states; for a GPU-built mask,
        from its tile states' or (masks too big to copy whole) its per-row counts'
        asynchronous copy to the host once landed (started by the builder where the
        framework offers ``DeviceArrays.download``), before that from interval analysis of
        its tiles on the host when its mask captures only numbers (a window, a dilated band:
        exact up to tiles the GPU found empty inside undecided ones). Kept once known (the
        planner asks on every planned call); while unknown, calls plan without it (one CTA
        per tile: the same results)."""
        if self._tile_balance is _NOT_COMPUTED:
            counts = self._tile_counts(axis=-1)
            if counts is None:
                return None   # not known yet: ask again next call
            self._tile_balance = _balance(counts)
        return self._tile_balance

    def column_visits(self) -> "ColumnVisits | None":
        """The backward's work per kv tile: over the (batch, head, kv block) columns, how
        many q tiles visit each (partial + full) — its max / mean (``balance``, as
        ``tile_balance`` for rows) and its mean. From the tile states (host, or a GPU-built
        mask's landed copy) or, for a mask capturing only numbers, its interval analysis;
        None while unknown (also for masks too big to copy their states) or where nothing
        is visited."""
        if self._column_visits is _NOT_COMPUTED:
            counts = self._tile_counts(axis=-2)
            if counts is None:
                return None   # not known yet: ask again next call
            balance = _balance(counts)
            self._column_visits = None if balance is None else ColumnVisits(balance, float(counts.mean()))
        return self._column_visits

    def _tile_counts(self, axis: int):
        """Visited (partial + full) tiles summed along ``axis`` of the [B, H, Q_BLOCKS,
        KV_BLOCKS] states (-1: per row, -2: per column), from the states on the host, the
        GPU builder's per-row counts (rows only), or interval analysis of a mask capturing
        only numbers; None if none is at hand."""
        states = self._landed_states()
        if states is not None:
            return (states != EMPTY).sum(axis=axis, dtype=np.int64)
        counts = self._downloaded_row_counts() if axis == -1 else None
        if counts is not None:
            return counts
        if self.from_mask and all(isinstance(c, (int, float)) for c in self.mask_mod.captures):
            from .build import tile_verdicts

            verdicts = tile_verdicts(self.mask_mod, *self._batch_heads, *self.seq_lengths, *self.BLOCK_SIZE)
            return (verdicts != 0).sum(axis=axis, dtype=np.int64)
        return None

    def row_pairs_match(self) -> bool | None:
        """Whether each pair of q-block rows (0 and 1, 2 and 3, ...) of every (batch, head)
        visits the same kv tiles in the same states, with an even number of rows: then the
        two rows' lists are identical, and two CTAs of a cluster can walk them in step,
        sharing each K/V load (``FwdConfig.cluster_m``). Documents whose boundaries fall on
        every other q block do. From the host states; for a GPU-built mask from their
        asynchronous host copy (None until it has landed, or when the builder kept none)."""
        if self._row_pairs is _NOT_COMPUTED:
            states = self._landed_states()
            if states is None:
                return None   # not known yet: ask again next call
            rows = states.shape[2]
            self._row_pairs = bool(rows % 2 == 0 and np.array_equal(states[:, :, 0::2], states[:, :, 1::2]))
        return self._row_pairs

    def has_partial_tiles(self) -> bool | None:
        """Whether any tile is listed partial, i.e. whether a kernel ever evaluates
        ``mask_mod`` (full tiles skip it, as in torch). From the host states; for a
        GPU-built mask from its states' or per-row counts' asynchronous host copy (None
        until landed, or when the builder kept neither). Kept once known; set up front
        where the lists and the states disagree (a GPU build with
        ``separate_full_blocks=False`` lists full tiles as partial)."""
        known = self.__dict__.get("_has_partial", _NOT_COMPUTED)
        if known is _NOT_COMPUTED:
            states = self._landed_states()
            if states is not None:
                known = bool((states == PARTIAL).any())
            else:
                polls = self._row_counts   # (partial, full) tiles per row
                partial = None if polls is None else polls[0]()
                if partial is None:
                    return None   # not known yet: ask again next call
                known = bool(np.any(np.asarray(partial) > 0))
            self._has_partial = known
        return known

    def _landed_states(self):
        """The tile states on the host without waiting for the GPU: kept (host-built, or
        copied by ``_host_states``), or a GPU-built mask's asynchronous copy once landed;
        None while in flight or where the builder started none."""
        if self._states is not None:
            return self._states
        poll = self._states_copy
        return None if poll is None else poll()

    def _downloaded_row_counts(self):
        """Partial + full tiles per row from the GPU builder's asynchronous copies, or None
        while they are in flight (or were never started)."""
        polls = self._row_counts
        if polls is None:
            return None
        parts = [poll() for poll in polls]
        if any(p is None for p in parts):
            return None
        return np.asarray(parts[0], dtype=np.int64) + np.asarray(parts[1], dtype=np.int64)

    def density(self) -> float | None:
        """Fraction of (q, kv) pairs attended, exact; for FLOP accounting."""
        if self.num_allowed is None:
            return None
        q, kv = self.seq_lengths
        return float(np.mean(self.num_allowed)) / (q * kv)

    def as_tuple(self, flatten: bool = True):
        """The lists and sizes in torch's order (without the dQ-order fields newer torch
        versions add); ``flatten=False`` keeps ``seq_lengths`` and ``BLOCK_SIZE`` as pairs."""
        lists = (self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices,
                 self.q_num_blocks, self.q_indices, self.full_q_num_blocks, self.full_q_indices)
        if flatten:
            return (*self.seq_lengths, *lists, *self.BLOCK_SIZE, self.mask_mod)
        return (self.seq_lengths, *lists, self.BLOCK_SIZE, self.mask_mod)

    def to_string(self, grid_size=(20, 20), limit: int = 4, max_blocks: int | None = None) -> str:
        """Tile picture per (b, h), as torch draws it: █ all computed, ░ some, blank none,
        each character a section of tiles so that at most ``grid_size`` (rows, cols; an int
        for both, -1 for every tile) are drawn, for the first ``limit`` (b, h). ``max_blocks``
        (ours, older): the first that many tiles, uncompressed."""
        computed = self._host_states() != EMPTY
        rows, cols = computed.shape[2:]
        if max_blocks is not None:
            computed = computed[:, :, :max_blocks, :max_blocks]
            rows, cols = computed.shape[2:]
            grid_size = -1
        max_rows, max_cols = (rows, cols) if grid_size == -1 else \
            (grid_size, grid_size) if isinstance(grid_size, int) else tuple(grid_size)
        row_step, col_step = max(1, -(-rows // max_rows)), max(1, -(-cols // max_cols))
        parts = []
        for i, (b, h) in enumerate(np.ndindex(*computed.shape[:2])):
            if i == limit:
                parts += ["...", "To print out more, set BlockMask.to_string(limit=N)",
                          "You can also index (BlockMask[batch, head]) to choose a specific batch or head"]
                break
            lines = [f"({b}, {h})"]
            for r in range(0, rows, row_step):
                line = ""
                for c in range(0, cols, col_step):
                    share = computed[b, h, r:r + row_step, c:c + col_step].mean()
                    line += ("█" if share == 1 else " " if share == 0 else "░") * 2
                lines.append(line)
            parts.append("\n".join(lines) + "\n")
        return "\n".join(parts)

    def to(self, device) -> "BlockMask":
        """This block mask on ``device``: the CPU gives host lists; a GPU device that an
        imported adapter serves gives its arrays there (as ``create_block_mask(device=)``
        builds them); the mask, its structure and ``from_mask`` are kept."""
        from .device import _device_arrays

        arrays = _device_arrays(device)
        if arrays is None:   # the host
            if self.device == "cpu":
                return self
            out = type(self)(self._host_states(), self.seq_lengths, self.BLOCK_SIZE, None)
        else:
            listed = {name: arrays.to_device(np.ascontiguousarray(self.list_array(name))) for name in _LIST_NAMES}
            listed["states"] = arrays.to_device(np.ascontiguousarray(self._host_states()))
            out = type(self)._on_device(listed, self.seq_lengths, self.BLOCK_SIZE, None, arrays.device)
            out._states = self._host_states()
            if "_has_partial" in self.__dict__:   # (the lists' own answer, where states say otherwise)
                out._has_partial = self._has_partial
        out._mask_mod, out.from_mask = self._mask_mod, self.from_mask
        out._num_allowed = self._num_allowed
        return out

    def __repr__(self):
        b, h, q, kv = self.shape
        name = "unset (sliced)" if self._mask_mod is None else (self._mask_mod.name or "custom")
        return (
            f"BlockMask(shape=(B={b}, H={h}, Q_LEN={q}, KV_LEN={kv}), BLOCK_SIZE={self.BLOCK_SIZE},"
            f" sparsity={self.sparsity():.2f}%, partial={int((self._host_states() == PARTIAL).sum())},"
            f" full={int((self._host_states() == FULL).sum())}, mask_mod={name}"
            + ("" if self.device == "cpu" else f", device={self.device!r}") + ")"
        )

    def __str__(self):
        return repr(self) + "\n" + self.to_string()


_CONVERTED: dict = {}   # id(framework block mask) -> (weakref to it, our BlockMask)


def as_class(block_mask: BlockMask, cls: type) -> BlockMask:
    """``block_mask`` as ``cls``, a ``BlockMask`` subclass of an adapter that presents the
    lists its own way and adds no state (a class swap is all it takes): the same object."""
    if type(block_mask) is not cls:
        block_mask.__class__ = cls
    return block_mask


def _list_property(name: str) -> property:
    def present(self):
        if "q_" in name and self.__dict__.get("_q_lists_unset"):
            return None      # from_kv_blocks(compute_q_blocks=False), as torch's
        return self._present(name)
    return property(present, doc=f"torch's ``{name}`` (see ``BlockMask._present``).")


for _name in _LIST_NAMES:
    setattr(BlockMask, _name, _list_property(_name))
del _name


def as_block_mask(block_mask):
    """A framework's BlockMask with torch's attributes (same lists; its mask_mod is traced)
    → ours; ours and None pass as they are. Converted once per object (its lists are read
    to the host: a copy the GPU must finish first), and kept while it lives. A converted
    mask whose mask is a band (causal, a window) and whose tiles are exactly the ones that
    mask classifies to (as torch's create_block_mask makes them) is marked ``from_mask``:
    the kernels may then iterate by the mask's own structure, as for ours."""
    if block_mask is None or isinstance(block_mask, BlockMask):
        return block_mask
    hit = _CONVERTED.get(id(block_mask))
    if hit is not None and hit[0]() is block_mask:
        return hit[1]
    needed = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "BLOCK_SIZE", "seq_lengths", "mask_mod")
    if not all(hasattr(block_mask, a) for a in needed):
        raise TypeError(f"block_mask must be a BlockMask, got {type(block_mask).__name__}")
    ours = _from_lists(block_mask)
    ours.mask_mod = as_mask(block_mask.mask_mod, "block_mask.mask_mod")
    ours.from_mask = _tiles_are_the_masks(ours)
    try:
        ref = weakref.ref(block_mask, lambda _, key=id(block_mask): _CONVERTED.pop(key, None))
    except TypeError:   # not weakly referenceable: convert every call
        return ours
    _CONVERTED[id(block_mask)] = (ref, ours)
    return ours


# Small lists (a decoding step's row: torch's PagedAttention converts a new block mask every
# step, a compiled gpt-fast step slices one in its graph) by their contents: the states,
# lists and walk tables of lists seen before are shared, each conversion still a block mask
# of its own (its mask_mod, its walks).
_SHARED_LISTS_BYTES = 1 << 16
_LIST_TEMPLATES: dict = {}
_LIST_TEMPLATES_KEPT = 64


def _from_lists(block_mask) -> BlockMask:
    """Our ``BlockMask`` of a framework block mask's kv-side lists (its mask_mod unset)."""
    block_size, seq_lengths = tuple(block_mask.BLOCK_SIZE), tuple(block_mask.seq_lengths)
    lists = [None if x is None else np.asarray(x) for x in to_numpy_all(
        (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks, block_mask.full_kv_indices))]
    key = None
    if sum(x.nbytes for x in lists if x is not None) <= _SHARED_LISTS_BYTES:
        key = (block_size, seq_lengths) + tuple(None if x is None else (x.shape, x.dtype.str, x.tobytes())
                                                for x in lists)
        template = _LIST_TEMPLATES.get(key)
        if template is not None:
            return _copy_of(template)
    made = BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=block_size, seq_lengths=seq_lengths)
    if key is not None:
        template = copy.copy(made)            # (never handed out)
        template._kv_tables = made._kv_tables = {}
        keep_bounded(_LIST_TEMPLATES, key, template, _LIST_TEMPLATES_KEPT)
    return made


def _device_index(i):
    """``"cuda:N"`` for an integer array on a CUDA device (by DLPack), else None."""
    if isinstance(i, (int, slice, np.ndarray, np.integer)) or not hasattr(i, "__dlpack_device__"):
        return None
    kind, number = i.__dlpack_device__()
    # (DLPack's kDLCUDA; signed integers only: torch reads a uint8 / bool index as a mask)
    if int(kind) != 2 or getattr(i, "dtype", None) is None or dtype_name(i) not in ("int64", "int32", "int16", "int8"):
        return None
    return f"cuda:{int(number)}"


def _framework(array) -> str:
    """The top-level module of an array's type (torch, cupy, ...)."""
    return type(array).__module__.split(".")[0]


def _compacted(states, device: str) -> dict:
    """The eight lists of device ``states``, compacted on ``device`` (``GpuBuilder.compact``)."""
    from .device import gpu_builder

    builder, arrays = gpu_builder(device)
    return builder.compact(states, arrays)


class _CompactedOnRead(dict):
    """A device slice's eight lists, compacted on the device when one is first read."""

    def __init__(self, compact):
        super().__init__()
        self._compact = compact

    def __missing__(self, name):
        self.update(self._compact())
        return dict.__getitem__(self, name)


def _copy_of(template: BlockMask) -> BlockMask:
    """A block mask of its own over a kept template's states, lists and walk tables (a
    shallow copy; its own mask_mod and per-object caches from here on)."""
    made = copy.copy(template)
    LIVE_OBJECTS[id(made)] = made
    return made


def _tiles_are_the_masks(block_mask: BlockMask) -> bool:
    """Whether a host block mask's lists add nothing to its mask: no tile the mask attends
    is left out, and every tile listed full is full (partial tiles apply the mask, so
    listing a full or empty tile as partial changes nothing — torch's lists do that for
    a last, padded row of tiles). Checked for band masks only (the structures a kernel
    iterates without lists; they capture only numbers, so the host classification is
    cheap)."""
    from ..mods.structure import diagonal_band
    from .build import create_block_mask

    mask = block_mask.mask_mod
    if diagonal_band(mask.expr) is None or block_mask._states is None:
        return False
    b, h = block_mask._batch_heads
    q_len, kv_len = block_mask.seq_lengths
    expected = create_block_mask(mask, b, h, q_len, kv_len, BLOCK_SIZE=block_mask.BLOCK_SIZE)
    exact = np.broadcast_to(expected._states, block_mask._states.shape)
    given = block_mask._states
    return bool(np.all((given != EMPTY) | (exact == EMPTY)) and np.all((given != FULL) | (exact == FULL)))


def _same_mask(a: MaskMod, b: MaskMod) -> bool:
    """The same mask: one structure and the same captured values (numbers equal, arrays the
    same objects)."""
    if a is b:
        return True
    if a.structure_key != b.structure_key or len(a.captures) != len(b.captures):
        return False
    return all(x is y or (isinstance(x, (int, float)) and isinstance(y, (int, float)) and x == y)
               for x, y in zip(a.captures, b.captures))


def _block_size(bs):
    def positive_int(x):
        return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)) and x > 0

    pair = (bs, bs) if positive_int(bs) else bs
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(positive_int(x) for x in pair)):
        raise ValueError(f"BLOCK_SIZE must be a positive int or a (q_block, kv_block) pair, got {bs!r}")
    return int(pair[0]), int(pair[1])


_SLICES_KEPT = 256   # per block mask: rows a decoder visits (one per q block), bounded


def _lists(selected: np.ndarray) -> BlockCounts:
    """Counts and stable-sorted indices (selected first, ascending), as torch orders them."""
    num = selected.sum(-1).astype(np.int32)
    idx = np.argsort(~selected, axis=-1, kind="stable").astype(np.int32)
    num.flags.writeable = idx.flags.writeable = False  # immutable: device copies may be cached
    return BlockCounts(num, idx)


def _scatter(states, num, idx, value, what):
    if np.any(num < 0) or np.any(num > idx.shape[-1]):
        raise ValueError(f"block counts for {what} must lie in [0, {idx.shape[-1]}]")
    if np.any((idx < 0) | (idx >= states.shape[-1])):
        raise ValueError(f"{what} holds block indices outside [0, {states.shape[-1]})")
    listed = np.arange(idx.shape[-1]) < num[..., None]
    b, h, r, c = np.nonzero(listed)
    states[b, h, r, idx[b, h, r, c]] = value

