"""The backward launched through TVM-FFI: framework tensors in, microseconds of host time.

`bwd_runner.BackwardRunner` wraps each of its 12–20 arguments with ``from_dlpack`` (tens
of µs each): ~0.4 ms of host time per backward, which left the GPU idle between a short
forward and the backward (window / document masks at B4 S4096: 450–600 µs idle per
training step; benchmarks/RESULTS.md). Compiled with ``--enable-tvm-ffi``
(`bwd_compile.compile_*(tvm_ffi=True)`), the three kernels take framework tensors
directly — DLPack exchanged in C, dtype / rank / device / divisibility checked against
the compiled signature — and launch on TVM-FFI's environment stream (torch's current
stream; others set it around the launch: `core.kernel_path.ffi_stream_scope`).

What the compiled signature cannot check (shapes that must agree, the workspace layout,
GQA divisibility, block-list shapes) is checked here, on the tensors' ``shape`` tuples.
"""

from __future__ import annotations

import time

from flexattn.kernels.launch import disk_cache
from flexattn.kernels.launch.compile_bwd import compile_backward, compile_postprocess, compile_preprocess
from flexattn.kernels.launch.bwd_runner import check_q_and_kv_shapes, workspace_dtypes, workspace_shapes
from flexattn.kernels.bwd.sm90 import BwdConfig
from flexattn.kernels.emit.mod_emit import IRModHook, fake_args
from flexattn.kernels.launch.fwd_runner import check_block_list_shape


