"""Repeated calls: a bounded cache from what a call looks like to its prepared launch.

A steady-state caller repeats the same call: the same mod and block-mask *objects*, tensors
of the same shapes, strides, dtypes and devices. For such a call the argument checks and
the planner would find what they found last time, so an adapter keeps its launch
(``kernel_path.PreparedForward`` plus its own output allocation) under a key made of

- ``call_identity(call)``: the identities of the mod / block-mask objects, the scale and
  the GQA flag — only for immutable values (``ScoreMod``/``MaskMod``/``BlockMask``), or the
  fingerprint (``mods/trace_cache.py``) of a plain function that names no array;
- the tensors' metadata, which only the adapter knows how to read cheaply.

The cache holds the keyed objects weakly: an entry leaves when one of them dies (so an
entry never outlives its mods' captured tensors, and a recycled ``id`` never matches),
and a key is prepared on its second sighting, so one-off mod objects cost nothing extra.
A lookup is therefore one dict access: a present key names live objects, and no two live
objects share an ``id``.
"""

from __future__ import annotations

import weakref

import numpy as np

from ..blockmask import BlockMask
from ..bounded import keep_bounded
from ..mods import Mod
from ..mods.trace import is_array
from ..mods.trace_cache import fingerprint
from ..problem import bounds


def call_identity(call) -> tuple | None:
    """The cacheable part of ``call = (score_mod, block_mask, scale, enable_gqa, mask,
    score)``, or None if something in it may change between calls."""
    score_mod, block_mask, scale, enable_gqa, mask, score = call
    mods = []
    for m in (score_mod, mask, score):
        if m is None or isinstance(m, Mod):
            mods.append(id(m))
            continue
        fp = fingerprint(m)
        if fp is None or _named_bytes(fp) > SMALL_CAPTURE_BYTES:   # see _objects
            return None
        mods.append(fp.key)
    if block_mask is not None and not isinstance(block_mask, BlockMask) and not _framework_block_mask(block_mask):
        return None
    if scale is not None and type(scale) is not float and type(scale) is not int:
        return None
    return (mods[0], id(block_mask), mods[1], mods[2], scale, enable_gqa)


def _framework_block_mask(x) -> bool:
    """A framework's BlockMask (torch's): converted once per object (``as_block_mask``) and
    treated as immutable, as torch treats it; keyed by identity like ours."""
    return hasattr(x, "kv_num_blocks") and hasattr(x, "mask_mod") and hasattr(x, "BLOCK_SIZE")


def call_key(call, *facts) -> tuple | None:
    """A repeated call's key: ``call_identity(call)`` plus the ``facts`` the adapter read
    of its arrays (shapes, strides, dtypes, devices: whatever its checks read), or None
    where the call cannot be keyed."""
    ident = call_identity(call)
    return None if ident is None else ident + facts


# A plain function is keyed by its fingerprint (often a new lambda each call), which names
# its arrays by identity; a prepared entry holds its captures until it is evicted (the
# cache's capacity bounds them), so only functions naming small arrays are prepared —
# ALiBi slopes, a bias table — at most this many bytes of them.
SMALL_CAPTURE_BYTES = 1 << 16


def _named_bytes(fp) -> int:
    total = 0
    for x in fp.watched.values():
        if isinstance(x, Mod) or not is_array(x):   # functions, mods, objects: no bytes of their own
            continue
        size = 1
        for n in x.shape:
            size *= int(n)
        total += size * int(getattr(x.dtype, "itemsize", 8))
    return total


def _objects(call):
    """The objects whose death ends an entry: the mods, the block mask and the arrays a
    plain function names (its fingerprint's). The entry's prepared launch holds the
    captures it converts, so those arrays live until the entry is evicted; hence the
    ``SMALL_CAPTURE_BYTES`` bound on what a function-keyed entry may name."""
    objects = []
    for o in (call[0], call[1], call[4], call[5]):   # score_mod, block_mask, mask, score
        if o is None or isinstance(o, (Mod, BlockMask)) or _framework_block_mask(o):
            objects.append(o)
            continue
        fp = fingerprint(o)
        objects.extend(fp.watched.values() if fp is not None else ())
    return tuple(objects)


