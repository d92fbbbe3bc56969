"""The GPU backward: gradients of a call whose forward ran through ``kernel_path.forward_into``.

Framework-neutral and destination-passing, like the forward: the adapter allocates dq, dk,
dv, supplies the forward's ``out`` and ``lse``, a ``Device`` (stream + host→GPU copies) and
an allocator for fp32 scratch arrays (the workspace, and the buffer gradients, which this
module hands back). The call is planned exactly as the forward was (``plan_forward``: same
kernel support checks, same block structure — dense, built-in causal or block-sparse — and
the same mods), so the backward visits the tiles the forward did; block-sparse calls read
the block mask's q-side lists.

Three kernels run on the caller's stream (``kernels.launch.backward.BackwardRunner``; through
TVM-FFI, ``kernels.launch.backward.FfiBackwardRunner``, where the forward would be):
preprocess (delta = rowsum(dO·O) − dLSE, log2 LSE, dQ accumulator zeroed), the main
kernel (dK, dV; dQ and captured-buffer gradients by fp32 atomics), postprocess (dQ).
Nothing synchronizes with the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..kernels.launch.operands import BackwardArrays
from . import kernel_path
from .kernel_path import Device, KernelPlan, ffi_stream_scope, ffi_tensors, plan_forward, use_tvm_ffi
from ..problem.spec import AttentionSpec
from ..problem.validate import AttentionShape


@dataclass(frozen=True)
class BackwardResult:
    plan: KernelPlan   # the forward's plan (config, block mask)
    config: object     # kernels.bwd.sm90.BwdConfig
    capture_grads: tuple  # per score-mod capture (``spec.score.captures`` order): its
    # fp32 gradient (shaped like the capture; 0-d captures as [1]), or None for captures
    # without one (numbers, int buffers, buffers the score does not depend on)


# alloc(shape, dtype, zeroed) -> a contiguous DLPack array on the GPU of ``dtype`` (a numpy
# dtype name: "float32" today; the workspace of a deterministic backward will add int32 /
# int64 arrays), zero-filled iff ``zeroed`` (the workspace needs no initialization, buffer
# gradients do).
Allocator = Callable[[tuple, str, bool], Any]


def backward_into(arrays: BackwardArrays, shape: AttentionShape, spec: AttentionSpec, device: Device,
                  alloc: Allocator, deterministic: bool = False, grad_captures=None,
                  merged_lse: bool = False) -> BackwardResult:
    """Run the backward kernels, writing ``arrays.dq/dk/dv``; return the buffer gradients.

    ``spec`` must be the forward's (same mods, captured values, block mask, scale).
    Gradients are computed for every float buffer the score mod reads (the kernel has one
    structure per mod); the adapter keeps those of the captures it differentiates.
    ``deterministic``: bitwise-repeatable dQ and buffer gradients (dQ tiles added in a
    fixed order, buffer gradients in exact fixed point; see kernels/launch/backward.py).
    ``grad_captures``: the score-capture slots whose gradients are wanted (None: all);
    the others get None and cost nothing.
    ``merged_lse``: ``arrays.lse`` is a merge over more keys than this call's (context
    parallelism's chunk pairs): planned without first-visit dQ stores (``_planned_config``).
    """
    from ..kernels.launch.cache import backward_runner
    from ..kernels.emit.mod_emit import IRModHook, runtime_args

    # raises what the kernel cannot do; float32: the forward's tf32 passes
    plan = plan_forward(arrays.q, shape, spec, tf32_passes=device.tf32_passes)
    cfg = _planned_config(plan, deterministic, grad_captures, merged_lse)
    hook = cfg.mods
    lists = _q_lists(cfg, plan, device)
    workspace = tuple(alloc(s, dtype, False) for _, s, dtype in backward_workspace(cfg, shape))
    captures = hook.captures()
    slots = hook.grad_slots
    grads = tuple(alloc(_grad_shape(captures[s]), "float32", True) for s in slots)
    scale = spec.resolved_scale(shape.head_dim)
    if use_tvm_ffi(device, stream_scope=True):  # see kernels/launch/backward.py
        from ..kernels.launch.arguments import ffi_mod_args

        args = ffi_mod_args(hook, device.to_device) if isinstance(hook, IRModHook) else ()
        with ffi_stream_scope(arrays.q, device):
            backward_runner(cfg, tvm_ffi=True).run(arrays, workspace, scale, args, grads or None, lists)
    else:
        args = runtime_args(hook, device.to_device)
        backward_runner(cfg).run(arrays, workspace, scale, args, grads or None, device.stream, lists)
    by_slot = [None] * (len(spec.score.captures) if spec.score is not None else 0)
    for s, g in zip(slots, grads):
        by_slot[s] = g
    return BackwardResult(plan, cfg, tuple(by_slot))


def _planned_config(plan: KernelPlan, deterministic: bool, grad_captures, merged_lse: bool):
    """The backward config of a planned forward. Under ``merged_lse`` no dQ tile is stored
    by its first visit (``BwdConfig.dq_first_store``) nor by the main kernel's finishers
    (``dq_finish``, an A/B setting): both leave the preprocess zeroing only rows whose LSE
    is -inf, on the ground that a q tile no CTA visits has only such rows. True of a call's
    own LSE; a merged LSE is finite in rows this call's mask leaves empty (their keys sit in
    another chunk), whose dQ would keep stale values."""
    overrides = {"dq_first_store": False, "dq_finish": False} if merged_lse else {}
    return backward_config(plan.config, deterministic, grad_captures, plan.backward_ctas, **overrides)


def _q_lists(cfg, plan: KernelPlan, device: Device):
    """The block mask's lists the backward reads, on the GPU: the q-side lists (and, when
    deterministic or dq_finish (`BwdConfig.kv_lists`), the kv-side ones: each CTA counts the
    kv blocks ahead of it in a q tile's kv list, or all of them), or None (dense, causal, and the band structure, which walks by
    arithmetic)."""
    if not cfg.block_sparse:
        return None
    names = ["q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"]
    if cfg.kv_lists:
        names += ["kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"]
    return tuple(device.to_device(plan.block_mask.list_array(n)) for n in names)


class PreparedBackward:
    """The backward of one call shape, ready to launch again (``prepare_backward``): the
    kernels compiled, the block lists and unchanging captures on the GPU, the workspace
    and gradient shapes known. ``launch(arrays, alloc)`` allocates, launches the three
    kernels (TVM-FFI, on the framework's current stream) and returns the buffer gradients
    by score-capture slot, as ``BackwardResult.capture_grads``. A repeated training step
    then skips the planning and checks (~0.3 ms of host time per backward).

    Holds no mod object (its adapter's cache entry must die with the mods), only
    captured values, as ``kernel_path.PreparedForward``."""

    __slots__ = ("deterministic", "_runner", "_workspace", "_grad_shapes", "_slots", "_n_slots",
                 "_scale", "_kinds", "_captures", "_args", "_to_device", "_lists")

    def __init__(self, plan: KernelPlan, spec: AttentionSpec, shape: AttentionShape, device: Device,
                 deterministic: bool, grad_captures, merged_lse: bool = False):
        from ..kernels.emit.mod_emit import capture_kinds
        from ..kernels.launch.arguments import ffi_args
        from ..kernels.launch.cache import backward_runner

        cfg = _planned_config(plan, deterministic, grad_captures, merged_lse)
        self.deterministic = deterministic
        self._runner = backward_runner(cfg, tvm_ffi=True)
        self._runner.kernels(False)   # compiled (or loaded) now, not inside a step
        self._workspace = tuple((s, dtype) for _, s, dtype in backward_workspace(cfg, shape))
        self._kinds, self._captures = capture_kinds(cfg.mods), cfg.mods.captures()
        self._slots = cfg.mods.grad_slots
        self._grad_shapes = tuple(_grad_shape(self._captures[s]) for s in self._slots)
        self._n_slots = len(spec.score.captures) if spec.score is not None else 0
        self._scale = spec.resolved_scale(shape.head_dim)
        self._to_device = device.to_device
        kinds, captures, to_device = self._kinds, self._captures, self._to_device   # (no cycle through self)
        self._args = kernel_path.CaptureArgs(captures, lambda: ffi_args(kinds, captures, to_device) or None,
                                             device.same_memory, ffi_tensors)
        self._lists = ffi_tensors(_q_lists(cfg, plan, device))

    def operand_positions(self, operands) -> tuple:
        """Where each array of ``operands`` sits among this launch's captures (for
        ``launch(operands=)``)."""
        return kernel_path.operand_positions(self._captures, operands)

    def launch(self, arrays: BackwardArrays, alloc: Allocator, operands=None, positions=None,
               outputs=None) -> tuple:
        """``operands`` at ``positions``: this call's arrays in place of the prepared call's
        (a compiled graph's op call). ``outputs``: dq, dk, dv allocated once the preprocess
        is launched (`FfiBackwardRunner.run`), ``arrays``' own None."""
        if operands is None:
            args = self._args.current()
        else:
            from ..kernels.launch.arguments import ffi_args

            captures = kernel_path.with_operands(self._captures, operands, positions)
            args = ffi_args(self._kinds, captures, self._to_device) or None
        workspace = tuple(alloc(s, dtype, False) for s, dtype in self._workspace)
        grads = tuple(alloc(s, "float32", True) for s in self._grad_shapes)
        # The call's shapes are the prepared call's (its key), checked then; a compiled
        # graph's operands may be new arrays: checked.
        self._runner.run(arrays, workspace, self._scale, args, grads or None, self._lists,
                         checked=operands is None, outputs=outputs)
        by_slot = [None] * self._n_slots
        for s, g in zip(self._slots, grads):
            by_slot[s] = g
        return tuple(by_slot)


def prepare_backward(q, shape: AttentionShape, spec: AttentionSpec, device: Device, deterministic: bool = False,
                     grad_captures=None, merged_lse: bool = False) -> PreparedBackward | None:
    """A ``PreparedBackward`` for calls like this one, or None where launches must go
    through ``backward_into`` (no TVM-FFI, or a stream TVM-FFI does not read itself)."""
    if not (device.tvm_ffi_stream and use_tvm_ffi(device)):
        return None
    return PreparedBackward(plan_forward(q, shape, spec, tf32_passes=device.tf32_passes), spec, shape, device,
                            deterministic, grad_captures, merged_lse)


def backward_config(forward_config, deterministic: bool = False, grad_captures=None, max_ctas: int = 0,
                    **overrides):
    """The backward's ``BwdConfig`` for a forward's config (every adapter's backward plan):
    same structure and mods, gradients only for the ``grad_captures`` slots (None: all);
    ``max_ctas`` persistent CTAs (``KernelPlan.backward_ctas``; never deterministic);
    ``overrides``: other fields (the XLA entry: dq_finish=False)."""
    from ..kernels.bwd.plan import config_from_forward

    reason = kernel_path.backward_unsupported_dims(forward_config.head_dim, forward_config.head_dim_v,
                                                   forward_config.dtype == "fp32")
    if reason:
        raise ValueError(reason)
    mods = forward_config.mods
    if grad_captures is not None:
        mods = mods.with_grad_filter(grad_captures)
    return config_from_forward(forward_config, deterministic=deterministic, mods=mods,
                               max_ctas=0 if deterministic else max_ctas, **overrides)


def backward_workspace(cfg, shape: AttentionShape) -> list:
    """[(name, shape, dtype name)] of the backward's workspace arrays, in argument order
    (contents need not be initialized; contiguous)."""
    from ..kernels.bwd.plan import workspace_dtypes, workspace_shapes

    dtypes = workspace_dtypes(cfg)
    return [(name, tuple(s), dtypes[name])
            for name, s in workspace_shapes(cfg, shape.batch, shape.q_heads, shape.q_len).items()]


def _grad_shape(capture) -> tuple:
    """The shape of a capture's gradient array: the capture's, 0-d as [1] (as passed)."""
    return tuple(int(n) for n in capture.shape) or (1,)


__all__ = ["Allocator", "BackwardArrays", "BackwardResult", "PreparedBackward", "backward_config", "backward_into",
           "backward_workspace", "prepare_backward"]
