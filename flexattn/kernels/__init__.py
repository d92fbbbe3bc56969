"""CuTeDSL kernels (Hopper, sm_90a).

CuTeDSL takes its target from CUTE_DSL_ARCH (default sm_100, or the GPU it finds); these
kernels are sm_90a-only and must also compile on GPU-less machines, so the default is set
here, before any kernel module imports cutlass. An explicit setting wins.
"""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
# CuTeDSL's on-disk cache of lowered modules: keep it with our other caches, not in /tmp.
# (Only direct @cute.jit calls use it; cute.compile, which compiles every kernel here,
# bypasses it: see cache.py.)
if "CUTE_DSL_CACHE_DIR" not in os.environ:
    _cache_dir = os.path.join(os.path.expanduser("~"), ".cache", "flexattn", "cute-dsl")
    try:
        os.makedirs(_cache_dir, exist_ok=True)
        os.environ["CUTE_DSL_CACHE_DIR"] = _cache_dir
    except OSError:  # read-only home: CuTeDSL falls back to its temp-dir cache
        pass
