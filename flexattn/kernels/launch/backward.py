"""Launch the sm90 backward on DLPack arrays: validate, compile once per structure, run.

Three kernels on the caller's stream, in order:

    BwdPreprocess   delta = rowsum(dO * O) (- dLSE), lse_log2, dq_accum = 0
                    (deterministic: dq_semaphore = 0, grad_fixed = 0; dq_finish:
                    dq_semaphore = 0, dQ's empty rows = 0)
    FlashBwdSm90    dK, dV (input dtype), dq_accum += dS K (bulk fp32 adds), buffer grads
                    (dq_finish: and dQ, each q tile once its last visitor's adds landed)
    BwdPostprocess  dQ = scale * dq_accum -> input dtype (deterministic: grads += grad_fixed;
                    not launched under dq_finish)

Destination-passing and framework-free, like `ForwardRunner`: the caller allocates dq, dk,
dv, the workspace (`workspace_shapes`, `workspace_dtypes`) and the zeroed fp32 buffer
gradients. The compiled kernels check nothing, so everything they assume is checked here,
and each is compiled on the very (dynamic-layout) tensors it is launched with.

Determinism. By default dK, dV and the preprocess/postprocess are deterministic (dK/dV of
a kv head are summed in registers, in a fixed order, by one CTA); dQ and buffer gradients
are fp32 additions (bulk adds, atomics) whose order varies between runs (differences ~1
ulp of fp32 before the final rounding). `BwdConfig(deterministic=True)` makes every output bitwise repeatable
(same inputs, same GPU model, same launch shapes):

* dQ: the CTAs visiting a q tile add their dQ tiles one after another, in decreasing kv
  block order. Workspace `dq_semaphore`: one int32 per (batch, q head, tile_m-row q tile),
  zeroed by the preprocess, counting the CTAs that have added into the tile. The CTA of kv
  block n waits until it equals `rank` = the number of kv blocks > n that visit the tile
  (its dQ writer warp's lane 0 spins with ld.acquire.gpu), adds its tile (the same bulk
  adds, now serialized), waits for their writes, then one red.release.gpu.add of 1.
  `rank` (bwd.q_blocks.KvVisitors): dense, every kv block visits every tile: nKV - 1 - n;
  causal (top-left, kv <= q), kv blocks 0 .. last(m) visit tile m, last(m) =
  min(nKV - 1, (64 (m + 1) - 1) // 128): last(m) - n; block-sparse, counted by one warp in
  the BlockMask's kv-side lists (partial + full) of q block m // 2 — so deterministic
  block-sparse calls pass those lists too (8 arrays), and they must be the exact
  transposes of the q-side ones (as `BlockMask` builds both).
  GQA: one CTA visits all q heads of its group, in order; each (head, tile) has its flag.
* Progress: a CTA waits only for CTAs of the same (batch, kv head) with a higher kv
  block. In deterministic mode those CTAs have *lower* linear block indices: causal, the
  CTA with blockIdx.x = i takes kv block nKV - 1 - i of head (y, z); otherwise the grid is
  1-D, sections of (kv head, batch) pairs sized to L2, inside a section kv block major
  (highest first), pair minor (`FlashBwdSm90._deterministic_tile`, FA4's head swizzle).
  The GPU dispatches the
  CTAs of a grid in increasing linear index — not a documented CUDA guarantee, but the
  one FA3/FA4's deterministic backward and CUTLASS's stream-K fixup rely on — so when a
  CTA runs, every CTA it may wait for is resident or finished. Those wait only for CTAs
  of still lower index, so by induction on the index every CTA finishes; a spinning CTA
  holds its SM slot but never one that a CTA it waits for needs (already resident). A
  wait longer than ~17 s traps (`bwd.sm90.DQ_TURN_TIMEOUT_NS`): the launch fails instead
  of hanging if that assumption or the block lists are broken.
* Why decreasing order (FA4's "spt"): under causal and banded masks a CTA starts at its
  first visible q tile, lower kv blocks start lower and have more tiles; the highest kv
  block that sees a tile reaches it first, so CTAs proceeding in lockstep never wait.
  Dense: every CTA walks the tiles in the same order, so CTAs of one head that start
  together trail each other by one turn each; interleaving the heads of an L2 section
  spreads a head's CTAs over the launch, so few of them start together.
* Buffer gradients: the adds into one element come from many threads of many CTAs in
  no fixed order. Inside a CTA, relative-position reads are first summed per diagonal in
  a fixed order (bwd/sm90.py's diagonal reduction), per-head reads per warp by a fixed
  shuffle tree; across CTAs they are summed exactly: each element has a fixed-point
  accumulator (2^-64 resolution) in the workspace (`grad_fixed`, int64 [N, FIXED_WORDS]:
  four 32-bit-digit counters, N = the total element count of the gradients, zeroed by
  the preprocess); each contribution, rounded toward zero to a multiple of 2^-64, adds
  its nonzero digits with `red.add.u64` (no return value), and integer additions commute.
  The postprocess assembles each sum in 128 bits, rounds it to fp32 and adds it to the
  caller's gradient (which must be contiguous). Exact while |sum| < 2^63 and fewer than
  2^31 additions reach one element; inf / NaN contributions bypass it into the fp32
  array (their sum is order-independent too). See atomics.red_add_fixed.

Two runners, as for the forward: ``BackwardRunner`` (from_dlpack views, an explicit
stream) and ``FfiBackwardRunner``:
The backward launched through TVM-FFI: framework tensors in, microseconds of host time.

`BackwardRunner` wraps each of its 12–20 arguments with ``from_dlpack`` (tens
of µs each): ~0.4 ms of host time per backward, which left the GPU idle between a short
forward and the backward (window / document masks at B4 S4096: 450–600 µs idle per
training step; benchmarks/RESULTS.md). Compiled with ``--enable-tvm-ffi``
(`launch.compile.compile_*(tvm_ffi=True)`), the three kernels take framework tensors
directly — DLPack exchanged in C, dtype / rank / device / divisibility checked against
the compiled signature — and launch on TVM-FFI's environment stream (torch's current
stream; others set it around the launch: `core.kernel_path.ffi_stream_scope`).

What the compiled signature cannot check (shapes that must agree, the workspace layout,
GQA divisibility, block-list shapes) is checked here, on the tensors' ``shape`` tuples.
"""

