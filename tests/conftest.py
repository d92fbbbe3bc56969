"""Shared test helpers (naive_attention, mod_cases, mod_zoo) importable from subfolders; the
kernel modules' compiles started ahead (compile_pool.py: the hooks at the end).

CuTeDSL reads its target architecture once, when cutlass is first imported; whichever
test imports it first must find sm_90a set (as ``flexattn.kernels`` sets it), or kernels
compiled for sm_90a are treated as foreign (e.g. TVM-FFI functions stay uninitialized).

Compiled TVM-FFI kernels are cached on disk (flexattn/kernels/launch/disk_cache.py): the tests
keep theirs in a temporary directory of the session, never in the user's cache, unless
FLEXATTN_CACHE_DIR is set (e.g. to run the GPU tests twice, the second time from disk).
"""

import atexit
import os
import shutil
import sys
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
if not os.environ.get("FLEXATTN_CACHE_DIR"):
    _cache_dir = tempfile.mkdtemp(prefix="flexattn-test-kernels-")
    os.environ["FLEXATTN_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import compile_pool  # noqa: E402  (after the path: tests/ holds it)


def _module_name(item):
    module = getattr(item, "module", None)
    return module.__name__ if module is not None else ""


def pytest_collection_modifyitems(session, config, items):
    # Modules whose kernels compile ahead (compile_pool.prefetch) run after the rest, so
    # their compiles overlap the single-threaded tests instead of following them.
    items.sort(key=lambda item: compile_pool.declared(_module_name(item)))


def pytest_collection_finish(session):
    order = []
    for item in session.items:
        name = _module_name(item)
        if "compiled" in getattr(item, "fixturenames", ()) and name not in order:
            order.append(name)
    compile_pool.start_prefetch(order)


def pytest_sessionfinish(session, exitstatus):
    compile_pool.stop_prefetch()
