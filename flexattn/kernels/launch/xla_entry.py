"""``@cute.jit`` entries for XLA's FFI: the forward, the backward and the short-query
forward (the decode kernel) as one host function each, in the argument order
``cutlass.jax.cutlass_call`` wants (``stream, *arrays, launch=``), so XLA launches our
kernels from C with no Python at run time.

``cutlass_call`` compiles the entry into a module that the CuTeDSL runtime's FFI handler
calls with XLA's stream and buffers (each a compact row-major ``cute.Tensor``, shapes read
at run time). ``arrays`` are the call's inputs followed by its results (none aliased to
an input, see below and ``flexattn/jax.py``); a launch description (``ForwardLaunch`` /
``BackwardLaunch``, a compile-time constant) says which array is which and carries
everything else: the kernel config (its mods' IR without values), the softmax scale and
the score/mask captures that are numbers. Those are compile-time constants of the entry:
a new scale or captured number compiles anew (they are constants of the traced jax
computation anyway; arrays are operands and never recompile).

The entries call the kernels' own ``__call__`` (``FlashFwdSm90``; ``BwdPreprocess``,
``FlashBwdSm90``, ``BwdPostprocess`` in stream order) with exactly the arguments the
runners pass (kernels/launch/forward.py, kernels/launch/backward.py). Framework-free: no jax here.

Results that must start filled (the backward's buffer gradients, accumulated by fp32
atomics: zeros; in the GPU tests every result the kernels write: NaN) are filled here, by a
fill kernel in stream order before the main kernels, never as operands aliased to the
results (``input_output_aliases``): XLA's dynamic-slice fusion (on by default in jax
0.11.2) wraps a custom call whose operands are dynamic slices and whose result feeds a
dynamic-update-slice (a ``lax.scan`` / ``lax.map`` body) and hands the call the slice of
the stacked result as its result buffer, while an aliased operand keeps a buffer of its
own; the CuTeDSL runtime passes the kernel the operand (aliased results are not kernel
arguments), so the kernel wrote where XLA never read — the stacked results stayed zero.
"""

from __future__ import annotations

import flexattn.kernels  # noqa: F401  (sets CUTE_DSL_ARCH before cutlass loads)

import cutlass
import cutlass.cute as cute

# Hook-arg sources: ("array", index into the entry's arrays) or ("int32" | "float32", value).
_SCALARS = {"int32": cutlass.Int32, "float32": cutlass.Float32}


_FILL_THREADS = 256
# Fill kinds in ``fills`` (names, not floats: NaN != NaN would make equal keys unequal).
FILL_VALUES = {"zero": 0.0, "nan": float("nan")}


@cute.kernel
def _fill_kernel(t: cute.Tensor, value: cutlass.Float32, n: cutlass.Int32):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * _FILL_THREADS + tidx
    if i < n:
        t[i] = value.to(t.element_type)


