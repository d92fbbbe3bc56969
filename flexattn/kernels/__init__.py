"""CuTeDSL kernels (Hopper, sm_90a).

CuTeDSL takes its target from CUTE_DSL_ARCH (default sm_100, or the GPU it finds); these
kernels are sm_90a-only and must also compile on GPU-less machines, so the default is set
here, before any kernel module imports cutlass. An explicit setting wins.
"""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
