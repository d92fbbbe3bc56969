"""A small kernel that evaluates mods on a [Q, KV] index grid, one thread per element.

It checks the IR → CuTeDSL emitter against the numpy oracle on the GPU, element by
element, with no attention kernel in the way; the GPU block-mask builder grows from it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .mod_emit import IRModHook, fake_args

THREADS = 256


class ModEvalKernel:
    """out_score[q, kv] = score_mod(s[q, kv], b, h, q, kv); out_mask[q, kv] = mask(b, h, q, kv)."""

    def __init__(self, hook: IRModHook):
        self.hook = hook

    @cute.jit
    def __call__(self, scores: cute.Tensor, out_score: cute.Tensor, out_mask: cute.Tensor,
                 b: Int32, h: Int32, args, stream):
        n = cute.size(scores.shape[0]) * cute.size(scores.shape[1])
        grid = (n + THREADS - 1) // THREADS
        self.kernel(scores, out_score, out_mask, b, h, args).launch(
            grid=[grid, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, scores: cute.Tensor, out_score: cute.Tensor, out_mask: cute.Tensor,
               b: Int32, h: Int32, args):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        n_kv = scores.shape[1]
        i = bidx * THREADS + tidx
        if i < scores.shape[0] * n_kv:
            q = i // n_kv
            kv = i - q * n_kv
            if cutlass.const_expr(self.hook.has_score):
                out_score[q, kv] = self.hook.score(scores[q, kv], b, h, q, kv, args)
            if cutlass.const_expr(self.hook.has_mask):
                keep = self.hook.mask(b, h, q, kv, args)
                out_mask[q, kv] = cutlass.Int8(cutlass.select_(keep, cutlass.Int8(1), cutlass.Int8(0)))


def compile_mod_eval(hook: IRModHook, options: str = "--gpu-arch=sm_90a"):
    """Compile for sm_90a on fake tensors (no GPU needed). The runtime grids must be
    [Q, KV] with a contiguous last dim, passed through ``grid_arg``; args through
    ``mod_emit.runtime_args``."""
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    q, kv = cute.sym_int(), cute.sym_int()
    grid = lambda dt: make_fake_tensor(dt, (q, kv), (cute.sym_int64(), 1))  # noqa: E731
    args = fake_args(hook) or None
    return cute.compile(ModEvalKernel(hook), grid(Float32), grid(Float32), grid(cutlass.Int8),
                        Int32(0), Int32(0), args, make_fake_stream(), options=options)


def grid_arg(array):
    """A [Q, KV] DLPack array (last dim contiguous) in the layout ``compile_mod_eval`` uses."""
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(array).mark_layout_dynamic(leading_dim=1)
