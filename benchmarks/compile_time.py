"""Where a fresh kernel compile spends its time, on the CPU (no GPU needed).

Compiles forward (and optionally backward) kernels on fake tensors, as the TVM-FFI
runners do, with CuTeDSL's file cache off, and splits each compile into phases:

  trace    Python: our kernel code and CuTeDSL building the MLIR module
  mlir     the MLIR pass pipeline up to PTX generation (cute-to-nvvm's passes)
  backend  CudaToBinaryPass: NVVM (LLVM → PTX) and ptxas (PTX → cubin), in-process
  host     the host side: ExecutionEngine (LLVM JIT of the launcher), symbol lookup,
           the TVM-FFI function object
  total    wall time of the compile call

``--ptxas`` also times the system ptxas on the kernel's PTX (a stand-in for the in-process
one; ``backend`` minus that is about NVVM). ``--sass DIR`` writes each kernel's SASS,
resource usage and opcode counts to DIR, so two trees can be diffed to prove a change
kept the generated code (``--compare DIR_A DIR_B`` does it).

    python3 benchmarks/compile_time.py [--kernels full softcap doc] [--warm full] [--repeat 3]
    python3 benchmarks/compile_time.py --sass /tmp/sass-before --kernels all
    python3 benchmarks/compile_time.py --compare /tmp/sass-before /tmp/sass-after

``--host-loop`` only times a fixed pure-Python workload: run on two hosts, it says how much
of a first call's difference between them is the host (a compile is mostly single-threaded).

``--usage`` prints ptxas's registers, spills and wgmma serialization (C7510-C7515) of each
kernel instead (exit status 1 if any was serialized).

``--cuda`` brings up torch's CUDA context and runs a kernel before the compiles: on the
device, the same compile in a GPU process beside a CPU-only one on the same host.

``--warm NAME`` compiles NAME first, untimed, so the timed kernels are "the first call of
a new mod" in a process that has already compiled a kernel (as in bench_fwd.py, where
only the first variant pays CuTeDSL's one-time start-up). torch is imported first (as in
the torch adapter: TVM-FFI imports it anyway).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from first_call import VARIANTS as FIRST_CALL_VARIANTS  # noqa: E402  (stdlib-only at import)


def _split_mods(kw):
    """(score maker, mask maker, the other config fields) of a KERNELS entry, leaving
    ``kw`` as it is: a second ``make()`` (``--repeat``) must build the same kernel."""
    rest = {k: v for k, v in kw.items() if k not in ("score", "mask")}
    return kw.get("score"), kw.get("mask"), rest


def _fwd(**kw):
    def make():
        from flexattn.kernels.fwd.sm90 import FwdConfig
        from flexattn.kernels.emit.mod_emit import IRModHook

        score, mask, rest = _split_mods(kw)
        return ("fwd", FwdConfig(mods=IRModHook(score() if score else None, mask() if mask else None), **rest))
    return make


def _bwd(**kw):
    def make():
        from flexattn.kernels.bwd.sm90 import BwdConfig
        from flexattn.kernels.emit.mod_emit import IRModHook

        score, mask, rest = _split_mods(kw)
        grads = rest.pop("grads", None)   # capture slots that want gradients (None: every float buffer)
        hook = IRModHook(score() if score else None, mask() if mask else None)
        return ("bwd", BwdConfig(mods=hook if grads is None else hook.with_grad_filter(grads), **rest))
    return make


def _decode(**kw):
    def make():
        import numpy as np
        from flexattn.kernels.decode.sm90 import DecodeConfig
        from flexattn.kernels.emit.mod_emit import IRModHook
        from flexattn.mods.positions import shift_queries

        offsets = np.zeros(4, np.int32)
        score, mask, rest = _split_mods(kw)
        hook = IRModHook(shift_queries(score(), offsets) if score else None,
                         shift_queries(mask(), offsets) if mask else None)
        return ("decode", DecodeConfig(mods=hook, **rest))
    return make


def _door(variant):
    """The forward kernel ``flexattn.torch.flex_attention`` plans for first_call.py's
    ``variant`` (its own arguments, on the CPU), asked of kernel_path.plan_forward with the
    H100 / H200's answers passed in (132 SMs; 120 CTAs resident in clusters of 2): the
    kernels a first call compiles, not hand-written configs that may drift from the plan."""
    def make():
        import torch

        from first_call import B, D, H, S, variant_kwargs
        from flexattn.core import AttentionSpec
        from flexattn.core import kernel_path
        from flexattn.problem.validate import check_inputs

        q = torch.empty(B, H, S, D, dtype=torch.bfloat16)
        spec = AttentionSpec.from_args(**variant_kwargs(variant, device="cpu"))
        asked = kernel_path.persistent_ctas
        kernel_path.persistent_ctas = lambda x, cluster_size=1: 132 if cluster_size == 1 else 120
        try:
            plan = kernel_path.plan_forward(q, check_inputs(q, q, q, spec), spec)
        finally:
            kernel_path.persistent_ctas = asked
        return ("fwd", plan.config)
    return make


def _softcap():
    from flexattn import mods
    return mods.softcap(30.0)


def _document():
    import numpy as np
    from flexattn import mods
    return mods.document(np.zeros(8, np.int32))


def _alibi():
    from flexattn import mods
    return mods.alibi(num_heads=8)


def _window():
    from flexattn import mods
    return mods.sliding_window(1024)


def _window_4k():
    from flexattn import mods
    return mods.sliding_window(4096)


def _relative_bias():
    import numpy as np
    from flexattn import mods
    return mods.relative_bias(np.zeros((4, 15), np.float32))


def _softcap_division():   # as a torch user writes it: an IEEE division per element
    from flexattn import mods
    return mods.score_mod(lambda s, b, h, q, kv: 30.0 * (s / 30.0).tanh())


def _softcap_runtime_division():   # the cap a captured number: x / $cap per element before the pass
    from flexattn import mods
    cap = 30.0
    return mods.score_mod(lambda s, b, h, q, kv: cap * (s / cap).tanh())


def _gelu():               # torch_functions: F.gelu on erf (an IR node: libdevice's erff)
    import torch.nn.functional as F
    from flexattn import mods
    return mods.score_mod(lambda s, b, h, q, kv: F.gelu(s))


def _atan_cap():           # a softcap written with atan (an IR node: libdevice's atanf)
    import torch
    from flexattn import mods
    return mods.score_mod(lambda s, b, h, q, kv: 20.0 * torch.atan(s / 20.0))


def _dilated():            # bench_fwd's dilated1024: mostly partial tiles, % on q - kv
    from flexattn import mods
    return mods.mask_mod(lambda b, h, q, kv: ((q - kv).abs() <= 512) & ((q - kv) % 2 == 0))


def _neighborhood():       # bench_fwd's neighborhood2d: // and % by the image width
    from flexattn import mods
    return mods.mask_mod(lambda b, h, q, kv: (((q // 64) - (kv // 64)).abs() <= 8)
                         & (((q % 64) - (kv % 64)).abs() <= 8))


def _bits():               # any mask over (q, kv) as its packed rows (bits_mask_tier.py): one IR for all
    import numpy as np

    from flexattn import mods
    words = np.zeros((4096, 4096 // 32), np.int32)
    return mods.mask_mod(lambda b, h, q, kv: ((words[q, kv >> 5] >> (kv & 31)) & 1) == 1)


# The benchmark's configurations (kernel_path.plan_forward: tile 128x128, persistent
# dense with 132 CTAs on the H100), then others covering the code paths.
KERNELS = {
    **{f"door-{v}": _door(v) for v in FIRST_CALL_VARIANTS},
    "full": _fwd(head_dim=128, tile_m=128, max_ctas=132),
    "causal": _fwd(head_dim=128, tile_m=128, causal=True),
    "softcap": _fwd(head_dim=128, tile_m=128, causal=True, score=_softcap),
    "doc": _fwd(head_dim=128, tile_m=128, block_sparse=True, mask=_document),
    # as planned for documents on 256-token boundaries (BlockMask.row_pairs_match)
    "doc-clusters": _fwd(head_dim=128, tile_m=128, block_sparse=True, mask=_document, max_ctas=120, cluster_m=2),
    "doc-clusters-aligned": _fwd(head_dim=128, tile_m=128, block_sparse=True, mask=_document, max_ctas=120,
                                 cluster_m=2, kv_aligned=True),
    "doc-persist": _fwd(head_dim=128, tile_m=128, block_sparse=True, mask=_document, max_ctas=132),
    "alibi": _fwd(head_dim=128, tile_m=128, causal=True, score=_alibi),
    "window": _fwd(head_dim=128, tile_m=128, block_sparse=True, mask=_window),
    "window-band": _fwd(head_dim=128, tile_m=128, band=True, max_ctas=132, mask=_window),
    "window-band-snake": _fwd(head_dim=128, tile_m=128, band=True, max_ctas=132, snake=True, mask=_window),
    "window-band-tickets": _fwd(head_dim=128, tile_m=128, band=True, max_ctas=132, tile_tickets=True, mask=_window),
    # the door's planned window1024 (issue 24's first call): tickets, maxima on demand
    "window-band-tickets-ondemand": _fwd(head_dim=128, tile_m=128, band=True, max_ctas=132, tile_tickets=True,
                                         mask=_window, rescale_threshold=8.0, maxima_on_demand=True),
    "window-band-softcap": _fwd(head_dim=128, tile_m=128, band=True, max_ctas=132, score=_softcap, mask=_window),
    "doc+softcap-d64": _fwd(head_dim=64, block_sparse=True, score=_softcap, mask=_document),
    "causal-d64-192": _fwd(head_dim=64, tile_m=192, causal=True),
    "softcap-nooverlap": _fwd(head_dim=128, tile_m=128, causal=True, score=_softcap,
                              intra_wg_overlap=False, pingpong=False),
    "dense-mask": _fwd(head_dim=128, tile_m=128, mask=_window),
    "softcap-div": _fwd(head_dim=128, tile_m=128, causal=True, score=_softcap_division),
    "softcap-div-runtime": _fwd(head_dim=128, tile_m=128, causal=True, score=_softcap_runtime_division),
    "sparse-nomask": _fwd(head_dim=128, tile_m=128, block_sparse=True),   # the base of the two below
    "dilated": _fwd(head_dim=128, tile_m=128, block_sparse=True, mask=_dilated),
    "neighborhood": _fwd(head_dim=128, tile_m=128, block_sparse=True, mask=_neighborhood),
    "bits": _fwd(head_dim=128, tile_m=128, block_sparse=True, mask=_bits),
    "decode-window": _decode(head_dim=128, tile_n=64, num_stages=2, ctas_per_sm=2, mask=lambda: _window_4k()),
    "decode-window-alibi": _decode(head_dim=128, tile_n=64, num_stages=2, ctas_per_sm=2,
                                   score=_alibi, mask=lambda: _window_4k()),
    "decode-cluster4-alibi": _decode(head_dim=128, tile_n=64, num_stages=2, ctas_per_sm=2, cluster_splits=4,
                                     score=_alibi, mask=lambda: _window_4k()),
    # issue 25's sweep candidates (sweep_fwd_configs.py): 192/128 causal with narrower kv
    # tiles (FA3's 112 for head dim 192), small head dims with wider ones
    "causal-192-128-n112": _fwd(head_dim=192, head_dim_v=128, tile_m=128, tile_n=112, causal=True),
    "causal-192-128-n96": _fwd(head_dim=192, head_dim_v=128, tile_m=128, tile_n=96, causal=True),
    "causal-192-128-n128-c2": _fwd(head_dim=192, head_dim_v=128, tile_m=128, tile_n=128, causal=True, cluster_m=2),
    "causal-d64-m128n192": _fwd(head_dim=64, tile_m=128, tile_n=192, causal=True),
    "causal-d64-m128n256": _fwd(head_dim=64, tile_m=128, tile_n=256, causal=True),
    "causal-d64-m192n160": _fwd(head_dim=64, tile_m=192, tile_n=160, causal=True),
    "causal-d32-planned": _fwd(head_dim=32, tile_m=192, causal=True, max_ctas=132, tile_tickets=True),
    "causal-d64-planned": _fwd(head_dim=64, tile_m=192, causal=True, max_ctas=132, tile_tickets=True),
    # O's rescale only when a warp's max outgrew the reference by 2^8 (FwdConfig.rescale_threshold)
    "causal-d32-lazy": _fwd(head_dim=32, tile_m=192, causal=True, max_ctas=132, tile_tickets=True,
                            rescale_threshold=8.0),
    "causal-d64-lazy": _fwd(head_dim=64, tile_m=192, causal=True, max_ctas=132, tile_tickets=True,
                            rescale_threshold=8.0),
    "causal-lazy": _fwd(head_dim=128, tile_m=128, causal=True, rescale_threshold=8.0),
    # ... and no row maxima on the fast path (FwdConfig.maxima_on_demand)
    "causal-d32-ondemand": _fwd(head_dim=32, tile_m=192, causal=True, max_ctas=132, tile_tickets=True,
                                rescale_threshold=8.0, maxima_on_demand=True),
    "causal-d64-ondemand": _fwd(head_dim=64, tile_m=192, causal=True, max_ctas=132, tile_tickets=True,
                                rescale_threshold=8.0, maxima_on_demand=True),
    "causal-d32-m256n80-ondemand": _fwd(head_dim=32, tile_m=256, tile_n=80, causal=True, max_ctas=132,
                                        tile_tickets=True, rescale_threshold=8.0, maxima_on_demand=True),
    "causal-d64-m256n64-ondemand": _fwd(head_dim=64, tile_m=256, tile_n=64, causal=True, max_ctas=132,
                                        tile_tickets=True, rescale_threshold=8.0, maxima_on_demand=True),
    "causal-ondemand": _fwd(head_dim=128, tile_m=128, causal=True, rescale_threshold=8.0, maxima_on_demand=True),
    "full-d64-ondemand": _fwd(head_dim=64, tile_m=192, max_ctas=132, rescale_threshold=8.0, maxima_on_demand=True),
    # four consumer warpgroups (256-row tiles, 112 registers each: the 640-thread launch's pool): a fourth
    # warp per scheduler to hide the exponentials' latency (planned up to D32 at 80 keys)
    "causal-d32-m256n64": _fwd(head_dim=32, tile_m=256, tile_n=64, causal=True, max_ctas=132, tile_tickets=True),
    "causal-d32-m256n128": _fwd(head_dim=32, tile_m=256, tile_n=128, causal=True, max_ctas=132, tile_tickets=True),
    "causal-d64-m256n64": _fwd(head_dim=64, tile_m=256, tile_n=64, causal=True, max_ctas=132, tile_tickets=True),
    "causal-d32-m256n80": _fwd(head_dim=32, tile_m=256, tile_n=80, causal=True, max_ctas=132, tile_tickets=True),
    "full-d32-m256n80": _fwd(head_dim=32, tile_m=256, tile_n=80, max_ctas=132),
    "causal-d16-m256n80": _fwd(head_dim=16, tile_m=256, tile_n=80, causal=True, max_ctas=132, tile_tickets=True),
    "causal-d32-m256n96": _fwd(head_dim=32, tile_m=256, tile_n=96, causal=True, max_ctas=132, tile_tickets=True),
    "causal-d64-m256n80": _fwd(head_dim=64, tile_m=256, tile_n=80, causal=True, max_ctas=132, tile_tickets=True),
    "causal-d64-m256n96": _fwd(head_dim=64, tile_m=256, tile_n=96, causal=True, max_ctas=132, tile_tickets=True),
    "causal-d32-early": _fwd(head_dim=32, tile_m=192, causal=True, max_ctas=132, tile_tickets=True,
                             rescale_o_early=True),
    "causal-d64-early": _fwd(head_dim=64, tile_m=192, causal=True, max_ctas=132, tile_tickets=True,
                             rescale_o_early=True),
    "causal-d32-m128n256": _fwd(head_dim=32, tile_m=128, tile_n=256, causal=True),
    "causal-d32-m192n192": _fwd(head_dim=32, tile_m=192, tile_n=192, causal=True),
    "causal-d32-m192n256": _fwd(head_dim=32, tile_m=192, tile_n=256, causal=True),
    # 256 value columns: O rescaled while Q K^T runs (FwdConfig.rescale_o_early), ping-pong off
    "causal-256-n80": _fwd(head_dim=256, tile_m=128, tile_n=80, causal=True),
    "causal-256-n80-early": _fwd(head_dim=256, tile_m=128, tile_n=80, causal=True, rescale_o_early=True),
    "causal-256-n80-early-nopp": _fwd(head_dim=256, tile_m=128, tile_n=80, causal=True, rescale_o_early=True,
                                      pingpong=False),
    "doc-256-early": _fwd(head_dim=256, tile_m=128, tile_n=64, block_sparse=True, mask=_document,
                          rescale_o_early=True),
    # 192/192's backward candidates (FA4's layout: keys split, one dO stage, dV first; P^T
    # stored while dP runs, BwdConfig.p_early)
    "bwd-192-swap96-dvfirst": _bwd(head_dim=192, causal=True, tile_n=96, num_stages=2, do_stages=1, ds_buffers=1,
                                   tail_order="dv_first"),
    "bwd-192-swap96-dvfirst-pearly": _bwd(head_dim=192, causal=True, tile_n=96, num_stages=2, do_stages=1,
                                          ds_buffers=1, tail_order="dv_first", p_early=True),
    "bwd-full": _bwd(head_dim=128),
    "gelu": _fwd(head_dim=128, tile_m=128, causal=True, score=_gelu),
    "atan-cap": _fwd(head_dim=128, tile_m=128, causal=True, score=_atan_cap),
    "bwd-causal-gelu": _bwd(head_dim=128, causal=True, score=_gelu),
    "bwd-causal-atan-cap": _bwd(head_dim=128, causal=True, score=_atan_cap),
    "bwd-causal": _bwd(head_dim=128, causal=True),
    "bwd-causal-d64": _bwd(head_dim=64, causal=True, tile_m=128),
    "bwd-causal-idle": _bwd(head_dim=128, causal=True, idle_masked_keys=True),
    "bwd-window-band-idle": _bwd(head_dim=128, band=True, mask=_window, idle_masked_keys=True),
    "bwd-causal-softcap": _bwd(head_dim=128, causal=True, score=_softcap),
    "bwd-doc-d64": _bwd(dtype="fp16", head_dim=64, block_sparse=True, mask=_document),
    "bwd-relbias": _bwd(head_dim=128, score=_relative_bias),
    "bwd-det-relbias": _bwd(head_dim=128, score=_relative_bias, deterministic=True),
    "bwd-causal-alibi": _bwd(head_dim=128, causal=True, score=_alibi),
    # as planned when the slopes do not require grad (the door's causal+alibi)
    "bwd-causal-alibi-fixed": _bwd(head_dim=128, causal=True, score=_alibi, grads=()),
    "bwd-window": _bwd(head_dim=128, block_sparse=True, mask=_window),
    "bwd-window-band": _bwd(head_dim=128, band=True, mask=_window),
    "bwd-window-band-80": _bwd(head_dim=128, band=True, mask=_window, tile_m=80),
    "bwd-window-band-persist": _bwd(head_dim=128, band=True, mask=_window, max_ctas=132),
    "bwd-doc-persist": _bwd(head_dim=128, block_sparse=True, mask=_document, max_ctas=132),
    # dq_first_store (planned unless FLEXATTN_DQ_FIRST_STORE=0; set explicitly here, as these
    # configs bypass the planner): the first visit stores each dQ tile
    "bwd-causal-first": _bwd(head_dim=128, causal=True, dq_first_store=True),
    "bwd-causal-first-data": _bwd(head_dim=128, causal=True, dq_first_store=True, dq_ticket_on_data=True),
    "bwd-doc-persist-first": _bwd(head_dim=128, block_sparse=True, mask=_document, max_ctas=132,
                                  dq_first_store=True),
    "bwd-full-persist": _bwd(head_dim=128, tile_m=80, max_ctas=132),
    # head dims beyond 128: the 64-key split layout and the 96-key swapped one (dkv_swap)
    "bwd-192-128-causal-split": _bwd(head_dim=192, head_dim_v=128, causal=True),
    "bwd-192-128-causal": _bwd(head_dim=192, head_dim_v=128, tile_n=96, causal=True),
    "bwd-192-128-softcap": _bwd(head_dim=192, head_dim_v=128, tile_n=96, causal=True, score=_softcap),
    "bwd-192-192": _bwd(head_dim=192, tile_n=96, num_stages=1),
    "bwd-192-192-q2do1": _bwd(head_dim=192, tile_n=96, num_stages=2, do_stages=1, ds_buffers=1, causal=True),
    "bwd-256-256-swap48-q2do1": _bwd(head_dim=256, tile_n=48, num_stages=2, do_stages=1, ds_buffers=1, causal=True),
    "bwd-256-256-swap48": _bwd(head_dim=256, tile_n=48, num_stages=1, causal=True),
    "bwd-256-128-swap48": _bwd(head_dim=256, head_dim_v=128, tile_n=48, causal=True),
    # issue 25's head-dim-256 candidates (BwdConfig.dkv_rows / tail_order: FA4's choices; CPU-checked)
    "bwd-256-128-split-q2do1": _bwd(head_dim=256, head_dim_v=128, causal=True, num_stages=2, do_stages=1),
    "bwd-256-256-split-dvfirst": _bwd(head_dim=256, causal=True, tail_order="dv_first"),
    "bwd-256-256-swap48-rows": _bwd(head_dim=256, tile_n=48, num_stages=2, do_stages=1, ds_buffers=1, causal=True,
                                    dkv_rows=True, tail_order="dv_first"),
    "bwd-256-128-swap80-rows": _bwd(head_dim=256, head_dim_v=128, tile_n=80, num_stages=2, do_stages=1, ds_buffers=1,
                                    causal=True, dkv_rows=True, tail_order="dv_first"),
    "bwd-det-full": _bwd(head_dim=128, deterministic=True),
    # tile_m 80 (dQ swapped): what the planner picks for dense non-causal head dim 128
    "bwd80-full": _bwd(head_dim=128, tile_m=80),
    "bwd80-softcap": _bwd(head_dim=128, tile_m=80, score=_softcap),
    "bwd80-alibi": _bwd(head_dim=128, tile_m=80, score=_alibi),
    "bwd80-relbias": _bwd(head_dim=128, tile_m=80, score=_relative_bias),
    "bwd80-det-full": _bwd(head_dim=128, tile_m=80, deterministic=True),
    "bwd80-det-relbias": _bwd(head_dim=128, tile_m=80, score=_relative_bias, deterministic=True),
}


class PhaseTimer:
    """Wraps CuTeDSL's compile steps to time them."""

    def __init__(self):
        from cutlass.base_dsl import compiler as C
        from cutlass.base_dsl import dsl as D

        from common import accumulate_time

        self.t = collections.defaultdict(float)
        self.pass_report = ""
        timer = self

        orig_compile = C.Compiler.compile

        def compile_(self_, module, pipeline, *a, **kw):
            # MLIR's pass timing, printed to fd 2 when the pass manager dies: capture it.
            orig_pm = self_.passmanager

            class _PM:
                @staticmethod
                def parse(p):
                    pm = orig_pm.PassManager.parse(p)
                    pm.enable_timing()
                    return pm

            class _Shim:
                PassManager = _PM

            self_.passmanager = _Shim
            saved = os.dup(2)
            with tempfile.TemporaryFile() as tmp:
                os.dup2(tmp.fileno(), 2)
                t0 = time.perf_counter()
                try:
                    return orig_compile(self_, module, pipeline, *a, **kw)
                finally:
                    timer.t["passes"] += time.perf_counter() - t0
                    self_.passmanager = orig_pm
                    os.dup2(saved, 2)
                    os.close(saved)
                    tmp.seek(0)
                    timer.pass_report = tmp.read().decode(errors="replace")
        C.Compiler.compile = compile_
        accumulate_time(C.Compiler, "jit", self.t, "engine")
        accumulate_time(D.BaseDSL, "_lookup_jit_entry", self.t, "lookup")
        accumulate_time(D.BaseDSL, "generate_original_ir", self.t, "trace")
        try:
            from cutlass.cutlass_dsl import tvm_ffi_provider as P
            accumulate_time(P.TVMFFIJitCompiledFunctionBase, "_create_tvm_ffi_function", self.t, "ffi")
        except (ImportError, AttributeError):
            pass

    def backend_seconds(self) -> float:
        m = re.search(r"([\d.]+) \(\s*[\d.]+%\)\s+CudaToBinaryPass", self.pass_report)
        return float(m.group(1)) if m else float("nan")

    def phases(self, total: float) -> dict:
        """The last compile's split (seconds; the module doc's phases) of ``total`` wall time."""
        t = dict(self.t)
        backend = self.backend_seconds()
        row = {"total": total, "trace": t.get("trace", 0), "mlir": t.get("passes", 0) - backend,
               "backend": backend, "host": t.get("engine", 0) + t.get("lookup", 0) + t.get("ffi", 0)}
        row["other"] = total - row["trace"] - t.get("passes", 0) - row["host"]
        return row


