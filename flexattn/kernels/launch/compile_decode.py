"""Compile the decode kernel ahead of time on fake tensors (CPU-only, no driver).

Symbolic shapes and strides exactly as `decode_runner` passes them (head dim contiguous,
16-byte rows; fp32 workspaces and int32 vectors with contiguous last dims), so the PTX
is the one a launch would use.
"""

import tempfile

from flexattn.kernels.launch.compile import ARCH_OPTION, _dump_dir, compile_kernel
from flexattn.kernels.decode.sm90 import DecodeConfig, DecodeSm90


def _fake(dtype, rank: int, align: int, inner: int | None = None, divisibility: int = 1):
    """Fake tensor: symbolic sizes (last one `inner` if given) and outer strides, last dim
    contiguous."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    shape = tuple(cute.sym_int() for _ in range(rank - 1)) + (inner if inner is not None else cute.sym_int(),)
    stride = tuple(cute.sym_int64(divisibility=divisibility) for _ in range(rank - 1)) + (1,)
    return make_fake_tensor(dtype, shape, stride, assumed_align=align)


def fake_decode_args(cfg: DecodeConfig, mod_args: tuple = (), tvm_ffi: bool = False):
    """Fake (q, k, v, page_table, seq_lens, o, lse, o_part, lse_part, tickets, scale,
    mod_args, stream) for `DecodeSm90.__call__`."""
    import cutlass
    from cutlass.cute.runtime import make_fake_stream

    dt = cfg.cutlass_dtype
    vec = 128 // dt.width
    q, k, v, o = (_fake(dt, 4, 16, cfg.head_dim, vec) for _ in range(4))
    table = _fake(cutlass.Int32, 2, 4) if cfg.paged else None
    seq_lens = _fake(cutlass.Int32, 1, 4)
    lse = _fake(cutlass.Float32, 3, 4)
    o_part = _fake(cutlass.Float32, 5, 16, cfg.head_dim, 4)
    lse_part = _fake(cutlass.Float32, 4, 4)
    tickets = _fake(cutlass.Int32, 1, 4)
    return (q, k, v, table, seq_lens, o, lse, o_part, lse_part, tickets, cutlass.Float32(1.0),
            tuple(mod_args) if mod_args else None, make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi))


def _compile(kernel, args, keep_ptx: bool, tvm_ffi: bool):
    opts = " ".join(o for o in (ARCH_OPTION, "--keep-ptx" if keep_ptx else "",
                                "--enable-tvm-ffi" if tvm_ffi else "") if o)
    if not keep_ptx:
        return compile_kernel(kernel, args, opts, tvm_ffi)
    with tempfile.TemporaryDirectory() as d, _dump_dir(d):
        return compile_kernel(kernel, args, opts, tvm_ffi)


def compile_decode(cfg: DecodeConfig, mod_args: tuple = (), *, keep_ptx: bool = False, tvm_ffi: bool = False):
    """Compile the split-KV decode kernel for `cfg` (`mod_args`: typed stand-ins)."""
    return _compile(DecodeSm90(cfg), fake_decode_args(cfg, mod_args, tvm_ffi), keep_ptx, tvm_ffi)

