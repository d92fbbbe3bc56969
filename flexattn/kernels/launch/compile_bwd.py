"""Compile the backward kernels ahead of time on fake tensors (CPU-only, no driver).

The backward counterpart of `compile.compile_forward`: symbolic shapes and strides shaped
exactly like what `bwd_runner.BackwardRunner` passes (head dim contiguous, 16-byte rows,
fp32 workspaces with contiguous last dim), so the PTX is the one a launch would use.
"""

import tempfile

from flexattn.kernels.bwd.postprocess import BwdPostprocess
from flexattn.kernels.bwd.preprocess import BwdPreprocess
from flexattn.kernels.bwd.sm90 import BwdConfig, FlashBwdSm90
from flexattn.kernels.launch.compile import ARCH_OPTION, _dump_dir, compile_kernel, fake_bhsd, fake_block_lists


def _fake_f32(rank: int):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    shape = tuple(cute.sym_int() for _ in range(rank))
    # 16-byte aligned rows (TMA reads LSE / D boxes; the runner pads rows to q_pad).
    stride = tuple(cute.sym_int64(divisibility=4) for _ in range(rank - 1)) + (1,)
    return make_fake_tensor(cutlass.Float32, shape, stride, assumed_align=16)


def _fake_lse():
    """The forward's LSE (or its gradient) as the runner passes it: fp32 [B, H, Sq], last
    dim contiguous, 4-byte aligned (a framework's tensor, not our padded workspace)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(cutlass.Float32, tuple(cute.sym_int() for _ in range(3)),
                            (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)


def _fake_int(dtype, rank: int, align: int):
    """A workspace of `dtype` (the dq semaphores, the fixed-point grad accumulators), last
    dim contiguous, as the runner passes it (`bwd_runner.workspace_dtypes`)."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    shape = tuple(cute.sym_int() for _ in range(rank))
    stride = tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,)
    return make_fake_tensor(dtype, shape, stride, assumed_align=align)


def fake_dq_semaphore(cfg: BwdConfig):
    import cutlass

    return _fake_int(cutlass.Int32, 3, 4) if cfg.deterministic else None


def fake_grad_fixed(cfg: BwdConfig):
    import cutlass

    return _fake_int(cutlass.Int64, 2, 8) if cfg.deterministic and cfg.buffer_grads else None


def fake_grad_args(cfg: BwdConfig, mod_args: tuple):
    """fp32 gradient buffers for the score mod's float-buffer captures (same ranks)."""
    if not cfg.buffer_grads:
        return None
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    out = []
    for slot in cfg.mods.grad_slots:
        rank = len(mod_args[slot].shape)
        shape = tuple(cute.sym_int() for _ in range(rank))
        stride = tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,)
        out.append(make_fake_tensor(cutlass.Float32, shape, stride))
    return tuple(out)