def compile_one(name: str, tvm_ffi: bool = True, keep: bool = False):
    from flexattn.kernels.emit.mod_emit import fake_args

    kind, cfg = KERNELS[name]()
    if kind == "fwd":
        from flexattn.kernels.launch.compile import compile_forward
        return compile_forward(cfg, fake_args(cfg.mods), tvm_ffi=tvm_ffi, keep_ptx=keep, keep_cubin=keep)
    if kind == "decode":
        import cutlass.cute as cute
        from flexattn.kernels.launch.compile import ARCH_OPTION, _dump_dir
        from flexattn.kernels.launch.fakes import fake_decode_args
        from flexattn.kernels.decode.sm90 import DecodeSm90

        opts = ARCH_OPTION + (" --enable-tvm-ffi" if tvm_ffi else "") + (" --keep-ptx --keep-cubin" if keep else "")
        with tempfile.TemporaryDirectory() as d, _dump_dir(d):
            return cute.compile(DecodeSm90(cfg), *fake_decode_args(cfg, fake_args(cfg.mods), tvm_ffi),
                                options=opts)
    from flexattn.kernels.launch.compile import compile_backward
    return compile_backward(cfg, fake_args(cfg.mods), tvm_ffi=tvm_ffi, keep_ptx=keep,
                            extra_options="--keep-cubin" if keep else "")


