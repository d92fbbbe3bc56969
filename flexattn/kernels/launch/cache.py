"""Compile cache: one runner per kernel configuration, compiled kernels kept in memory —
and, for TVM-FFI kernels, on disk.

Forward runners (``forward_runner``), backward runners (``backward_runner``) and the
decode runners (``decode_runner``). Key:
``FwdConfig.key()`` / ``BwdConfig.key()`` — dtype, head dim, tiles, stages, schedule,
block structure and the mods' *structure* keys — plus, inside the runner, the kinds of the hook's runtime
args (scalar types, buffer dtypes and ranks). Captured values never enter a key, so new
values never recompile.

Behind this memory cache (a hit never touches the disk), a runner that must produce a
TVM-FFI kernel asks ``disk_cache.compiled`` first: kernels compiled by an earlier process
(same config, mods structure, versions, arch and kernel sources) are loaded from
``$FLEXATTN_CACHE_DIR`` / ``~/.cache/flexattn/kernels`` in milliseconds instead of
compiled in seconds (``FLEXATTN_DISK_CACHE=0`` turns that off; see disk_cache.py). The
``from_dlpack`` runners compile in every process: ``cute.compile`` bypasses CuTeDSL's own
file cache (``CUTE_DSL_CACHE_DIR``, which ``flexattn.kernels`` points at
``~/.cache/flexattn/cute-dsl``; only direct ``@cute.jit`` calls use it).
"""

from __future__ import annotations

from flexattn.kernels.fwd.sm90 import FwdConfig
from flexattn.kernels.launch.forward import ForwardRunner

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
            from flexattn.kernels.launch.forward import FfiForwardRunner

            return FfiForwardRunner(config)
        return ForwardRunner(config)

    return _cached(("sm_90a", tvm_ffi) + config.key(), make)


def backward_runner(config, tvm_ffi: bool = False):
    """The ``BackwardRunner`` for a ``BwdConfig`` (``FfiBackwardRunner`` with ``tvm_ffi``;
    its key: the config with the mods' structure keys; ``BwdConfig.key()`` starts with
    "bwd", so it never meets a forward's)."""
    def make():
        if tvm_ffi:
            from flexattn.kernels.launch.backward import FfiBackwardRunner

            return FfiBackwardRunner(config)
        from flexattn.kernels.launch.backward import BackwardRunner

        return BackwardRunner(config)

    return _cached(("sm_90a", tvm_ffi) + config.key(), make)


def decode_runner(config, tvm_ffi: bool = False):
    """The ``DecodeRunner`` for a ``DecodeConfig`` (split-KV decoding; key starts with "decode")."""
    def make():
        from flexattn.kernels.launch.decode import DecodeRunner

        return DecodeRunner(config, tvm_ffi)

    return _cached(("sm_90a", tvm_ffi) + config.key(), make)


def compile_count() -> int:
    """Kernels the runners of this process obtained so far, compiled or loaded from disk
    (``disk_load_count()`` of them): a load stands where a compile would have been, so
    tests use the count to prove that new values need no new kernel, whatever is on disk."""
    return sum(r.num_compiled for r in _RUNNERS.values())


def disk_load_count() -> int:
    """Kernels loaded from the disk cache instead of compiled, in this process (all runners,
    the block-mask builder's included)."""
    from flexattn.kernels.launch import disk_cache

    return disk_cache.load_count()


def clear() -> None:
    _RUNNERS.clear()