import time

import cuda.bindings.driver as cuda
import cutlass

from flexattn.kernels.bwd.plan import workspace_dtypes, workspace_shapes
from flexattn.kernels.bwd.postprocess import postprocess_kernel
from flexattn.kernels.bwd.preprocess import BwdPreprocess
from flexattn.kernels.bwd.sm90 import BwdConfig
from flexattn.kernels.bwd.tf32_sync import backward_kernel
from flexattn.kernels.emit.mod_emit import IRModHook, fake_args
from flexattn.kernels.launch import disk_cache
from flexattn.kernels.launch.arguments import (arg_signature, check_block_list_shape, check_block_lists,
                                               check_q_and_kv_shapes, is_contiguous, to_cute)
from flexattn.kernels.launch.compile_lock import once
from flexattn.kernels.launch.compile import (compile_backward, compile_on_views, compile_postprocess,
                                             compile_preprocess)
from flexattn.kernels.launch.operands import BackwardArrays


_CUTE_DTYPE = {"float32": "Float32", "int32": "Int32", "int64": "Int64"}


class BackwardRunner:
    """`run(arrays, workspace, softmax_scale, mod_args, grad_args, stream, block_sparse=None)`.

    ``arrays`` (``BackwardArrays``): q, out, d_out, dq [B, Hq, Sq, D] and k, v, dk, dv
    [B, Hkv, Skv, D] of cfg.dtype (head dim contiguous, other strides multiples of 8
    elements); lse [B, Hq, Sq] fp32 natural-log LSE from the forward; d_lse (optional) its
    gradient. workspace: one contiguous array per
    `workspace_shapes` entry, in its order, of the `workspace_dtypes` dtype ((lse_log2,
    delta, dq_accum) fp32; deterministic: + dq_semaphore int32 (+ grad_fixed int64)).
    mod_args: the forward's hook args. grad_args: zeroed contiguous fp32 arrays, one per
    `cfg.mods.grad_slots` entry, shaped like that capture (0-d captures as [1]); None if
    there are none. block_sparse: the BlockMask's q-side lists (q_num_blocks, q_indices,
    full_q_num_blocks, full_q_indices), int32, q blocks of cfg.sparse_block_m rows, kv
    blocks of cfg.sparse_block_n (128), iff cfg.block_sparse; deterministic: followed by its kv-side
    lists (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)."""

    def __init__(self, cfg: BwdConfig):
        self.cfg = cfg
        self._compiled = {}
        self.last_compile_seconds = 0.0

    # ------------------------------------------------------------------ checks
    def _check(self, a: BackwardArrays, workspace, grad_shapes):
        """``a``: the arrays as cute tensors (static layouts)."""
        cfg = self.cfg
        want = str(cfg.cutlass_dtype)
        q, k = a.q, a.k
        (b, hq, sq, d) = q.shape
        qv = (*q.shape[:3], cfg.head_dim_v)      # O, dO: the value head dim
        kv = (*k.shape[:3], cfg.head_dim_v)      # V, dV
        for name, t, shape in (("q", q, q.shape), ("o", a.out, qv), ("do", a.d_out, qv),
                               ("dq", a.dq, q.shape), ("k", k, k.shape), ("v", a.v, kv),
                               ("dk", a.dk, k.shape), ("dv", a.dv, kv)):
            if str(t.element_type) != want:
                raise TypeError(f"{name}: dtype {t.element_type}, kernel compiled for {want}")
            if len(t.shape) != 4 or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)}, want {tuple(shape)}")
            if t.stride[3] != 1 and t.shape[3] != 1:
                raise ValueError(f"{name}: the head dim must be contiguous")
            if any(s % 8 for s in t.stride[:3]):
                raise ValueError(f"{name}: strides must be multiples of 8 elements (TMA)")
        if d != cfg.head_dim:
            raise ValueError(f"head dim {d}, kernel compiled for {cfg.head_dim}")
        check_q_and_kv_shapes(tuple(q.shape), tuple(k.shape))
        if not cfg.cluster_fits(k.shape[2]):
            raise ValueError(f"cluster_n={cfg.cluster_n} needs a multiple of {cfg.cluster_n} kv blocks "
                             f"of {cfg.tile_n} keys, got Skv={k.shape[2]}")
        for name, t in (("lse", a.lse), ("dlse", a.d_lse)):
            if t is None:
                continue
            if str(t.element_type) != "Float32" or tuple(t.shape) != (b, hq, sq):
                raise ValueError(f"{name}: want float32 [B, Hq, Sq] = {(b, hq, sq)}")
        shapes = workspace_shapes(cfg, b, hq, sq, grad_shapes)
        dtypes = workspace_dtypes(cfg)
        if len(workspace) != len(shapes):
            raise ValueError(f"workspace = ({', '.join(shapes)})")
        for (name, shape), t in zip(shapes.items(), workspace):
            if str(t.element_type) != _CUTE_DTYPE[dtypes[name]] or tuple(t.shape) != shape:
                raise ValueError(f"workspace {name}: want {dtypes[name]} {shape}, got "
                                 f"{t.element_type} {tuple(t.shape)}")
            contiguous = [1]
            for n in reversed(shape[1:]):
                contiguous.insert(0, contiguous[0] * n)
            if tuple(t.stride) != tuple(contiguous):
                raise ValueError(f"workspace {name} must be contiguous")

    def _check_block_sparse(self, q, k, block_sparse):
        cfg = self.cfg
        (B, Hq, Sq, _), Skv = q.shape, k.shape[2]
        if not (cfg.kv_lists and block_sparse is not None):
            return check_block_lists(block_sparse, cfg.block_sparse, B, Hq, -(-Skv // cfg.sparse_block_n),
                                     "q", f"kv blocks of {cfg.sparse_block_n}")
        if len(block_sparse) != 8:
            raise ValueError("deterministic or dq_finish block-sparse: block_sparse = (q_num_blocks, "
                             "q_indices, full_q_num_blocks, full_q_indices, kv_num_blocks, kv_indices, "
                             "full_kv_num_blocks, full_kv_indices): the kv-side lists order the "
                             "dQ adds / count each q tile's visitors")
        q_side = check_block_lists(block_sparse[:4], True, B, Hq, -(-Skv // cfg.sparse_block_n),
                                   "q", f"kv blocks of {cfg.sparse_block_n}")
        kv_side = check_block_lists(block_sparse[4:], True, B, Hq, -(-Sq // cfg.sparse_block_m),
                                    "kv", f"q blocks of {cfg.sparse_block_m}")
        return q_side + kv_side

    def _check_grads(self, grad_args):
        """-> (dynamic views or None, shapes)."""
        cfg = self.cfg
        slots = cfg.mods.grad_slots
        if not slots:
            if grad_args:
                raise ValueError("this score mod has no float buffers: grad_args must be None")
            return None, ()
        if grad_args is None or len(grad_args) != len(slots):
            raise ValueError(f"grad_args: want {len(slots)} fp32 arrays (captures {slots})")
        out, shapes = [], []
        for slot, g in zip(slots, grad_args):
            t, dyn = to_cute(g, 4)
            if str(t.element_type) != "Float32":
                raise ValueError(f"grad of capture {slot}: want float32, got {t.element_type}")
            if cfg.deterministic and not is_contiguous(t):
                raise ValueError(f"grad of capture {slot} must be contiguous")
            out.append(dyn)
            shapes.append(tuple(t.shape))
        return tuple(out), tuple(shapes)

    # ------------------------------------------------------------------ compile + launch
    def _compiled_fn(self, key, make_kernel, args):
        def make():
            fn, seconds = compile_on_views(make_kernel(), args)
            self.last_compile_seconds += seconds
            return fn

        return once(self._compiled, key, make)

    def bind(self, arrays: BackwardArrays, workspace, softmax_scale: float, mod_args: tuple, grad_args,
             stream: int, block_sparse=None):
        """Validate and compile once; return a no-argument launcher of the three kernels."""
        cfg = self.cfg
        self.last_compile_seconds = 0.0
        a = arrays
        dlse = a.d_lse
        mains = [to_cute(x, 16) for x in (a.q, a.k, a.v, a.out, a.d_out, a.dq, a.dk, a.dv)]
        names = list(workspace_dtypes(cfg))
        if len(workspace) != len(names):
            raise ValueError(f"workspace = ({', '.join(names)})")
        align = {"float32": 16, "int32": 4, "int64": 8}
        stats = [to_cute(x, align[dt]) for x, dt in zip(workspace, workspace_dtypes(cfg).values())]
        lse_v = to_cute(a.lse, 4)
        dlse_v = to_cute(dlse, 4) if dlse is not None else None
        grads, grad_shapes = self._check_grads(grad_args)
        sq, sk, sv, so, sdo, sdq, sdk, sdv = (s for s, _ in mains)
        self._check(BackwardArrays(sq, sk, sv, so, lse_v[0], sdo, sdq, sdk, sdv, dlse_v[0] if dlse_v else None),
                    [s for s, _ in stats], grad_shapes)
        bs = self._check_block_sparse(mains[0][0], mains[1][0], block_sparse)
        qd, kd, vd, od, dod, dqd, dkd, dvd = (dyn for _, dyn in mains)
        ws = dict(zip(names, (dyn for _, dyn in stats)))
        lse2, delta, dqacc = ws["lse_log2"], ws["delta"], ws["dq_accum"]
        dqsem, fixed = ws.get("dq_semaphore"), ws.get("grad_fixed")
        lsed = lse_v[1]
        dlsed = dlse_v[1] if dlse_v else None
        args = tuple(mod_args) if mod_args else None
        scale = cutlass.Float32(softmax_scale)
        cu_stream = cuda.CUstream(stream)

        # (cfg, hence deterministic and which workspaces exist, is fixed per runner.)
        dq_out = dqd if cfg.dq_finish else None
        pre_args = (od, dod, lsed, dlsed, lse2, delta, dqacc, dqsem, dq_out, fixed, cu_stream)
        pre = self._compiled_fn(("pre", dlse is not None), lambda: BwdPreprocess(cfg), pre_args)
        main_args = (qd, kd, vd, dod, lse2, delta, dqacc, dqsem, dq_out, dkd, dvd, scale, args, grads,
                     fixed, bs, cu_stream)
        grad_key = tuple(arg_signature(g) for g in grads or ())
        key = ("main",) + tuple(arg_signature(a) for a in mod_args or ()) + grad_key
        main = self._compiled_fn(key, lambda: backward_kernel(cfg), main_args)
        post = post_args = None          # (dq_finish: the main kernel stores dQ)
        if not cfg.dq_finish:
            post_grads = grads if fixed is not None else None
            post_args = (dqacc, dqd, scale, post_grads, fixed, cu_stream)
            post_key = ("post",) + (grad_key if fixed is not None else ())
            post = self._compiled_fn(post_key, lambda: postprocess_kernel(cfg), post_args)

        def launch():
            pre(*pre_args)
            main(*main_args)
            if post is not None:
                post(*post_args)
        return launch

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def run(self, arrays: BackwardArrays, workspace, softmax_scale: float, mod_args: tuple, grad_args,
            stream: int, block_sparse=None):
        self.bind(arrays, workspace, softmax_scale, mod_args, grad_args, stream, block_sparse)()


class FfiBackwardRunner:
    """``run(arrays, workspace, softmax_scale, mod_args, grad_args, block_sparse=None)`` with
    framework tensors: the arguments of `BackwardRunner.run` without the stream, ``mod_args`` as TVM-FFI call
    arguments (`arguments.ffi_mod_args`)."""

    def __init__(self, cfg: BwdConfig):
        if cfg.mods.has_score or cfg.mods.has_mask:
            if not isinstance(cfg.mods, IRModHook):
                raise TypeError("the TVM-FFI backward compiles from the hook's capture kinds: it needs an IRModHook")
        self.cfg = cfg
        self._compiled = {}    # with_dlse -> (preprocess, main, postprocess)
        self.last_compile_seconds = 0.0

    @property
    def num_compiled(self) -> int:
        """Kernels compiled: three (two under dq_finish) for the first dLSE variant, one
        preprocess per other."""
        return len({id(f) for fns in self._compiled.values() for f in fns if f is not None})

    def kernels(self, with_dlse: bool):
        """(preprocess, main, postprocess) compiled functions (once per runner and dLSE;
        postprocess None under dq_finish)."""
        def make():
            t0 = time.perf_counter()
            fns = self._compile(with_dlse)
            self.last_compile_seconds += time.perf_counter() - t0
            return fns

        return once(self._compiled, with_dlse, make)

    def _compile(self, with_dlse: bool):
        cfg = self.cfg
        mod_fakes = fake_args(cfg.mods) if isinstance(cfg.mods, IRModHook) else ()
        grad_ranks = tuple(len(mod_fakes[s].shape) for s in cfg.mods.grad_slots)
        fixed = cfg.deterministic and cfg.buffer_grads
        # The main kernel and the postprocess do not depend on dLSE: one compile serves both.
        other = self._compiled.get(not with_dlse)
        # Disk keys: the arguments each compile function reads (the main kernel: the config).
        pre = disk_cache.compiled(
            ("bwd_pre", cfg.dtype, cfg.head_dim, with_dlse, cfg.deterministic, fixed, cfg.tile_m)
            + ((cfg.head_dim_v,) if cfg.head_dim_v != cfg.head_dim else ())
            + (("dq_finish",) if cfg.dq_finish else ()) + (("pdl",) if cfg.pdl else ())
            + (("dq_first_store",) if cfg.dq_first_store else ()),
            lambda: compile_preprocess(cfg.dtype, cfg.head_dim, with_dlse, deterministic=cfg.deterministic,
                                       head_dim_v=cfg.head_dim_v, dq_finish=cfg.dq_finish, pdl=cfg.pdl,
                                       dq_first_store=cfg.dq_first_store, grad_fixed=fixed, tile_m=cfg.tile_m,
                                       tvm_ffi=True))
        if other is not None:
            return pre, other[1], other[2]
        main = disk_cache.compiled(disk_cache.config_key("bwd_main", cfg),
                                   lambda: compile_backward(cfg, mod_fakes, tvm_ffi=True))
        if cfg.dq_finish:
            return pre, main, None
        post_ranks = grad_ranks if fixed else ()
        post = disk_cache.compiled(
            ("bwd_post", cfg.dtype, cfg.head_dim, post_ranks, cfg.tile_m) + (("pdl",) if cfg.pdl else ()),
            lambda: compile_postprocess(cfg.dtype, cfg.head_dim, grad_ranks=post_ranks, tile_m=cfg.tile_m, pdl=cfg.pdl,
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
        want = 8 if cfg.kv_lists else 4
        if len(block_sparse) != want:
            raise ValueError(f"block_sparse: want {want} arrays (q-side lists"
                             + (", then the kv-side lists)" if want == 8 else ")"))
        for i, t in enumerate(block_sparse):   # q-side lists, then (kv_lists) kv-side
            if i < 4:
                check_block_list_shape(i, tuple(t.shape), b, hq, -(-sk // cfg.sparse_block_n), f"kv blocks of {cfg.sparse_block_n}")
            else:
                check_block_list_shape(i, tuple(t.shape), b, hq, -(-sq // cfg.sparse_block_m),
                                       f"q blocks of {cfg.sparse_block_m}")

    def run(self, arrays: BackwardArrays, workspace, softmax_scale: float, mod_args: tuple, grad_args,
            block_sparse=None, checked: bool = False, outputs=None) -> None:
        """``checked``: the arguments' shapes are a prepared call's, checked when it was
        prepared (``core.backward_path.PreparedBackward``): no `check` per step.
        ``outputs``: None, or a callable -> (dq, dk, dv) called once the preprocess is
        launched (before it under dq_finish, whose preprocess zeroes dQ's empty rows), in
        place of ``arrays``' own: a host-bound step's allocations then overlap the
        preprocess instead of delaying it."""
        a = arrays
        if not checked:
            self.check(a.q, a.k, a.lse, a.d_lse, workspace, grad_args, block_sparse)
        self.last_compile_seconds = 0.0
        pre, main, post = self.kernels(a.d_lse is not None)
        ws = dict(zip(workspace_dtypes(self.cfg), workspace))
        lse2, delta, dqacc = ws["lse_log2"], ws["delta"], ws["dq_accum"]
        dqsem, fixed = ws.get("dq_semaphore"), ws.get("grad_fixed")
        grads = tuple(grad_args) if grad_args else None
        scale = float(softmax_scale)
        dq, dk, dv = a.dq, a.dk, a.dv
        if outputs is not None and self.cfg.dq_finish:
            dq, dk, dv = outputs()
            outputs = None
        dq_out = dq if self.cfg.dq_finish else None
        pre(a.out, a.d_out, a.lse, a.d_lse, lse2, delta, dqacc, dqsem, dq_out, fixed)
        if outputs is not None:
            dq, dk, dv = outputs()
        main(a.q, a.k, a.v, a.d_out, lse2, delta, dqacc, dqsem, dq_out, dk, dv, scale,
             tuple(mod_args) if mod_args else None, grads, fixed, tuple(block_sparse) if block_sparse else None)
        if post is not None:
            post(dqacc, dq, scale, grads if fixed is not None else None, fixed)