def time_ptxas(ptx: str) -> float:
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return float("nan")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        t0 = time.perf_counter()
        subprocess.run([ptxas, "-arch=sm_90a", src, "-o", os.path.join(d, "k.cubin")], check=True)
        return time.perf_counter() - t0


def run_timings(args):
    if args.processes:
        return run_in_processes(args)
    torch = __import__("torch")  # as in the adapter's process (TVM-FFI imports it anyway)
    if args.cuda:   # (a GPU process: torch's CUDA context up and a kernel run before the compiles)
        (torch.ones(1024, device="cuda") * 2).sum().item()

    timer = PhaseTimer()
    if args.warm:
        compile_one(args.warm)
    rows = collections.defaultdict(list)
    for rep in range(args.repeat):
        for name in args.kernels:
            timer.t.clear()
            t0 = time.perf_counter()
            c = compile_one(name, keep=args.ptxas)
            row = timer.phases(time.perf_counter() - t0)
            if args.ptxas:
                row["ptxas*"] = time_ptxas(c.__ptx__)
            rows[name].append(row)
            if args.json:
                import json
                print("ROW " + json.dumps({"name": name, **row}), flush=True)
            print(f"{name:20s} rep {rep}  " + "  ".join(f"{k} {v:5.2f}" for k, v in row.items()), flush=True)
    print_medians(rows)
    if args.passes:
        print(timer.pass_report)


