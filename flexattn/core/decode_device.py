"""A decode step's device side, for every adapter: the per-stream workspace, the lengths'
upload through pinned staging by the CUDA driver, and the key of a repeated step.

An adapter gives facts only: the device index, the raw stream, an allocator of its arrays
(``alloc(shape, dtype name, zeroed)``, in that stream's order) and what its arrays look
like (``facts(x)``). Driver calls go through ``cuda.bindings`` (a dependency of the core).
"""

from __future__ import annotations

import ctypes
from typing import Callable

import numpy as np

from ..problem.kvcache import KVCache, PagedKVCache
from .decode_path import DECODE_MAX_Q_LEN, DecodeWorkspace, StagingRing, decode_unsupported
from .prepared import call_identity

_WORKSPACES: dict = {}


def decode_workspace(index: int, stream: int, alloc: Callable) -> DecodeWorkspace:
    """The decode kernel's workspace on ``stream`` of device ``index`` (one per stream,
    kept): plan buffers from the adapter's allocator; the splits' partials in one float32
    scratch array, grown when a step needs more (used in the stream's order), and a second
    one allocated zeroed for the polled merge (its merges leave it zero); arrival
    tickets zeroed once, grown likewise (the kernel leaves them zero); lengths/offsets
    copied from a ``StagingRing`` of pinned slots (one ``cuMemcpyHtoDAsync`` per step,
    fences every 16 steps: the host never waits for the GPU in a steady state and never
    rewrites a slot the GPU has yet to copy)."""
    key = (index, stream)
    hit = _WORKSPACES.get(key)
    if hit is not None:
        return hit
    tickets = [alloc((0,), "int32", True)]
    scratch = [alloc((0,), "float32", False)]

    def get_tickets(n):
        if tickets[0].shape[0] < n:
            tickets[0] = alloc((max(n, 2 * tickets[0].shape[0], 1024),), "int32", True)
        return tickets[0]

    def grown(held, zeroed):
        def get(n):
            if held[0].shape[0] < n:
                held[0] = alloc((max(n, 2 * held[0].shape[0], 1 << 16),), "float32", zeroed)
            return held[0]
        return get

    ws = _WORKSPACES[key] = DecodeWorkspace(lambda shape, dtype: alloc(shape, dtype, False), get_tickets,
                                            grown(scratch, False), driver_uploader(index, stream),
                                            marked_scratch=grown([alloc((0,), "float32", True)], True),
                                            zeroed=lambda n, dtype: alloc((n,), dtype, True))
    return ws


def driver_uploader(index: int, stream: int) -> Callable:
    """``DecodeWorkspace.uploader`` for ``stream``: a ``StagingRing`` of pinned host memory
    (``cuMemHostAlloc``) copied by ``cuMemcpyHtoDAsync``, fenced by driver events."""
    from cuda.bindings import driver

    cu_stream = driver.CUstream(stream)
    memcpy, ok = driver.cuMemcpyHtoDAsync, driver.CUresult.CUDA_SUCCESS
    held = []

    def host(nbytes):
        ptr = _driver(driver, index, driver.cuMemHostAlloc, nbytes, driver.CU_MEMHOSTALLOC_PORTABLE)
        for old in held:                     # the ring waited for the old memory's copies
            driver.cuMemFreeHost(old)
        held[:] = [ptr]
        return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(int(ptr))), int(ptr)

    def copy(dst, src, nbytes):
        err = memcpy(dst, src, nbytes, cu_stream)[0]
        if err != ok:
            if err == driver.CUresult.CUDA_ERROR_INVALID_CONTEXT:   # a thread where none is bound yet
                _bind_primary_context(driver, index)
                err = memcpy(dst, src, nbytes, cu_stream)[0]
            if err != ok:
                raise RuntimeError(f"flexattn decode: cuMemcpyHtoDAsync failed: {err!r}")

    ring = StagingRing(host, copy, lambda: _Fence(driver, index, cu_stream))

    def uploader(into):
        face = getattr(into, "__cuda_array_interface__", None)
        if (face is None or face["typestr"] != "<i4" or face.get("strides") is not None
                or tuple(into.__dlpack_device__()) != (2, index)):
            raise ValueError("the decode upload goes into a contiguous int32 array on the workspace's device")
        return ring.uploader(driver.CUdeviceptr(face["data"][0]), int(np.prod(face["shape"])))

    return uploader


