"""A small kernel that evaluates mods on a [Q, KV] index grid, one thread per element.

It checks the IR → CuTeDSL emitter against the numpy oracle on the GPU, element by
element, with no attention kernel in the way; the GPU block-mask builder grows from it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir_helpers import arith as cutlass_arith

from flexattn.kernels.emit.affine_index import AffineIndex
from flexattn.kernels.emit.mod_emit import IRModHook, fake_args
from flexattn.kernels.emit.mod_hook import int32_vector

THREADS = 256


ROW = 8   # elements per thread in `rows` mode


class ModEvalKernel:
    """out_score[q, kv] = score_mod(s[q, kv], b, h, q, kv); out_mask[q, kv] = mask(b, h, q, kv).

    `rows`: each thread evaluates ROW consecutive keys of one query at once through the
    hook's row emission (``score_row`` / ``mask_row``, as the forward's apply_mods uses
    it), kv clamped into the grid (and reads past its end discarded).
    `hoisted`: per element, with the hook's ``row_invariants`` of (b, h, q) emitted first
    and passed back as ``row=`` (as the decode kernel hoists them out of its kv loop).
    `tiled` (a tile size, 0: off): the hook's ``tile_invariants`` at each aligned tile of
    that many keys emitted first and passed back as ``tile=`` (as the decode kernel and,
    with ``hoist_tile_reads``, the forward emit them), per element or per row.
    `affine` ("kv" or "q"): per element, the index the hooks take as an ``AffineIndex``
    where they ask for it, as the kernels pass it: "kv" as the forward does (unclamped),
    "q" as the backward does (clamped to Q_LEN - 1 for the score; unclamped for a mask
    that reads no buffer at q)."""

    def __init__(self, hook: IRModHook, rows: bool = False, hoisted: bool = False, tiled: int = 0,
                 affine: str = "kv"):
        if tiled and (tiled % ROW or tiled < ROW):
            raise ValueError(f"tiled must be a multiple of the row of {ROW} keys, got {tiled}")
        if affine not in ("kv", "q"):
            raise ValueError(f"affine must be 'kv' or 'q', got {affine!r}")
        self.hook = hook
        self.rows = rows
        self.hoisted = hoisted
        self.tiled = tiled
        self.affine = affine

    def _tile(self, b, h, q, kv, args) -> dict:
        """``tile=`` for the tile holding key ``kv`` (``tiled``), or nothing."""
        if cutlass.const_expr(not self.tiled):
            return {}
        values = self.hook.tile_invariants(b, h, q, (kv // self.tiled) * self.tiled, self.tiled, args)
        return {} if cutlass.const_expr(values is None) else {"tile": values}

    def _affine(self, var: str) -> bool:
        hook = self.hook
        return var == self.affine and hook.affine_index(var, hook.has_score, hook.has_mask)

    @cute.jit
    def __call__(self, scores: cute.Tensor, out_score: cute.Tensor, out_mask: cute.Tensor,
                 b: Int32, h: Int32, args, stream):
        n = cute.size(scores.shape[0]) * cute.size(scores.shape[1])
        if cutlass.const_expr(self.rows):
            n = cute.size(scores.shape[0]) * ((cute.size(scores.shape[1]) + ROW - 1) // ROW)
        grid = (n + THREADS - 1) // THREADS
        kernel = self.row_kernel if cutlass.const_expr(self.rows) else self.kernel
        kernel(scores, out_score, out_mask, b, h, args).launch(
            grid=[grid, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def row_kernel(self, scores: cute.Tensor, out_score: cute.Tensor, out_mask: cute.Tensor,
                   b: Int32, h: Int32, args):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        n_kv = scores.shape[1]
        n_seg = (n_kv + ROW - 1) // ROW
        i = bidx * THREADS + tidx
        if i < scores.shape[0] * n_seg:
            q = i // n_seg
            kv0 = (i - q * n_seg) * ROW
            kv_last = n_kv - 1
            frag = cute.make_rmem_tensor((ROW,), Float32)
            for c in cutlass.range_constexpr(ROW):
                frag[c] = scores[q, cutlass.min(kv0 + c, kv_last)]
            s = frag.load()
            kv = (int32_vector(list(range(ROW)), s.shape) + kv0).apply_op(cutlass_arith._min, kv_last)
            if cutlass.const_expr(self._affine("kv")):   # as the forward passes kv (clamped here)
                kv = AffineIndex(kv0, tuple(range(ROW)), s.shape, hi=kv_last)

            def kv_at(c):
                return cutlass.min(kv0 + c, kv_last)
            tile = self._tile(b, h, q, kv0, args)   # (ROW divides the tile: one tile per row segment)
            if cutlass.const_expr(self.hook.has_score):
                frag.store(self.hook.score_row(s, b, h, q, kv, args, kv_at=kv_at, **tile))
                for c in cutlass.range_constexpr(ROW):
                    if kv0 + c < n_kv:
                        out_score[q, kv0 + c] = frag[c]
            if cutlass.const_expr(self.hook.has_mask):
                keep = self.hook.mask_row(b, h, q, kv, args, kv_at=kv_at, shape=s.shape, **tile)
                if cutlass.const_expr(not isinstance(keep, cute.TensorSSA)):
                    keep = cute.full(s.shape, keep, cutlass.Boolean)
                # Elements read before the stores' branches (a TensorSSA caches IR for
                # indexing, which must dominate every later use).
                flags = cute.where(keep, cute.full(s.shape, 1, Int32), cute.full(s.shape, 0, Int32))
                mfrag = cute.make_rmem_tensor((ROW,), Int32)
                mfrag.store(flags)
                for c in cutlass.range_constexpr(ROW):
                    if kv0 + c < n_kv:
                        out_mask[q, kv0 + c] = cutlass.Int8(mfrag[c])

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
            row = {}
            if cutlass.const_expr(self.hoisted):
                row = {"row": self.hook.row_invariants(b, h, q, args)}
            row.update(self._tile(b, h, q, kv, args))
            # Indices in the form the kernels pass where the mod converts them to float
            # (affine_index): a base plus a compile-time offset, clamped as the backward's q.
            q_hook, kv_hook = q, kv
            if cutlass.const_expr(self._affine("kv")):
                kv_hook = AffineIndex(kv - 5, 5)
            if cutlass.const_expr(self._affine("q")):
                q_hook = AffineIndex(q - 3, 3, hi=scores.shape[0] - 1)
            unclamped = self.affine == "q" and self.hook.mask_takes_unclamped("q")   # as the backward
            q_mask = AffineIndex(q - 3, 3) if cutlass.const_expr(unclamped) else q_hook
            if cutlass.const_expr(self.hook.has_score):
                out_score[q, kv] = self.hook.score(scores[q, kv], b, h, q_hook, kv_hook, args, **row)
            if cutlass.const_expr(self.hook.has_mask):
                keep = self.hook.mask(b, h, q_mask, kv_hook, args, **row)
                out_mask[q, kv] = cutlass.Int8(cutlass.select_(keep, cutlass.Int8(1), cutlass.Int8(0)))


def compile_mod_eval(hook: IRModHook, options: str = "--gpu-arch=sm_90a", rows: bool = False,
                     hoisted: bool = False, tiled: int = 0, affine: str = "kv"):
    """Compile for sm_90a on fake tensors (no GPU needed). The runtime grids must be
    [Q, KV] with a contiguous last dim, passed through ``grid_arg``; args through
    ``mod_emit.runtime_args``. `rows`, `hoisted`, `tiled`, `affine`: see ``ModEvalKernel``."""
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    q, kv = cute.sym_int(), cute.sym_int()
    grid = lambda dt: make_fake_tensor(dt, (q, kv), (cute.sym_int64(), 1))  # noqa: E731
    from flexattn.kernels.launch.compile_lock import COMPILING

    args = fake_args(hook) or None
    with COMPILING:
        return cute.compile(ModEvalKernel(hook, rows, hoisted, tiled, affine), grid(Float32), grid(Float32),
                            grid(cutlass.Int8),
                            Int32(0), Int32(0), args, make_fake_stream(), options=options)


def grid_arg(array):
    """A [Q, KV] DLPack array (last dim contiguous) in the layout ``compile_mod_eval`` uses."""
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(array).mark_layout_dynamic(leading_dim=1)