def _fill(fills, arrays, stream):
    """Fill ``arrays[i]`` with ``FILL_VALUES[kind]`` for each (i, kind) of ``fills``, in
    stream order: one small kernel each, a thread per element (a flat index visits every
    element of a compact tensor once, whatever its rank)."""
    for i, kind in fills:
        t = arrays[i]
        n = cute.size(t.shape)
        _fill_kernel(t, cutlass.Float32(FILL_VALUES[kind]), n).launch(
            grid=[n // _FILL_THREADS + 1, 1, 1], block=[_FILL_THREADS, 1, 1], stream=stream)


def _mod_args(sources, arrays):
    out = tuple(arrays[s[1]] if s[0] == "array" else _SCALARS[s[0]](s[1]) for s in sources)
    return out or None


class _Launch:
    """A hashable compile-time description; equal when their keys are (the key names every
    compile-time input: kernel config key, scale, numbers, array positions, fills)."""

    __slots__ = ("key",)

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return type(other) is type(self) and other.key == self.key

    def __repr__(self):
        return f"{type(self).__name__}{self.key!r}"


class ForwardLaunch(_Launch):
    """``config``: a ``FwdConfig`` (its hook's IR; captured values unused); ``main``: the
    positions of q, k, v, out, lse; ``args``: hook-arg sources in args order; ``lists``:
    positions of (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) iff
    ``config.block_sparse``, then of the tile tickets' counter (a result zero-filled
    here) iff ``config.tile_tickets``; ``fills``: (position, ``FILL_VALUES`` kind) of results filled
    before the kernel (the GPU tests' NaN); ``operands``: for fp32, the positions of the
    scratch results the operand pass writes first (V^T, then with 3xTF32 Q's and K's
    parts; kernels/fwd/fp32_operands.py), the forward reading those instead."""

    __slots__ = ("config", "scale", "main", "args", "lists", "fills", "operands")

    def __init__(self, config, scale: float, main: tuple, args: tuple, lists: tuple | None, fills: tuple = (),
                 operands: tuple | None = None):
        self.config, self.scale, self.main, self.args, self.lists = config, float(scale), main, args, lists
        self.fills, self.operands = tuple(fills), operands
        self.key = ("flexattn.fwd", config.key(), self.scale, main, args, lists, self.fills, operands)

    def emit(self, stream, arrays):
        from flexattn.kernels.fwd.sm90 import FlashFwdSm90

        _fill(self.fills, arrays, stream)
        q, k, v, o, lse = (arrays[i] for i in self.main)
        if self.operands is not None:
            q, k, v = _fp32_operands(self.config, q, k, v, [arrays[i] for i in self.operands], stream)
        lists = None if self.lists is None else tuple(arrays[i] for i in self.lists)
        FlashFwdSm90(self.config)(q, k, v, o, lse, cutlass.Float32(self.scale), _mod_args(self.args, arrays),
                                  lists, None, stream)


def _fp32_operands(config, q, k, v, scratch, stream):
    """The fp32 forward's operands written into ``scratch`` (one array per
    ``operand_passes``, in order), as ``kernels/launch/fp32.py`` does for the other
    adapters -> (q, k, v) the forward reads."""
    from flexattn.kernels.fwd.fp32_operands import Fp32Operands, operand_passes

    arrays = {"q": q, "k": k, "v": v}
    for (source, cfg), out in zip(operand_passes(config), scratch):
        Fp32Operands(cfg)(arrays[source], out, stream)
        arrays[source] = out
    return arrays["q"], arrays["k"], arrays["v"]


class BackwardLaunch(_Launch):
    """``config``: a ``BwdConfig`` (not deterministic); ``main``: the positions of q, k, v,
    out, d_out, lse, d_lse (None: absent), dq, dk, dv; ``workspace``: of (lse_log2, delta,
    dq_accum and, under dq_first_store, dq_semaphore) (``bwd.plan.workspace_shapes``);
    ``args``: hook-arg sources; ``grads``:
    positions of the fp32 gradients of ``config.mods.grad_slots`` (zero-filled here before
    the kernels); ``lists``: of the q-side block lists iff ``config.block_sparse``;
    ``fills``: other results filled first (the GPU tests' NaN)."""

    __slots__ = ("config", "scale", "main", "workspace", "args", "grads", "lists", "fills")

    def __init__(self, config, scale: float, main: tuple, workspace: tuple, args: tuple, grads: tuple,
                 lists: tuple | None, fills: tuple = ()):
        if config.deterministic or config.dq_finish:
            raise ValueError("the XLA entry runs the default (non-deterministic) backward, dQ by the postprocess")
        if len(workspace) != 3 + config.dq_flags:
            raise ValueError(f"{len(workspace)} workspace positions for a config with"
                             f"{'' if config.dq_flags else 'out'} dQ tickets")
        self.config, self.scale, self.main, self.workspace = config, float(scale), main, workspace
        self.args, self.grads, self.lists = args, grads, lists
        self.fills = tuple(fills) + tuple((i, "zero") for i in grads)
        self.key = ("flexattn.bwd", config.key(), self.scale, main, workspace, args, grads, lists, self.fills)

    def emit(self, stream, arrays):
        from flexattn.kernels.bwd.postprocess import postprocess_kernel
        from flexattn.kernels.bwd.preprocess import BwdPreprocess
        from flexattn.kernels.bwd.tf32_sync import backward_kernel

        cfg = self.config
        q, k, v, o, do, lse, dlse, dq, dk, dv = (None if i is None else arrays[i] for i in self.main)
        lse2, delta, dqacc = (arrays[i] for i in self.workspace[:3])
        # dq_first_store's tickets (the preprocess zeroes them), or None
        dqsem = arrays[self.workspace[3]] if cfg.dq_flags else None
        grads = tuple(arrays[i] for i in self.grads) or None
        lists = None if self.lists is None else tuple(arrays[i] for i in self.lists)
        scale = cutlass.Float32(self.scale)
        _fill(self.fills, arrays, stream)
        BwdPreprocess(cfg)(o, do, lse, dlse, lse2, delta, dqacc, dqsem, None, None, stream)
        backward_kernel(cfg)(q, k, v, do, lse2, delta, dqacc, dqsem, None, dk, dv, scale, _mod_args(self.args, arrays),
                             grads, None, lists, stream)
        postprocess_kernel(cfg)(dqacc, dq, scale, None, None, stream)


class DecodeLaunch(_Launch):
    """A short-query forward through the split-KV decode kernel (``core/short_query.py``'s
    route): ``config`` a ``DecodeConfig`` (capture-free hook); ``main`` the positions of q,
    k, v, seq_lens (int32 [B], every entry the key count), out, lse, o_part, lse_part and
    tickets (zero-filled here: the kernel counts arrivals in them); ``args`` hook-arg
    sources; ``fills`` other results filled first (the GPU tests' NaN)."""

    __slots__ = ("config", "scale", "main", "args", "fills")

    def __init__(self, config, scale: float, main: tuple, args: tuple, fills: tuple = ()):
        self.config, self.scale, self.main, self.args = config, float(scale), main, args
        self.fills = tuple(fills) + ((main[8], "zero"),)
        self.key = ("flexattn.decode", config.key(), self.scale, main, args, self.fills)

    def emit(self, stream, arrays):
        from flexattn.kernels.decode.sm90 import DecodeSm90

        _fill(self.fills, arrays, stream)
        q, k, v, seq_lens, o, lse, o_part, lse_part, tickets = (arrays[i] for i in self.main)
        DecodeSm90(self.config)(q, k, v, None, seq_lens, o, lse, o_part, lse_part, tickets,
                                cutlass.Float32(self.scale), _mod_args(self.args, arrays), stream)


@cute.jit
def forward_entry(stream, *arrays, launch: cutlass.Constexpr):
    """cutlass_call's ``fn`` for a ``ForwardLaunch``."""
    launch.emit(stream, arrays)


@cute.jit
def backward_entry(stream, *arrays, launch: cutlass.Constexpr):
    """cutlass_call's ``fn`` for a ``BackwardLaunch``."""
    launch.emit(stream, arrays)


@cute.jit
def decode_entry(stream, *arrays, launch: cutlass.Constexpr):
    """cutlass_call's ``fn`` for a ``DecodeLaunch``."""
    launch.emit(stream, arrays)
