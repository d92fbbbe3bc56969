"""``@cute.jit`` entries for XLA's FFI: the forward and the backward as one host function
each, in the argument order ``cutlass.jax.cutlass_call`` wants (``stream, *arrays,
launch=``), so XLA launches our kernels from C with no Python at run time.

``cutlass_call`` compiles the entry into a module that the CuTeDSL runtime's FFI handler
calls with XLA's stream and buffers (each a compact row-major ``cute.Tensor``, shapes read
at run time). ``arrays`` are the call's inputs followed by its results that are not
aliased to an input (see ``flexattn/jax.py``); a launch description (``ForwardLaunch`` /
``BackwardLaunch``, a compile-time constant) says which array is which and carries
everything else: the kernel config (its mods' IR without values), the softmax scale and
the score/mask captures that are numbers. Those are compile-time constants of the entry:
a new scale or captured number compiles anew (they are constants of the traced jax
computation anyway; arrays are operands and never recompile).

The entries call the kernels' own ``__call__`` (``FlashFwdSm90``; ``BwdPreprocess``,
``FlashBwdSm90``, ``BwdPostprocess`` in stream order) with exactly the arguments the
runners pass (kernels/runner.py, kernels/bwd_runner.py). Framework-free: no jax here.
"""

from __future__ import annotations

import flexattn.kernels  # noqa: F401  (sets CUTE_DSL_ARCH before cutlass loads)

import cutlass
import cutlass.cute as cute

# Hook-arg sources: ("array", index into the entry's arrays) or ("int32" | "float32", value).
_SCALARS = {"int32": cutlass.Int32, "float32": cutlass.Float32}


def _mod_args(sources, arrays):
    out = tuple(arrays[s[1]] if s[0] == "array" else _SCALARS[s[0]](s[1]) for s in sources)
    return out or None


class _Launch:
    """A hashable compile-time description; equal when their keys are (the key names every
    compile-time input: kernel config key, scale, numbers, array positions)."""

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
    ``config.block_sparse``."""

    __slots__ = ("config", "scale", "main", "args", "lists")

    def __init__(self, config, scale: float, main: tuple, args: tuple, lists: tuple | None):
        self.config, self.scale, self.main, self.args, self.lists = config, float(scale), main, args, lists
        self.key = ("flexattn.fwd", config.key(), self.scale, main, args, lists)

    def emit(self, stream, arrays):
        from .fwd_sm90 import FlashFwdSm90

        q, k, v, o, lse = (arrays[i] for i in self.main)
        lists = None if self.lists is None else tuple(arrays[i] for i in self.lists)
        FlashFwdSm90(self.config)(q, k, v, o, lse, cutlass.Float32(self.scale), _mod_args(self.args, arrays),
                                  lists, stream)


class BackwardLaunch(_Launch):
    """``config``: a ``BwdConfig`` (not deterministic); ``main``: the positions of q, k, v,
    out, d_out, lse, d_lse (None: absent), dq, dk, dv; ``workspace``: of (lse_log2, delta,
    dq_accum) (``bwd_runner.workspace_shapes``); ``args``: hook-arg sources; ``grads``:
    positions of the zeroed fp32 gradients of ``config.mods.grad_slots``; ``lists``: of the
    q-side block lists iff ``config.block_sparse``."""

    __slots__ = ("config", "scale", "main", "workspace", "args", "grads", "lists")

    def __init__(self, config, scale: float, main: tuple, workspace: tuple, args: tuple, grads: tuple,
                 lists: tuple | None):
        if config.deterministic:
            raise ValueError("the XLA entry runs the default (non-deterministic) backward")
        self.config, self.scale, self.main, self.workspace = config, float(scale), main, workspace
        self.args, self.grads, self.lists = args, grads, lists
        self.key = ("flexattn.bwd", config.key(), self.scale, main, workspace, args, grads, lists)

    def emit(self, stream, arrays):
        from .bwd_postprocess import BwdPostprocess
        from .bwd_preprocess import BwdPreprocess
        from .bwd_sm90 import FlashBwdSm90

        cfg = self.config
        q, k, v, o, do, lse, dlse, dq, dk, dv = (None if i is None else arrays[i] for i in self.main)
        lse2, delta, dqacc = (arrays[i] for i in self.workspace)
        grads = tuple(arrays[i] for i in self.grads) or None
        lists = None if self.lists is None else tuple(arrays[i] for i in self.lists)
        scale = cutlass.Float32(self.scale)
        BwdPreprocess(cfg)(o, do, lse, dlse, lse2, delta, dqacc, None, None, stream)
        FlashBwdSm90(cfg)(q, k, v, do, lse2, delta, dqacc, None, dk, dv, scale, _mod_args(self.args, arrays),
                          grads, None, lists, stream)
        BwdPostprocess(cfg)(dqacc, dq, scale, None, None, stream)


@cute.jit
def forward_entry(stream, *arrays, launch: cutlass.Constexpr):
    """cutlass_call's ``fn`` for a ``ForwardLaunch``."""
    launch.emit(stream, arrays)


@cute.jit
def backward_entry(stream, *arrays, launch: cutlass.Constexpr):
    """cutlass_call's ``fn`` for a ``BackwardLaunch``."""
    launch.emit(stream, arrays)
