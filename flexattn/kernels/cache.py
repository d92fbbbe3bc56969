"""Compile cache: one runner per kernel configuration, compiled kernels kept in memory.

Forward runners (``forward_runner``), backward runners (``backward_runner``) and the
decode runners (``decode_runner``). Key:
``FwdConfig.key()`` / ``BwdConfig.key()`` — dtype, head dim, tiles, stages, schedule,
block structure and the mods' *structure* keys — plus, inside the runner, the kinds of the hook's runtime
args (scalar types, buffer dtypes and ranks). Captured values never enter a key, so new
values never recompile. Nothing is kept on disk: ``cute.compile`` (every kernel here is
compiled through it) bypasses CuTeDSL's file cache (``CUTE_DSL_CACHE_DIR``, which
``flexattn.kernels`` points at ``~/.cache/flexattn/cute-dsl``; only direct ``@cute.jit``
calls use it), so each process compiles its kernels anew.
"""

from __future__ import annotations

from .fwd_sm90 import FwdConfig
from .runner import ForwardRunner

_RUNNERS: dict[tuple, object] = {}


def _cached(key: tuple, make):
    """The runner under ``key``, made by ``make()`` the first time."""
    runner = _RUNNERS.get(key)
    if runner is None:
        runner = _RUNNERS[key] = make()
    return runner


def forward_runner(config: FwdConfig, tvm_ffi: bool = False):
    """The runner for ``config`` (``ForwardRunner``, or ``FfiForwardRunner`` with ``tvm_ffi``)."""
    def make():
        if tvm_ffi:
            from .ffi_runner import FfiForwardRunner

            return FfiForwardRunner(config)
        return ForwardRunner(config)

    return _cached(("sm_90a", tvm_ffi) + config.key(), make)


def backward_runner(config, tvm_ffi: bool = False):
    """The ``BackwardRunner`` for a ``BwdConfig`` (``FfiBackwardRunner`` with ``tvm_ffi``;
    its key: the config with the mods' structure keys; ``BwdConfig.key()`` starts with
    "bwd", so it never meets a forward's)."""
    def make():
        if tvm_ffi:
            from .bwd_ffi_runner import FfiBackwardRunner

            return FfiBackwardRunner(config)
        from .bwd_runner import BackwardRunner

        return BackwardRunner(config)

    return _cached(("sm_90a", tvm_ffi) + config.key(), make)


def decode_runner(config, tvm_ffi: bool = False):
    """The ``DecodeRunner`` for a ``DecodeConfig`` (split-KV decoding; key starts with "decode")."""
    def make():
        from .decode_runner import DecodeRunner

        return DecodeRunner(config, tvm_ffi)

    return _cached(("sm_90a", tvm_ffi) + config.key(), make)


def compile_count() -> int:
    """Kernels compiled in this process so far (tests use it to prove values don't recompile)."""
    return sum(r.num_compiled for r in _RUNNERS.values())


def clear() -> None:
    _RUNNERS.clear()