def fake_backward_args(cfg: BwdConfig, mod_args: tuple = (), tvm_ffi: bool = False):
    """Fake (q, k, v, do, lse_log2, delta, dq_accum, dq_semaphore, dk, dv, scale, mod_args,
    grad_args, grad_fixed, block_sparse, stream) for `FlashBwdSm90.__call__`. With `tvm_ffi`
    the stream is TVM-FFI's environment stream (the caller framework's current stream)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    dt = cfg.cutlass_dtype
    b, hq, hkv, sq, skv = (cute.sym_int() for _ in range(5))
    D = cfg.head_dim
    q, do = (fake_bhsd(dt, n, b, hq, sq, D) for n in ("q", "do"))
    k, v, dk, dv = (fake_bhsd(dt, n, b, hkv, skv, D) for n in ("k", "v", "dk", "dv"))
    # q_num_blocks, q_indices, full_q_num_blocks, full_q_indices (+ the kv-side lists)
    block_sparse = None
    if cfg.block_sparse:
        block_sparse = fake_block_lists() + (fake_block_lists() if cfg.deterministic else ())
    return (q, k, v, do, _fake_f32(3), _fake_f32(3), _fake_f32(4), fake_dq_semaphore(cfg),
            dk, dv, cutlass.Float32(1.0), tuple(mod_args) if mod_args else None,
            fake_grad_args(cfg, mod_args), fake_grad_fixed(cfg), block_sparse,
            make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi))


def _compile(kernel, args, keep_ptx: bool, extra_options: str, tvm_ffi: bool = False):
    """`tvm_ffi`: the result takes framework tensors (DLPack exchanged in C, arguments
    checked against the compiled signature) and launches on the framework's current stream
    (see compile.compile_forward)."""
    opts = " ".join(o for o in (ARCH_OPTION, "--keep-ptx" if keep_ptx else "",
                                "--enable-tvm-ffi" if tvm_ffi else "", extra_options) if o)
    if not keep_ptx:
        return compile_kernel(kernel, args, opts, tvm_ffi)
    with tempfile.TemporaryDirectory() as d, _dump_dir(d):
        return compile_kernel(kernel, args, opts, tvm_ffi)


def compile_backward(cfg: BwdConfig, mod_args: tuple = (), *, keep_ptx: bool = False,
                     extra_options: str = "", tvm_ffi: bool = False):
    """Compile the sm90 backward main kernel for `cfg` (`mod_args`: typed stand-ins)."""
    return _compile(FlashBwdSm90(cfg), fake_backward_args(cfg, mod_args, tvm_ffi), keep_ptx, extra_options,
                    tvm_ffi)


def compile_preprocess(dtype: str, head_dim: int, with_dlse: bool = False, *,
                       deterministic: bool = False, grad_fixed: bool = False, tile_m: int = 64,
                       keep_ptx: bool = False, tvm_ffi: bool = False):
    """`deterministic`: also zero the dQ semaphores; `grad_fixed`: and the fixed-point
    buffer-gradient accumulators. `tile_m`: the main kernel's (one CTA per q tile)."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    cfg = BwdConfig(dtype=dtype, head_dim=head_dim, tile_m=tile_m, deterministic=deterministic)
    b, h, s = (cute.sym_int() for _ in range(3))
    o, do = (fake_bhsd(cfg.cutlass_dtype, n, b, h, s, head_dim) for n in ("o", "do"))
    fixed = None
    if grad_fixed:
        import cutlass
        fixed = _fake_int(cutlass.Int64, 2, 8)
    args = (o, do, _fake_lse(), _fake_lse() if with_dlse else None, _fake_f32(3),
            _fake_f32(3), _fake_f32(4), fake_dq_semaphore(cfg), fixed,
            make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi))
    return _compile(BwdPreprocess(cfg), args, keep_ptx, "", tvm_ffi)


def compile_postprocess(dtype: str, head_dim: int, *, grad_ranks: tuple = (), tile_m: int = 64,
                        keep_ptx: bool = False, tvm_ffi: bool = False):
    """`grad_ranks`: deterministic mode's buffer gradients (their ranks) to finish;
    `tile_m`: the main kernel's (it wrote dq_accum in its tiles' fragment order)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    cfg = BwdConfig(dtype=dtype, head_dim=head_dim, tile_m=tile_m)
    b, h, s = (cute.sym_int() for _ in range(3))
    dq = fake_bhsd(cfg.cutlass_dtype, "dq", b, h, s, head_dim)
    grads = fixed = None
    if grad_ranks:
        grads = tuple(make_fake_tensor(cutlass.Float32, tuple(cute.sym_int() for _ in range(r)),
                                       tuple(cute.sym_int64() for _ in range(r - 1)) + (1,))
                      for r in grad_ranks)
        fixed = _fake_int(cutlass.Int64, 2, 8)
    args = (_fake_f32(4), dq, cutlass.Float32(1.0), grads, fixed, make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi))
    return _compile(BwdPostprocess(cfg), args, keep_ptx, "", tvm_ffi)