class PreparedCalls:
    """key -> adapter entry, for the calls whose objects are still alive."""

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self._entries: dict = {}   # key -> (weakrefs of the call's objects, entry)
        self._seen: dict = {}      # keys seen once

    def __len__(self):
        return len(self._entries)

    def clear(self):
        self._entries.clear()
        self._seen.clear()

    def get(self, key):
        """The entry for ``key``, or None. Its objects are the caller's: the key holds their
        ids, and the entry would have left with them (``add``'s weak references)."""
        slot = self._entries.get(key)
        return None if slot is None else slot[1]

    def run(self, key, *args):
        """A repeated call: ``entry(*args)`` of ``key``'s entry (its outputs, or None where
        the entry declines and the full path must run), or None where there is no entry
        (not prepared yet, or ``key`` None: a call that cannot be keyed)."""
        slot = self._entries.get(key)
        if slot is None or bounds.enabled():   # the debug mode checks every call
            return None
        return slot[1](*args)

    def add(self, key, call, make) -> None:
        """On the second sighting of ``key``, store ``make()`` (an entry, or None for
        calls that cannot be prepared)."""
        if key in self._entries:
            return
        if self._seen.pop(key, None) is None:
            keep_bounded(self._seen, key, True, self.capacity)
            return
        entry = make()
        if entry is None:
            return
        entries = self._entries
        on_death = lambda _, key=key: entries.pop(key, None)  # noqa: E731
        refs = tuple(None if o is None else weakref.ref(o, on_death) for o in _objects(call))
        keep_bounded(entries, key, (refs, entry), self.capacity)


class PreparedEntry:
    """What every adapter's entry (a prepared forward or decode step) keeps for allocating
    its outputs: their shapes (``out`` [B, Hq, q_len, D], ``lse`` [B, Hq, q_len]), the
    output dtype and the device, in the adapter's own objects (``device``) and as an index
    (``device_index``, compared with the current device before launching). Only the
    setup is shared: each adapter's ``__call__`` stays flat (no call through a base
    method on the hot path)."""

    __slots__ = ("out_shape", "lse_shape", "dtype", "device", "device_index")

    def __init__(self, out_shape, dtype, device, device_index: int):
        self.out_shape = tuple(out_shape)
        self.lse_shape = self.out_shape[:3]
        self.dtype, self.device, self.device_index = dtype, device, device_index


class HostCopies:
    """Host arrays (block-mask lists, numpy captures) → an adapter's device arrays, as a
    ``Device.to_device`` base: ``host(x)`` copies through the subclass's ``copy(array)``
    (a C-contiguous, writeable numpy array → a device array on ``self.device``).

    Read-only numpy arrays (block-mask lists, arrays made by the built-in mods) are copied
    once per array object and device and kept while the array lives, so steady-state calls
    copy nothing (a pageable copy would also stall the stream). Writeable host arrays may
    change between calls and are copied every call: capture device arrays to avoid that.
    """

    _cache: dict = {}   # (id(array), str(device)) -> (weakref, copy); a subclass may keep its own
    device: object = None

    def copy(self, array: np.ndarray):
        raise NotImplementedError

    def host(self, x):
        if not isinstance(x, np.ndarray) or x.flags.writeable:
            return self.copy(np.ascontiguousarray(x))
        key = (id(x), str(self.device))
        hit = self._cache.get(key)
        if hit is not None and hit[0]() is x:
            return hit[1]
        # A writeable host copy (made once per array): frameworks warn on read-only numpy memory.
        t = self.copy(np.array(x, order="C", copy=True))
        cache = self._cache  # bound now: at interpreter exit the class may be gone
        ref = weakref.ref(x, lambda _, key=key: cache.pop(key, None))
        self._cache[key] = (ref, t)
        return t


__all__ = ["HostCopies", "PreparedCalls", "PreparedEntry", "call_identity", "call_key"]