def run_in_processes(args):
    """Each kernel compiled once in each of ``args.processes`` fresh processes (after the
    warm-up kernel): what the first call of a new mod pays, CuTeDSL's per-process caches
    cold for it."""
    import json

    rows = collections.defaultdict(list)
    for rep in range(args.processes):
        for name in args.kernels:
            cmd = [sys.executable, os.path.abspath(__file__), "--kernels", name, "--warm", args.warm,
                   "--json"] + (["--ptxas"] if args.ptxas else []) + (["--cuda"] if args.cuda else [])
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            row = next(json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW "))
            row.pop("name")
            rows[name].append(row)
            print(f"{name:20s} process {rep}  " + "  ".join(f"{k} {v:5.2f}" for k, v in row.items()), flush=True)
    print_medians(rows)


def print_medians(rows):
    print("\nmedian over repetitions (s):")
    keys = list(next(iter(rows.values()))[0])
    print(f"{'kernel':20s} " + " ".join(f"{k:>8s}" for k in keys))
    for name, rs in rows.items():
        print(f"{name:20s} " + " ".join(f"{statistics.median(r[k] for r in rs):8.2f}" for k in keys))


def _cuda_tool(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    try:
        import nvidia.cu13  # pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
        path = os.path.join(list(nvidia.cu13.__path__)[0], "bin", name)
        if os.path.exists(path):
            return path
    except ImportError:
        pass
    raise SystemExit(f"{name} not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")


def write_sass(args):
    __import__("torch")

    os.makedirs(args.sass, exist_ok=True)
    cuobjdump = _cuda_tool("cuobjdump")
    for name in args.kernels:
        c = compile_one(name, keep=True)
        path = os.path.join(args.sass, name)
        with open(path + ".cubin", "wb") as f:
            f.write(c.__cubin__)
        sass = subprocess.run([cuobjdump, "-sass", path + ".cubin"], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([cuobjdump, "-res-usage", path + ".cubin"], capture_output=True, text=True,
                             check=True).stdout
        with open(path + ".sass", "w") as f:
            f.write(sass)
        with open(path + ".ptx", "w") as f:
            f.write(c.__ptx__)
        ops = opcode_counts(sass)
        with open(path + ".summary", "w") as f:
            f.write(res.strip() + "\n")
            f.write(f"instructions {sum(ops.values())}\n")
            for op, n in sorted(ops.items()):
                f.write(f"{op} {n}\n")
        print(f"{name:20s} {sum(ops.values())} instructions, "
              + " ".join(f"{k}={ops.get(k, 0)}" for k in ("HGMMA", "MUFU", "FFMA", "FMNMX")), flush=True)


def print_usage(args) -> int:
    """ptxas -v on each kernel's PTX: registers, spill bytes, and whether ptxas serialized its
    wgmmas (C7510-C7515: every wgmma waits for the one before). Returns how many were serialized."""
    __import__("torch")
    from flexattn.kernels.launch.compile import resource_usage_from_ptx

    serialized = 0
    for name in args.kernels:
        try:
            usage = resource_usage_from_ptx(compile_one(name, keep=True).__ptx__)
        except Exception as e:   # (a hand-written entry the kernel no longer takes must not hide the rest)
            print(f"{name:32s} compile failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:120]}", flush=True)
            continue
        if usage is None:
            raise SystemExit("no ptxas on PATH")
        serialized += usage.wgmma_serialized is not None
        print(f"{name:32s} registers {usage.registers:3d}  spills {usage.spill_store_bytes:4d} B  "
              f"{usage.wgmma_serialized or 'wgmma pipelined'}", flush=True)
    return serialized


_INSN = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def opcode_counts(sass: str) -> collections.Counter:
    return collections.Counter(m.group(1) for m in _INSN.finditer(sass))


def _read(path):
    return open(path).read() if os.path.exists(path) else None


_KERNEL_SYMBOL = re.compile(r"\bkernel_cutlass_\w+")


def _symbols(text):
    """``text`` with kernel symbols replaced by one placeholder: CuTeDSL names a kernel after
    its Python module path and argument types, so moving a module renames it without
    changing a single instruction."""
    return None if text is None else _KERNEL_SYMBOL.sub("KERNEL", text)


def compare(a: str, b: str) -> int:
    """SASS, resource summary and PTX of each kernel in ``a`` against ``b`` (kernel symbol
    names aside); the count of kernels whose SASS or PTX differ."""
    bad = 0
    for fn in sorted(os.listdir(a)):
        if not fn.endswith(".sass"):
            continue
        other = os.path.join(b, fn)
        if not os.path.exists(other):
            continue
        x, y = (open(os.path.join(d, fn)).read() for d in (a, b))
        x, y = (re.sub(r"^\s*Fatbin.*$|^\s*code for sm_.*$|^\s*Function : .*$", "", s, flags=re.M) for s in (x, y))
        same = x == y
        sx, sy = (_symbols(open(os.path.join(d, fn[:-5] + ".summary")).read()) for d in (a, b))
        px, py = (_symbols(_read(os.path.join(d, fn[:-5] + ".ptx"))) for d in (a, b))
        ptx = "n/a" if px is None or py is None else ("identical" if px == py else "differs")
        print(f"{fn[:-5]:20s} SASS {'identical' if same else 'DIFFERS'}; summary {'same' if sx == sy else 'DIFFERS'}; "
              f"PTX {ptx}")
        bad += (not same) or ptx == "differs"
    return bad


def host_loop_seconds(rounds: int = 5) -> float:
    """Best of ``rounds`` timings of a fixed pure-Python workload (dict and list churn, as a
    trace's bookkeeping is): this host's single-thread Python speed, to set a first call's
    seconds on one machine beside another's (compiles are mostly single-threaded Python
    and LLVM)."""
    def work():
        table = {}
        for i in range(400_000):
            table[(i & 1023, i >> 10)] = [i, str(i)]
        return sum(len(v[1]) for v in table.values())
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", nargs="+", default=["full", "softcap", "doc"],
                    help=f"of {list(KERNELS)} or 'all'")
    ap.add_argument("--warm", default="causal", help="compiled first, untimed ('' for none)")
    ap.add_argument("--repeat", type=int, default=1, help="compiles of each kernel in this process")
    ap.add_argument("--processes", type=int, default=0,
                    help="instead: compile each kernel once in this many fresh processes (the first-call figure)")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cuda", action="store_true",
                    help="bring up torch's CUDA context and run a kernel before compiling (a GPU process's compile, "
                         "beside the CPU-only one on the same host)")
    ap.add_argument("--ptxas", action="store_true", help="also time the system ptxas on the PTX")
    ap.add_argument("--passes", action="store_true", help="print the last MLIR pass timing report")
    ap.add_argument("--sass", help="write SASS + summaries to this directory instead of timing")
    ap.add_argument("--compare", nargs=2, metavar=("DIR_A", "DIR_B"))
    ap.add_argument("--usage", action="store_true",
                    help="instead: ptxas's registers, spills and wgmma serialization of each kernel")
    ap.add_argument("--host-loop", action="store_true",
                    help="instead: time a fixed pure-Python workload (this host's speed, host_loop_seconds)")
    args = ap.parse_args()
    if args.host_loop:
        print(f"host loop: {host_loop_seconds():.3f} s (best of 5; {os.uname().nodename})")
        return
    if args.kernels == ["all"]:
        args.kernels = list(KERNELS)
    if args.compare:
        sys.exit(1 if compare(*args.compare) else 0)
    if args.sass:
        write_sass(args)
    elif args.usage:
        sys.exit(1 if print_usage(args) else 0)
    else:
        run_timings(args)


if __name__ == "__main__":
    main()