def _driver(driver, index: int, fn, *args):
    """``fn(*args)``'s value; binds the device's primary context on a thread without one."""
    err, *value = fn(*args)
    if err == driver.CUresult.CUDA_ERROR_INVALID_CONTEXT:
        _bind_primary_context(driver, index)
        err, *value = fn(*args)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"flexattn decode: {fn.__name__} failed: {err!r}")
    return value[0] if value else None


def _bind_primary_context(driver, index: int) -> None:
    """Make device ``index``'s primary context (the frameworks' runtime context) current on this thread."""
    err, dev = driver.cuDeviceGet(index)
    if err == driver.CUresult.CUDA_SUCCESS:
        err, ctx = driver.cuDevicePrimaryCtxRetain(dev)
        if err == driver.CUresult.CUDA_SUCCESS:
            driver.cuCtxSetCurrent(ctx)
            driver.cuDevicePrimaryCtxRelease(dev)


class _Fence:
    """A ``StagingRing`` fence: a driver event (no timing, as a framework's default) on the ring's stream."""

    __slots__ = ("_driver", "_index", "event", "stream")

    def __init__(self, driver, index: int, stream):
        self._driver, self._index, self.stream = driver, index, stream
        self.event = _driver(driver, index, driver.cuEventCreate, driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)

    def record(self):
        _driver(self._driver, self._index, self._driver.cuEventRecord, self.event, self.stream)

    def wait(self):
        _driver(self._driver, self._index, self._driver.cuEventSynchronize, self.event)


def tma_ready(strides) -> bool:
    """Strides (in elements) a decode kernel's TMA reads as they are: the head dim
    contiguous, every other stride a multiple of 8 elements."""
    return strides[-1] == 1 and not any(st % 8 for st in strides[:-1])


def kernel_step(q, cache) -> bool:
    """Whether a decode step is the split-KV kernel's to take (a 4-D query of at most
    ``DECODE_MAX_Q_LEN`` tokens, a cache with host lengths, arrays the kernel reads:
    ``decode_path.decode_unsupported``); else it is an ordinary attention problem
    (``problem.decode.decode_problem``: on the GPU the forward kernel, which takes the head
    dims the decode kernel does not, and whose checks have the last word)."""
    if not (len(q.shape) == 4 and q.shape[2] <= DECODE_MAX_Q_LEN and hasattr(cache, "host_lengths")):
        return False
    k, v, table = cache_arrays(cache)
    return decode_unsupported(q, k, v, cache.page_size if table is not None else 0) is None


def cache_arrays(cache) -> tuple:
    """(k, v, page table or None) of a ``KVCache`` / ``PagedKVCache``: what the kernel reads."""
    if hasattr(cache, "page_table"):
        return cache.k_pages, cache.v_pages, cache.page_table
    return cache.k, cache.v, None


def check_cache_layout(cache, strides: Callable, wanted: str) -> None:
    """Refuse cache K/V the decode kernel cannot read in place: ``strides(x)`` is an
    array's strides in elements, or None where it is not an array the step can read
    (``wanted`` says what is, e.g. "a torch tensor on the query's device cuda:0")."""
    names = ("k_pages", "v_pages") if hasattr(cache, "page_table") else ("k", "v")
    for name, x in zip(names, cache_arrays(cache)):
        found = strides(x)
        if found is None:
            raise ValueError(f"cache.{name} must be {wanted}")
        if not tma_ready(found):
            raise ValueError(f"cache.{name}: the head dim must be contiguous and other strides multiples of 8 (TMA)")


def decode_key(call, q, cache, facts: Callable) -> tuple | None:
    """What a repeated decode step must share with the step that made its entry: the mods'
    and scale's identity, the cache's type, and ``facts(q, k, v, page table or None,
    lengths)``: the adapter's flat tuple of what its checks read of these arrays (shapes,
    strides, dtypes, devices) and its current stream, or None for arrays it does not key.
    None where the step cannot be keyed (plain functions as mods, other caches)."""
    ident = call_identity(call)
    if ident is None:
        return None
    kind = type(cache)
    if kind is KVCache:
        found = facts(q, cache.k, cache.v, None, cache.lengths)
    elif kind is PagedKVCache:
        found = facts(q, cache.k_pages, cache.v_pages, cache.page_table, cache.lengths)
    else:
        return None
    return None if found is None else ident + (kind,) + found


__all__ = ["cache_arrays", "check_cache_layout", "decode_key", "decode_workspace", "driver_uploader", "kernel_step",
           "tma_ready"]
