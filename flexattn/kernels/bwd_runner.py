"""Launch the sm90 backward on DLPack arrays: validate, compile once per structure, run.

Three kernels on the caller's stream, in order:

    BwdPreprocess   delta = rowsum(dO * O) (- dLSE), lse_log2, dq_accum = 0
    FlashBwdSm90    dK, dV (input dtype), dq_accum += dS K (fp32 atomics), buffer grads
    BwdPostprocess  dQ = scale * dq_accum -> input dtype

Destination-passing and framework-free, like `ForwardRunner`: the caller allocates dq, dk,
dv, the fp32 workspace (`workspace_shapes`) and the zeroed fp32 buffer gradients. The
compiled kernels check nothing, so everything they assume is checked here, and each is
compiled on the very (dynamic-layout) tensors it is launched with.

Determinism: dK, dV and the preprocess/postprocess are deterministic (dK/dV of a kv head
are summed in registers, in a fixed order, by one CTA). dQ and buffer gradients are fp32
atomics whose order varies between runs (differences ~1 ulp of fp32 before the final
rounding). A `deterministic=True` mode (not implemented) would serialize dQ per q tile:
a per-(batch, head, q tile) int32 semaphore in the workspace; the CTA for kv block n waits
until the semaphore equals its rank in the visiting order (n for dense; the position in
the q-side list for block-sparse) before adding its tile (then increments it), as FA3/FA4
do. Buffer grads would instead be written per CTA into a [n_kv_blocks, *buffer] partial
array and summed by the postprocess in a fixed order.
"""

import time

import flexattn.kernels  # noqa: F401  (sets CUTE_DSL_ARCH before cutlass loads)
from flexattn.kernels.bwd_postprocess import BwdPostprocess
from flexattn.kernels.bwd_preprocess import BwdPreprocess
from flexattn.kernels.bwd_sm90 import BwdConfig, FlashBwdSm90
from flexattn.kernels.compile import ARCH_OPTION
from flexattn.kernels.runner import _arg_signature, _to_cute, check_block_lists

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute


def config_from_forward(fwd_cfg, **overrides) -> BwdConfig:
    """The backward config for a forward config (same dtype, head dim, block structure and
    mods): what `kernel_path.plan_forward` chose for the forward applies to the backward."""
    kw = dict(dtype=fwd_cfg.dtype, head_dim=fwd_cfg.head_dim, causal=fwd_cfg.causal,
              block_sparse=fwd_cfg.block_sparse, mods=fwd_cfg.mods)
    kw.update(overrides)
    return BwdConfig(**kw)


