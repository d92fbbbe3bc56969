"""The forward launched through TVM-FFI: framework tensors in, microseconds of host time.

``ForwardRunner`` wraps every argument with ``from_dlpack`` (~35 µs per tensor on the
host), which starves the GPU when a call's kernel is short (B8 S2048 causal: 0.25 ms of
GPU work against ~250 µs of host time). Compiled with ``--enable-tvm-ffi``, the kernel
takes framework tensors directly — DLPack is exchanged in C, each argument is checked
against the compiled signature (dtype, rank, device, divisibility), and the launch goes to
the framework's current stream (TVM-FFI's environment stream).

Opt-in until measured on the GPU: ``FLEXATTN_TVM_FFI=1`` routes
``flexattn.core.kernel_path.forward_into`` here. Needs the ``apache-tvm-ffi`` package.
"""

from __future__ import annotations

import time

from flexattn.kernels.launch import disk_cache
from flexattn.kernels.launch.compile import compile_forward
from flexattn.kernels.fwd.sm90 import FwdConfig
from flexattn.kernels.emit.mod_emit import IRModHook, capture_kinds, fake_args


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
        if self._fn is None:  # capture kinds are part of cfg.key(): one compile per runner
            t0 = time.perf_counter()
            self._fn = disk_cache.compiled(disk_cache.config_key("fwd", self.cfg),
                                           lambda: compile_forward(self.cfg, fake_args(self.cfg.mods), tvm_ffi=True))
            self.last_compile_seconds = time.perf_counter() - t0

    @property
    def compiled(self):
        """The compiled function: ``(q, k, v, o, lse, scale, mod_args | None, block_sparse | None)``."""
        return self._fn

    def run(self, q, k, v, o, lse, softmax_scale: float, mod_args: tuple, block_sparse=None):
        self.compile()
        self._fn(q, k, v, o, lse, float(softmax_scale), tuple(mod_args) if mod_args else None, block_sparse)


def ffi_mod_args(hook: IRModHook, to_device) -> tuple:
    """The hook's captures as TVM-FFI call arguments (see ``FfiForwardRunner``)."""
    return ffi_args(capture_kinds(hook), hook.captures(), to_device)


def ffi_args(kinds: tuple, captures: tuple, to_device) -> tuple:
    """Captured values (kinds from ``capture_kinds``) as TVM-FFI call arguments."""
    out = []
    for kind, value in zip(kinds, captures):
        if kind[0] == "scalar":
            out.append(int(value) if kind[1] == "int32" else float(value))
            continue
        arr = to_device(value)
        out.append(arr.reshape(1) if len(arr.shape) == 0 else arr)
    return tuple(out)
