"""Compile a test module's kernels in parallel processes (CPU CI has two cores; one kernel's
compile is a single-threaded trace, MLIR lowering and ptxas of 2-6 s).

``compile_all(fn, names)`` returns ``{name: fn(name)}``, computed in spawned worker
processes: ``fn`` must be a module-level function of an importable module, taking a name
and returning something picklable (a PTX string). A worker's exception re-raises here.
``FLEXATTN_TEST_COMPILE_WORKERS=1`` compiles in this process instead (for debugging).

Compiling ahead: a module that declares its jobs at import (``prefetch(fn, names)``, before
the ``compiled`` fixture that calls ``compile_all(fn)``) has them started when
collection ends (conftest.py), in worker processes of lower priority, and its tests run
after the others: the suite's single-threaded tests leave a core idle, and the compiles
fill it instead of running one module after another at the end. ``compile_all`` then
takes the results already computed (or waits for the rest). Only modules with a selected
test that uses ``compiled`` are compiled ahead (``pytest -k`` runs pay nothing).
"""

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

_declared: dict = {}    # module name -> (fn, names): prefetch()
_ahead: dict = {}       # (module, function name, name) -> Future: start_prefetch()
_pool = None


def workers() -> int:
    text = os.environ.get("FLEXATTN_TEST_COMPILE_WORKERS")
    if text:
        return max(1, int(text))
    return max(1, min(len(os.sched_getaffinity(0)), 4))


def _spawn_pool(n: int, initializer=None) -> ProcessPoolExecutor:
    # spawn, not fork: the parent has CuTeDSL's MLIR context (and its threads) loaded
    return ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"), initializer=initializer)


def _key(fn, name):
    return fn.__module__, fn.__name__, name


def compile_all(fn, names=None) -> dict:
    """``{name: fn(name)}``; ``names`` None: those ``prefetch`` declared for ``fn``."""
    names = list(_declared_names(fn) if names is None else names)
    ahead = {name: _ahead.pop(_key(fn, name)) for name in names if _key(fn, name) in _ahead}
    rest = [name for name in names if name not in ahead]
    n = min(workers(), len(rest))
    if n <= 1:
        done = {name: fn(name) for name in rest}
    else:
        with _spawn_pool(n) as pool:
            done = dict(zip(rest, pool.map(fn, rest)))
    done.update((name, future.result()) for name, future in ahead.items())
    return {name: done[name] for name in names}


def prefetch(fn, names) -> None:
    """Declare (at a test module's import) the jobs its ``compiled`` fixture will ask for
    (``compile_all(fn)``)."""
    _declared[fn.__module__] = (fn, list(names))


def _declared_names(fn) -> list:
    declared_fn, names = _declared[fn.__module__]
    if declared_fn is not fn:
        raise ValueError(f"{fn.__module__} declared its jobs for {declared_fn.__name__}, not {fn.__name__}")
    return names


def declared(module_name: str) -> bool:
    return module_name in _declared


def _lower_priority():
    os.nice(10)     # the tests in the main process first; the compiles take what is left


def start_prefetch(module_names) -> None:
    """Start the declared jobs of these modules (in this order) in the background."""
    global _pool
    jobs = [(fn, name) for m in module_names if m in _declared for fn, names in [_declared[m]] for name in names]
    if not jobs or workers() <= 1:
        return
    _pool = _spawn_pool(workers(), _lower_priority)
    for fn, name in jobs:
        _ahead[_key(fn, name)] = _pool.submit(fn, name)


def stop_prefetch() -> None:
    """Drop what was never asked for (a fixture that did not run) and the workers."""
    global _pool
    if _pool is not None:
        _pool.shutdown(wait=True, cancel_futures=True)
        _pool = None
    _ahead.clear()
