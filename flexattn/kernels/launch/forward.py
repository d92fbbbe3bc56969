"""Launching the forward: validate, compile once per structure, run. Two runners, one per
launch path:

- ``FfiForwardRunner`` (the default wherever ``apache-tvm-ffi`` is installed): compiled on
  fake tensors with ``--enable-tvm-ffi``, it takes framework tensors directly — DLPack
  exchanged in C, each argument checked against the compiled signature (dtype, rank,
  device, divisibility) — and launches on the framework's current stream (TVM-FFI's
  environment stream): microseconds of host time.
- ``ForwardRunner``: wraps every argument with ``from_dlpack`` (~35 µs per tensor on the
  host, which starves the GPU when a call's kernel is short) and compiles on those very
  views, launching on an explicit CUstream; framework-free.

The compiled kernel performs no argument checks (a float32 tensor passed for a bf16 slot
is silently misread), so everything it assumes is checked before a launch: here
(``ForwardRunner``) or in ``core/kernel_path.py`` (the TVM-FFI path).
"""

import time

import cuda.bindings.driver as cuda
import cutlass

from flexattn.kernels.emit.mod_emit import IRModHook, fake_args
from flexattn.kernels.fwd.sm90 import FlashFwdSm90, FwdConfig
from flexattn.kernels.launch import disk_cache
from flexattn.kernels.launch.arguments import arg_signature, check_block_lists, to_cute
from flexattn.kernels.launch.compile import compile_forward, compile_on_views
from flexattn.kernels.launch.compile_lock import COMPILING, once


def _check_row_stats(name: str, t, q_shape) -> None:
    """A per-row fp32 statistic the kernel writes (lse, max_scores): [B, Hq, Sq] of q's
    shape, the sequence dim contiguous."""
    if str(t.element_type) != "Float32" or tuple(t.shape) != tuple(q_shape[:3]):
        raise ValueError(f"{name}: want float32 [B, Hq, Sq]")
    if t.stride[2] != 1:
        raise ValueError(f"{name}: the sequence dim must be contiguous")


def _check_max_scores_given(cfg: FwdConfig, max_scores) -> None:
    if cfg.max_scores != (max_scores is not None):
        raise ValueError("pass max_scores iff the config has max_scores=True")