class FfiBackwardRunner:
    """``run(q, k, v, o, do, lse, dq, dk, dv, workspace, softmax_scale, mod_args, grad_args,
    block_sparse=None, dlse=None)`` with framework tensors: the arguments of
    `bwd_runner.BackwardRunner.run` without the stream, ``mod_args`` as TVM-FFI call
    arguments (`ffi_runner.ffi_mod_args`)."""

    def __init__(self, cfg: BwdConfig):
        if cfg.mods.has_score or cfg.mods.has_mask:
            if not isinstance(cfg.mods, IRModHook):
                raise TypeError("the TVM-FFI backward compiles from the hook's capture kinds: it needs an IRModHook")
        self.cfg = cfg
        self._compiled = {}    # with_dlse -> (preprocess, main, postprocess)
        self.last_compile_seconds = 0.0

    @property
    def num_compiled(self) -> int:
        """Kernels compiled: three for the first dLSE variant, one preprocess per other."""
        return len({id(f) for fns in self._compiled.values() for f in fns})

    def kernels(self, with_dlse: bool):
        """(preprocess, main, postprocess) compiled functions (once per runner and dLSE)."""
        fns = self._compiled.get(with_dlse)
        if fns is None:
            t0 = time.perf_counter()
            fns = self._compiled[with_dlse] = self._compile(with_dlse)
            self.last_compile_seconds += time.perf_counter() - t0
        return fns

    def _compile(self, with_dlse: bool):
        cfg = self.cfg
        mod_fakes = fake_args(cfg.mods) if isinstance(cfg.mods, IRModHook) else ()
        grad_ranks = tuple(len(mod_fakes[s].shape) for s in cfg.mods.grad_slots)
        fixed = cfg.deterministic and cfg.buffer_grads
        # The main kernel and the postprocess do not depend on dLSE: one compile serves both.
        other = self._compiled.get(not with_dlse)
        # Disk keys: the arguments each compile function reads (the main kernel: the config).
        pre = disk_cache.compiled(
            ("bwd_pre", cfg.dtype, cfg.head_dim, with_dlse, cfg.deterministic, fixed, cfg.tile_m),
            lambda: compile_preprocess(cfg.dtype, cfg.head_dim, with_dlse, deterministic=cfg.deterministic,
                                       grad_fixed=fixed, tile_m=cfg.tile_m, tvm_ffi=True))
        if other is not None:
            return pre, other[1], other[2]
        main = disk_cache.compiled(disk_cache.config_key("bwd_main", cfg),
                                   lambda: compile_backward(cfg, mod_fakes, tvm_ffi=True))
        post_ranks = grad_ranks if fixed else ()
        post = disk_cache.compiled(
            ("bwd_post", cfg.dtype, cfg.head_dim, post_ranks, cfg.tile_m),
            lambda: compile_postprocess(cfg.dtype, cfg.head_dim, grad_ranks=post_ranks, tile_m=cfg.tile_m,
                                        tvm_ffi=True))
        return pre, main, post

    def check(self, q, k, lse, dlse, workspace, grad_args, block_sparse) -> None:
        """The shape relations the compiled signatures leave open."""
        cfg = self.cfg
        (b, hq, sq, _), (_, _, sk, _) = tuple(q.shape), tuple(k.shape)
        check_q_and_kv_shapes(tuple(q.shape), tuple(k.shape))
        for name, t in (("lse", lse), ("dlse", dlse)):
            if t is not None and tuple(t.shape) != (b, hq, sq):
                raise ValueError(f"{name}: want float32 [B, Hq, Sq] = {(b, hq, sq)}, got {tuple(t.shape)}")
        grad_shapes = tuple(tuple(g.shape) for g in grad_args or ())
        if len(grad_shapes) != len(cfg.mods.grad_slots):
            raise ValueError(f"grad_args: want {len(cfg.mods.grad_slots)} fp32 arrays (captures {cfg.mods.grad_slots})")
        shapes = workspace_shapes(cfg, b, hq, sq, grad_shapes)
        if len(workspace) != len(shapes):
            raise ValueError(f"workspace = ({', '.join(shapes)})")
        for (name, shape), t in zip(shapes.items(), workspace):
            if tuple(t.shape) != shape:
                raise ValueError(f"workspace {name}: want {workspace_dtypes(cfg)[name]} {shape}, got {tuple(t.shape)}")
        if cfg.block_sparse != (block_sparse is not None):
            raise ValueError("pass block_sparse tensors iff the config has block_sparse=True")
        if block_sparse is None:
            return
        want = 8 if cfg.deterministic else 4
        if len(block_sparse) != want:
            raise ValueError(f"block_sparse: want {want} arrays (q-side lists"
                             + (", then the kv-side lists)" if want == 8 else ")"))
        for i, t in enumerate(block_sparse):   # q-side lists, then (deterministic) kv-side
            if i < 4:
                check_block_list_shape(i, tuple(t.shape), b, hq, -(-sk // cfg.tile_n), f"kv blocks of {cfg.tile_n}")
            else:
                check_block_list_shape(i, tuple(t.shape), b, hq, -(-sq // cfg.sparse_block_m),
                                       f"q blocks of {cfg.sparse_block_m}")

    def run(self, q, k, v, o, do, lse, dq, dk, dv, workspace, softmax_scale: float, mod_args: tuple,
            grad_args, block_sparse=None, dlse=None) -> None:
        self.check(q, k, lse, dlse, workspace, grad_args, block_sparse)
        self.last_compile_seconds = 0.0
        pre, main, post = self.kernels(dlse is not None)
        ws = dict(zip(workspace_dtypes(self.cfg), workspace))
        lse2, delta, dqacc = ws["lse_log2"], ws["delta"], ws["dq_accum"]
        dqsem, fixed = ws.get("dq_semaphore"), ws.get("grad_fixed")
        grads = tuple(grad_args) if grad_args else None
        scale = float(softmax_scale)
        pre(o, do, lse, dlse, lse2, delta, dqacc, dqsem, fixed)
        main(q, k, v, do, lse2, delta, dqacc, dqsem, dk, dv, scale, tuple(mod_args) if mod_args else None,
             grads, fixed, tuple(block_sparse) if block_sparse else None)
        post(dqacc, dq, scale, grads if fixed is not None else None, fixed)
