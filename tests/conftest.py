"""Shared test helpers (naive_attention, mod_cases, mod_zoo) importable from subfolders.

CuTeDSL reads its target architecture once, when cutlass is first imported; whichever
test imports it first must find sm_90a set (as ``flexattn.kernels`` sets it), or kernels
compiled for sm_90a are treated as foreign (e.g. TVM-FFI functions stay uninitialized).
"""

import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