class ForwardRunner:
    """`run(q, k, v, o, lse, softmax_scale, mod_args, stream)`; q [B,Hq,Sq,D], o [B,Hq,Sq,Dv],
    k [B,Hkv,Skv,D], v [B,Hkv,Skv,Dv] of cfg.dtype (D, Dv: cfg.head_dim, cfg.head_dim_v),
    lse float32 [B,Hq,Sq]. mod_args: tuple of cute
    values (use `hook_tensor` / cutlass.Float32 / cutlass.Int32). The first call for a
    given (config, hook-arg structure) compiles; `last_compile_seconds` records it."""

    def __init__(self, cfg: FwdConfig):
        self.cfg = cfg
        self._compiled = {}
        self.last_compile_seconds = 0.0

    @staticmethod
    def hook_tensor(x):
        """A captured buffer for a hook: any DLPack array, dynamic shape."""
        from flexattn.kernels.emit.mod_emit import buffer_arg

        return buffer_arg(x)

    def _check(self, q, k, v, o, lse):
        cfg = self.cfg
        want = str(cfg.cutlass_dtype)
        for name, t, d in (("q", q, cfg.head_dim), ("k", k, cfg.head_dim), ("v", v, cfg.head_dim_v),
                           ("o", o, cfg.head_dim_v)):
            if str(t.element_type) != want:
                raise TypeError(f"{name}: dtype {t.element_type}, kernel compiled for {want}")
            if len(t.shape) != 4 or t.shape[3] != d:
                raise ValueError(f"{name}: want [B, H, S, {d}], got {tuple(t.shape)}")
            if t.stride[3] != 1 and t.shape[3] != 1:
                raise ValueError(f"{name}: the head dim must be contiguous")
            if any(s % 8 for s in t.stride[:3]):
                raise ValueError(f"{name}: strides must be multiples of 8 elements (TMA)")
        _check_row_stats("lse", lse, q.shape)
        (b, hq, sq, _), (bk, hk, sk, _) = q.shape, k.shape
        if tuple(k.shape[:3]) != tuple(v.shape[:3]) or tuple(o.shape[:3]) != tuple(q.shape[:3]) or bk != b:
            raise ValueError(f"shape mismatch q{tuple(q.shape)} k{tuple(k.shape)} "
                             f"v{tuple(v.shape)} o{tuple(o.shape)}")
        if hk == 0 or hq % hk:
            raise ValueError(f"Hq={hq} must be a multiple of Hkv={hk}")
        if sk < 1 or sq < 1:
            raise ValueError("empty sequences are not supported")
        if not cfg.cluster_fits(sq):
            raise ValueError(f"cluster_m={cfg.cluster_m} needs a multiple of {cfg.cluster_m} q tiles of "
                             f"{cfg.tile_m} rows per head, got Sq={sq}")
        _check_kv_aligned(cfg, sk)

    def _check_block_sparse(self, q, k, block_sparse):
        (B, Hq, Sq, _) = q.shape
        cfg = self.cfg
        tickets = ()
        if cfg.tile_tickets:   # the counter, after the lists
            if not block_sparse:
                raise ValueError("tile_tickets: pass the tickets' int32 counter (zeros) as block_sparse's last array")
            *lists, counter = block_sparse
            block_sparse = tuple(lists) or None
            static, tickets = to_cute(counter, 4)
            if str(static.element_type) != "Int32" or len(static.shape) != 1 or static.shape[0] < 1:
                raise ValueError("tile_tickets: the counter must be an int32 array of at least one zero")
            tickets = (tickets,)
        lists = check_block_lists(block_sparse, cfg.block_sparse, B, Hq, -(-Sq // cfg.sparse_block_m),
                                  "kv", f"q-blocks of {cfg.sparse_block_m}")
        return ((lists or ()) + tickets) or None

    def bind(self, q, k, v, o, lse, softmax_scale: float, mod_args: tuple, stream: int,
             block_sparse=None, max_scores=None):
        """Validate and compile once; return a no-argument launcher for these buffers
        (keeps DLPack conversion and checks out of timed loops). `block_sparse`:
        (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) as DLPack int32
        arrays, block size tile_m x tile_n, iff cfg.block_sparse; `max_scores`: float32
        [B, Hq, Sq] like lse, iff cfg.max_scores."""
        views = [to_cute(x, 16) for x in (q, k, v, o)] + [to_cute(lse, 4)]
        self._check(*(s for s, _ in views))
        bs = self._check_block_sparse(views[0][0], views[1][0], block_sparse)
        dyn = [d for _, d in views]
        dyn_max = self._check_max_scores(views[4][0], max_scores)
        args = tuple(mod_args) if mod_args else None
        scale = cutlass.Float32(softmax_scale)
        cu_stream = cuda.CUstream(stream)
        key = tuple(arg_signature(a) for a in mod_args or ())
        def make():
            fn, self.last_compile_seconds = compile_on_views(FlashFwdSm90(self.cfg),
                                                             (*dyn, scale, args, bs, dyn_max, cu_stream))
            return fn

        fn = once(self._compiled, key, make)
        return lambda: fn(*dyn, scale, args, bs, dyn_max, cu_stream)

    def _check_max_scores(self, lse, max_scores):
        """The cute view of ``max_scores`` (checked like lse), or None."""
        _check_max_scores_given(self.cfg, max_scores)
        if max_scores is None:
            return None
        static, view = to_cute(max_scores, 4)
        _check_row_stats("max_scores", static, lse.shape)
        return view

    @property
    def num_compiled(self) -> int:
        """Kernels compiled by this runner (one per hook-arg structure)."""
        return len(self._compiled)

    def run(self, q, k, v, o, lse, softmax_scale: float, mod_args: tuple, stream: int,
            block_sparse=None, max_scores=None):
        self.bind(q, k, v, o, lse, softmax_scale, mod_args, stream, block_sparse, max_scores)()


def _check_kv_aligned(cfg: FwdConfig, kv_len: int) -> None:
    """A kernel compiled for KV_LEN a multiple of tile_n does not mask the keys past a
    KV_LEN inside its last block (they would be attended as zero-filled keys)."""
    if cfg.kv_aligned and kv_len % cfg.tile_n:
        raise ValueError(f"kv_aligned: the kernel needs KV_LEN a multiple of tile_n {cfg.tile_n}, got {kv_len}")


class FfiForwardRunner:
    """``run(q, k, v, o, lse, softmax_scale, mod_args, block_sparse)`` with framework tensors:
    ``mod_args`` holds the hook's captures in args order (contiguous device tensors for
    buffers, 0-d ones reshaped to [1]; Python numbers for scalars)."""

    def __init__(self, cfg: FwdConfig):
        if not isinstance(cfg.mods, IRModHook):
            raise TypeError("the TVM-FFI path compiles from the hook's capture kinds: it needs an IRModHook")
        self.cfg = cfg
        self._fn = None
        self.last_compile_seconds = 0.0

    @property
    def num_compiled(self) -> int:
        return int(self._fn is not None)

    def compile(self) -> None:
        if self._fn is not None:  # capture kinds are part of cfg.key(): one compile per runner
            return
        with COMPILING:           # threads that miss at once compile once
            if self._fn is not None:
                return
            t0 = time.perf_counter()
            self._fn = disk_cache.compiled(disk_cache.config_key("fwd", self.cfg),
                                           lambda: compile_forward(self.cfg, fake_args(self.cfg.mods), tvm_ffi=True))
            self.last_compile_seconds = time.perf_counter() - t0

    @property
    def compiled(self):
        """The compiled function: ``(q, k, v, o, lse, scale, mod_args | None, block_sparse | None,
        max_scores | None)``."""
        return self._fn

    def run(self, q, k, v, o, lse, softmax_scale: float, mod_args: tuple, block_sparse=None, max_scores=None):
        self.compile()
        _check_max_scores_given(self.cfg, max_scores)
        _check_kv_aligned(self.cfg, k.shape[2])
        self._fn(q, k, v, o, lse, float(softmax_scale), tuple(mod_args) if mod_args else None, block_sparse,
                 max_scores)