def padded_len(q_len: int, cfg: BwdConfig) -> int:
    return -(-q_len // cfg.q_pad) * cfg.q_pad


def workspace_shapes(cfg: BwdConfig, batch: int, q_heads: int, q_len: int) -> dict:
    """Shapes of the fp32 workspace arrays (contents need not be initialized)."""
    sp = padded_len(q_len, cfg)
    return {"lse_log2": (batch, q_heads, sp), "delta": (batch, q_heads, sp),
            "dq_accum": (batch, q_heads, sp, cfg.head_dim)}


class BackwardRunner:
    """`run(q, k, v, o, do, lse, dq, dk, dv, workspace, softmax_scale, mod_args, grad_args,
    stream, block_sparse=None, dlse=None)`.

    q, o, do, dq [B, Hq, Sq, D] and k, v, dk, dv [B, Hkv, Skv, D] of cfg.dtype (head dim
    contiguous, other strides multiples of 8 elements); lse [B, Hq, Sq] fp32 natural-log
    LSE from the forward; dlse (optional) its gradient. workspace = (lse_log2, delta,
    dq_accum) fp32 of `workspace_shapes`, contiguous. mod_args: the forward's hook args.
    grad_args: zeroed contiguous fp32 arrays, one per `cfg.mods.grad_slots` entry, shaped
    like that capture (0-d captures as [1]); None if there are none. block_sparse: the
    BlockMask's q-side lists (q_num_blocks, q_indices, full_q_num_blocks, full_q_indices),
    int32, q blocks of cfg.sparse_block_m rows, kv blocks of cfg.tile_n, iff
    cfg.block_sparse."""

    def __init__(self, cfg: BwdConfig):
        self.cfg = cfg
        self._compiled = {}
        self.last_compile_seconds = 0.0

    # ------------------------------------------------------------------ checks
    def _check(self, q, k, v, o, do, lse, dq, dk, dv, workspace, dlse):
        cfg = self.cfg
        want = str(cfg.cutlass_dtype)
        (b, hq, sq, d), (bk, hk, sk, _) = q.shape, k.shape
        for name, t, shape in (("q", q, q.shape), ("o", o, q.shape), ("do", do, q.shape),
                               ("dq", dq, q.shape), ("k", k, k.shape), ("v", v, k.shape),
                               ("dk", dk, k.shape), ("dv", dv, k.shape)):
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
        if bk != b or hk == 0 or hq % hk:
            raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)}: batch must match and "
                             "Hq must be a multiple of Hkv")
        if sk < 1 or sq < 1:
            raise ValueError("empty sequences are not supported")
        for name, t in (("lse", lse), ("dlse", dlse)):
            if t is None:
                continue
            if str(t.element_type) != "Float32" or tuple(t.shape) != (b, hq, sq):
                raise ValueError(f"{name}: want float32 [B, Hq, Sq] = {(b, hq, sq)}")
        shapes = workspace_shapes(cfg, b, hq, sq)
        if len(workspace) != 3:
            raise ValueError("workspace = (lse_log2, delta, dq_accum)")
        for (name, shape), t in zip(shapes.items(), workspace):
            if str(t.element_type) != "Float32" or tuple(t.shape) != shape:
                raise ValueError(f"workspace {name}: want float32 {shape}, got "
                                 f"{t.element_type} {tuple(t.shape)}")
            contiguous = [1]
            for n in reversed(shape[1:]):
                contiguous.insert(0, contiguous[0] * n)
            if tuple(t.stride) != tuple(contiguous):
                raise ValueError(f"workspace {name} must be contiguous")

    def _check_block_sparse(self, q, k, block_sparse):
        (B, Hq, _, _), Skv = q.shape, k.shape[2]
        return check_block_lists(block_sparse, self.cfg.block_sparse, B, Hq, -(-Skv // self.cfg.tile_n),
                                 "q", f"kv blocks of {self.cfg.tile_n}")

    def _check_grads(self, grad_args):
        slots = self.cfg.mods.grad_slots
        if not slots:
            if grad_args:
                raise ValueError("this score mod has no float buffers: grad_args must be None")
            return None
        if grad_args is None or len(grad_args) != len(slots):
            raise ValueError(f"grad_args: want {len(slots)} fp32 arrays (captures {slots})")
        out = []
        for slot, g in zip(slots, grad_args):
            t, dyn = _to_cute(g, 4)
            if str(t.element_type) != "Float32":
                raise ValueError(f"grad of capture {slot}: want float32, got {t.element_type}")
            out.append(dyn)
        return tuple(out)

    # ------------------------------------------------------------------ compile + launch
    def _compiled_fn(self, key, make):
        fn = self._compiled.get(key)
        if fn is None:
            t0 = time.perf_counter()
            fn = make()
            self.last_compile_seconds += time.perf_counter() - t0
            self._compiled[key] = fn
        return fn

    def bind(self, q, k, v, o, do, lse, dq, dk, dv, workspace, softmax_scale: float,
             mod_args: tuple, grad_args, stream: int, block_sparse=None, dlse=None):
        """Validate and compile once; return a no-argument launcher of the three kernels."""
        cfg = self.cfg
        self.last_compile_seconds = 0.0
        mains = [_to_cute(x, 16) for x in (q, k, v, o, do, dq, dk, dv)]
        stats = [_to_cute(x, 16) for x in workspace]
        lse_v = _to_cute(lse, 4)
        dlse_v = _to_cute(dlse, 4) if dlse is not None else None
        sq, sk, sv, so, sdo, sdq, sdk, sdv = (s for s, _ in mains)
        self._check(sq, sk, sv, so, sdo, lse_v[0], sdq, sdk, sdv, [s for s, _ in stats],
                    dlse_v[0] if dlse_v else None)
        bs = self._check_block_sparse(mains[0][0], mains[1][0], block_sparse)
        grads = self._check_grads(grad_args)
        qd, kd, vd, od, dod, dqd, dkd, dvd = (dyn for _, dyn in mains)
        lse2, delta, dqacc = (dyn for _, dyn in stats)
        lsed = lse_v[1]
        dlsed = dlse_v[1] if dlse_v else None
        args = tuple(mod_args) if mod_args else None
        scale = cutlass.Float32(softmax_scale)
        cu_stream = cuda.CUstream(stream)

        pre_args = (od, dod, lsed, dlsed, lse2, delta, dqacc, cu_stream)
        pre = self._compiled_fn(("pre", dlse is not None), lambda: cute.compile(
            BwdPreprocess(cfg), *pre_args, options=ARCH_OPTION))
        main_args = (qd, kd, vd, dod, lse2, delta, dqacc, dkd, dvd, scale, args, grads, bs,
                     cu_stream)
        key = ("main",) + tuple(_arg_signature(a) for a in mod_args or ()) + \
            tuple(_arg_signature(g) for g in grads or ())
        main = self._compiled_fn(key, lambda: cute.compile(
            FlashBwdSm90(cfg), *main_args, options=ARCH_OPTION))
        post_args = (dqacc, dqd, scale, cu_stream)
        post = self._compiled_fn(("post",), lambda: cute.compile(
            BwdPostprocess(cfg), *post_args, options=ARCH_OPTION))

        def launch():
            pre(*pre_args)
            main(*main_args)
            post(*post_args)
        return launch

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def run(self, q, k, v, o, do, lse, dq, dk, dv, workspace, softmax_scale: float,
            mod_args: tuple, grad_args, stream: int, block_sparse=None, dlse=None):
        self.bind(q, k, v, o, do, lse, dq, dk, dv, workspace, softmax_scale, mod_args,
                  grad_args, stream, block_sparse, dlse)()
