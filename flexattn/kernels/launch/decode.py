"""Launching the split-KV decode kernel: compile once per structure, run cheaply.

Two launch paths, as for the forward (``forward.py``): with ``tvm_ffi`` the kernel is
compiled on fake tensors for TVM-FFI calls (framework tensors straight in, the framework's
current stream); otherwise arguments are wrapped with ``from_dlpack`` and the kernel is
compiled on those very views (it reads arguments in the layout it was traced with) and
launched on an explicit stream. The compiled kernel checks nothing: ``core/decode_path.py``
validates every argument first.
"""

from __future__ import annotations

import time

import cuda.bindings.driver as cuda
import cutlass

from flexattn.kernels.decode.sm90 import DecodeConfig, DecodeSm90
from flexattn.kernels.emit.mod_emit import fake_args
from flexattn.kernels.launch import disk_cache
from flexattn.kernels.launch.arguments import arg_signature, dlpack_view
from flexattn.kernels.launch.compile import compile_decode, compile_on_views
from flexattn.kernels.launch.compile_lock import once


class DecodeRunner:
    """``run(q, k, v, page_table, seq_lens, o, lse, o_part, lse_part, tickets, scale,
    mod_args, stream)``: shapes as in `DecodeSm90.__call__`; ``page_table`` None for a
    contiguous cache; ``tickets`` the arrival counters (zero). TVM-FFI: ``mod_args``
    from ``launch.arguments.ffi_mod_args``, ``stream`` ignored;
    else cute values from ``mod_emit.runtime_args`` and a CUstream handle."""

    def __init__(self, cfg: DecodeConfig, tvm_ffi: bool = False):
        self.cfg, self.tvm_ffi = cfg, tvm_ffi
        self._compiled = {}
        self.last_compile_seconds = 0.0

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def ffi_function(self, mod_args: tuple = ()):
        """The TVM-FFI entry (compiled on first use): ``fn(q, k, v, page_table, seq_lens,
        o, lse, o_part, lse_part, tickets, scale, mod_args | None)``, launching on the
        framework's current stream (``core/decode_path.DecodePlan.run`` calls it directly);
        ``mod_args`` are the stand-ins for hooks without IR captures."""
        def make():
            t0 = time.perf_counter()
            ir_hook = hasattr(self.cfg.mods, "captures")
            fake = fake_args(self.cfg.mods) if ir_hook else tuple(mod_args or ())
            # Stand-ins of a hand-written hook's args are not part of the config key: no disk.
            key = disk_cache.config_key("decode", self.cfg) if ir_hook or not fake else None
            fn = disk_cache.compiled(key, lambda: compile_decode(self.cfg, fake, tvm_ffi=True))
            self.last_compile_seconds = time.perf_counter() - t0
            return fn

        return once(self._compiled, "ffi", make)

    def run(self, q, k, v, page_table, seq_lens, o, lse, o_part, lse_part, tickets, scale: float,
            mod_args: tuple, stream: int):
        if self.tvm_ffi:
            self.ffi_function(mod_args)(q, k, v, page_table, seq_lens, o, lse, o_part, lse_part, tickets, float(scale),
                                tuple(mod_args) if mod_args else None)
            return
        tensors = [dlpack_view(x, 16) for x in (q, k, v)]
        tensors += [None if page_table is None else dlpack_view(page_table, 4), dlpack_view(seq_lens, 4),
                    dlpack_view(o, 16), dlpack_view(lse, 4), dlpack_view(o_part, 16), dlpack_view(lse_part, 4),
                    dlpack_view(tickets, 4)]
        args = tuple(mod_args) if mod_args else None
        s = cutlass.Float32(scale)
        cu_stream = cuda.CUstream(stream)
        key = tuple(arg_signature(a) for a in mod_args or ())
        def make():
            fn, self.last_compile_seconds = compile_on_views(DecodeSm90(self.cfg), (*tensors, s, args, cu_stream))
            return fn

        fn = once(self._compiled, key, make)
        fn(*tensors, s, args, cu_stream)
