"""One kernel compile or load at a time in a process.

CuTeDSL's ``cute.compile`` is not thread-safe: it works in shared MLIR state, and
``compile.py`` swaps the DSL's global options and hooks in and out around it; a load from
the disk cache JIT-links native code. Threads that call attention at once (ranks as threads,
``core.context_parallel.LoopbackWorld``; a user's worker threads) and meet a kernel that is
not compiled yet must take turns: two compiles at once crashed the process (segfault,
4x H200, 2026-11-28). Re-entrant: a disk-cache miss compiles under the load's hold.
"""

import threading

COMPILING = threading.RLock()


def once(cache: dict, key, make):
    """``cache[key]``, made by ``make()`` (a compile or load) the first time; threads that
    miss it at once make it once (the others wait, then find it)."""
    value = cache.get(key)
    if value is None:
        with COMPILING:
            value = cache.get(key)
            if value is None:
                value = cache[key] = make()
    return value
