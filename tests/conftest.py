"""Shared test helpers (naive_attention, mod_cases, mod_zoo) importable from subfolders.

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
