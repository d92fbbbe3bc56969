"""Compile a test module's kernels in parallel processes (CPU CI has two cores; one kernel's
compile is a single-threaded trace, MLIR lowering and ptxas of 2-6 s).

``compile_all(fn, names)`` returns ``{name: fn(name)}``, computed in spawned worker
processes: ``fn`` must be a module-level function of an importable module, taking a name
and returning something picklable (a PTX string). A worker's exception re-raises here.
``FLEXATTN_TEST_COMPILE_WORKERS=1`` compiles in this process instead (for debugging).
"""

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor


def workers() -> int:
    text = os.environ.get("FLEXATTN_TEST_COMPILE_WORKERS")
    if text:
        return max(1, int(text))
    return max(1, min(len(os.sched_getaffinity(0)), 4))


def compile_all(fn, names) -> dict:
    names = list(names)
    n = min(workers(), len(names))
    if n <= 1:
        return {name: fn(name) for name in names}
    # spawn, not fork: the parent has CuTeDSL's MLIR context (and its threads) loaded
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
        return dict(zip(names, pool.map(fn, names)))
