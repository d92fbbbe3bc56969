"""Compile kernels ahead of time on fake tensors: no GPU and no driver query needed.

`compile_forward(cfg, ...)` traces `FlashFwdSm90(cfg)` on symbolic-shape fake tensors and
returns a `cute.compile` result that can be launched with real tensors of the same dtypes
and ranks (any sizes / strides with D contiguous). On a CPU-only machine set
nothing: the target is passed as a compile option (`ARCH_OPTION`); PTX and CUBIN are kept on request so tests
can inspect them.
"""

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

from flexattn.kernels.fwd.sm90 import FlashFwdSm90, FwdConfig

ARCH = "sm_90a"
# Passed to every compile: it overrides CUTE_DSL_ARCH / GPU detection, so compiling works
# on a GPU-less machine whatever the environment, and never probes the driver.
ARCH_OPTION = f"--gpu-arch={ARCH}"


def fake_bhsd(dtype, name: str, sym_b, sym_h, sym_s, head_dim: int):
    """A [B, H, S, D] fake tensor with symbolic B/H/S and strides, D contiguous and
    16-byte aligned rows (what TMA requires)."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    elems_16b = 128 // dtype.width
    stride = (cute.sym_int64(divisibility=elems_16b), cute.sym_int64(divisibility=elems_16b),
              cute.sym_int64(divisibility=elems_16b), 1)
    return make_fake_tensor(dtype, (sym_b, sym_h, sym_s, head_dim), stride, assumed_align=16)


def fake_block_lists():
    """Fake BlockMask lists (num_blocks [B, H, rows], indices [B, H, rows, cols], partial
    then full), int32 with symbolic sizes, in the runner's layout (last dim contiguous)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    # One symbol per dim: a repeated symbol would declare the dims equal (TVM-FFI checks it).
    def counts():
        return make_fake_tensor(cutlass.Int32, tuple(cute.sym_int() for _ in range(3)),
                                (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)

    def indices():
        return make_fake_tensor(cutlass.Int32, tuple(cute.sym_int() for _ in range(4)),
                                (cute.sym_int64(), cute.sym_int64(), cute.sym_int64(), 1),
                                assumed_align=4)

    return (counts(), indices(), counts(), indices())


def fake_forward_args(cfg: FwdConfig, mod_args: tuple = (), tvm_ffi: bool = False):
    """Fake (q, k, v, o, lse, softmax_scale, mod_args, block_sparse, stream) for
    `FlashFwdSm90.__call__`.
    Q/O and K/V have independent symbolic head counts and sequence lengths. With `tvm_ffi`
    the stream is TVM-FFI's environment stream (the caller framework's current stream)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    dt = cfg.cutlass_dtype
    b, hq, hkv, sq, skv = (cute.sym_int() for _ in range(5))
    q = fake_bhsd(dt, "q", b, hq, sq, cfg.head_dim)
    k = fake_bhsd(dt, "k", b, hkv, skv, cfg.head_dim)
    v = fake_bhsd(dt, "v", b, hkv, skv, cfg.head_dim)
    o = fake_bhsd(dt, "o", b, hq, sq, cfg.head_dim)
    lse = make_fake_tensor(cutlass.Float32, (b, hq, sq),
                           (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
    # kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices
    block_sparse = fake_block_lists() if cfg.block_sparse else None
    # No hook args travel as None: CuTeDSL cannot pass an empty tuple.
    return (q, k, v, o, lse, cutlass.Float32(1.0), tuple(mod_args) if mod_args else None,
            block_sparse, make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi))


def compile_forward(cfg: FwdConfig, mod_args: tuple = (), *, keep_ptx: bool = False,
                    keep_cubin: bool = False, extra_options: str = "", tvm_ffi: bool = False):
    """Compile the sm90 forward for `cfg`. `mod_args` gives the *types* of the hook's
    runtime args (fake tensors / typed scalars); their values are irrelevant.

    `tvm_ffi`: compile for TVM-FFI calls — the result takes framework tensors directly
    (DLPack exchanged in C, arguments checked against the compiled signature) and runs on
    the framework's current stream; a call costs microseconds instead of the ~35 µs per
    tensor of `from_dlpack`."""
    opts = " ".join(o for o in (
        ARCH_OPTION, "--keep-ptx" if keep_ptx else "", "--keep-cubin" if keep_cubin else "",
        "--enable-tvm-ffi" if tvm_ffi else "", extra_options,
    ) if o)
    args = fake_forward_args(cfg, mod_args, tvm_ffi)
    if not (keep_ptx or keep_cubin):
        return compile_kernel(FlashFwdSm90(cfg), args, opts, tvm_ffi)
    # Kept artifacts go to the DSL's dump dir (the CWD at import time) and are read back
    # into the result at once; point it at a scratch directory for this compile.
    with tempfile.TemporaryDirectory() as d, _dump_dir(d):
        return compile_kernel(FlashFwdSm90(cfg), args, opts, tvm_ffi)


# CuTeDSL pass-pipeline options that change compile time only: without its
# StrengthReductionPass (~0.2 s of MLIR passes per forward kernel on the CI CPU) the PTX of
# every kernel in benchmarks/compile_time.py is byte-identical (NVVM does that work anyway).
PIPELINE_OPTIONS = "use-strength-reduction-pass=false"


@contextlib.contextmanager
def pipeline_options(extra: str = PIPELINE_OPTIONS):
    """Compiles inside add `extra` to CuTeDSL's pipeline options (as CUTE_DSL_COMPILER_OPT,
    after any the user set there)."""
    from cutlass.cutlass_dsl import CuTeDSL

    envar = CuTeDSL._get_dsl().envar
    old = envar.compiler_opt
    envar.compiler_opt = f"{old} {extra}".strip() if old else extra
    try:
        yield
    finally:
        envar.compiler_opt = old


def compile_kernel(kernel, args, options: str, tvm_ffi: bool):
    """``cute.compile(kernel, *args, options=options)``; for TVM-FFI without the host JIT
    whose result CuTeDSL throws away.

    For a TVM-FFI function CuTeDSL JITs the host module (an MLIR ExecutionEngine, whose
    entry it looks up), then compiles the same module again into an object file that it
    loads with JITLink, and keeps only that (``TVMFFIJitCompiledFunctionBase.
    _create_tvm_ffi_function``). The first engine costs ~0.2 s per compile on the CI CPU
    (more with more arguments) and is never used: a placeholder takes its place. Should
    CuTeDSL ever keep the placeholder (a changed code path), the kernel is compiled again
    the ordinary way."""
    import cutlass.cute as cute

    with pipeline_options(), _no_pyir_auto_load():
        if not tvm_ffi:
            return cute.compile(kernel, *args, options=options)
        with _placeholder_host_engine() as placeholder, _captured_objects() as objects:
            fn = cute.compile(kernel, *args, options=options)
        if placeholder is not None and getattr(fn, "engine", None) is placeholder:
            return cute.compile(kernel, *args, options=options)
        if len(objects) == 1 and isinstance(getattr(fn, "function_name", None), str):
            # The object file CuTeDSL just built and JIT-linked: disk_cache stores it as is
            # instead of exporting the module once more (~0.3 s per kernel on the CI CPU).
            fn.flexattn_object = (objects[0], fn.function_name)
        return fn


@contextlib.contextmanager
def _no_pyir_auto_load():
    """Without PyIR (CuTeDSL's default), every op's arguments still pass through its
    auto-load hook (``_pyir_auto_load_arg``, which loads PyIR-tracked values), a no-op for
    values no PyIR ref tracks: ~0.1 s of a forward kernel's trace on the CI CPU. While
    PyIR is off, the hook is the identity CuTeDSL itself installs when PyIR is missing."""
    from cutlass.cutlass_dsl import CuTeDSL

    try:
        from cutlass._mlir_helpers import op
    except ImportError:
        op = None
    hook = getattr(op, "_pyir_auto_load_arg", None)
    if hook is None or getattr(CuTeDSL._get_dsl().envar, "enable_pyir", True):
        yield
        return
    op._pyir_auto_load_arg = _identity_load
    try:
        yield
    finally:
        op._pyir_auto_load_arg = hook


def _identity_load(arg, *, row_authoritative=False):
    return arg


class _CapturingAot:
    """Stands in for CuTeDSL's ``_aot_support`` module, keeping what
    ``export_module_to_bytes`` returns (the kernel's relocatable object file)."""

    def __init__(self, aot, objects: list):
        self._aot, self._objects = aot, objects

    def export_module_to_bytes(self, *args, **kwargs):
        data = self._aot.export_module_to_bytes(*args, **kwargs)
        if kwargs.get("format") == "o" and isinstance(data, bytes):
            self._objects.append(data)
        return data

    def __getattr__(self, name):
        return getattr(self._aot, name)


@contextlib.contextmanager
def _captured_objects():
    """The object files CuTeDSL's TVM-FFI path builds while compiling (empty if that code
    path changed: the disk cache then exports the module itself)."""
    objects: list = []
    try:
        from cutlass.cutlass_dsl import tvm_ffi_provider as provider
    except ImportError:
        yield objects
        return
    aot = getattr(provider, "_aot_support", None)
    if aot is None or not callable(getattr(aot, "export_module_to_bytes", None)):
        yield objects
        return
    provider._aot_support = _CapturingAot(aot, objects)
    try:
        yield objects
    finally:
        provider._aot_support = aot


class _PlaceholderEngine:
    """Stands in for the throw-away host JIT: no entry points (CuTeDSL's lookup of the
    C entry then finds none, which the TVM-FFI path never calls)."""

    def lookup(self, name):
        return None


@contextlib.contextmanager
def _placeholder_host_engine():
    from cutlass.cutlass_dsl import CuTeDSL

    provider = getattr(CuTeDSL._get_dsl(), "compiler_provider", None)
    if provider is None or not callable(getattr(provider, "jit", None)) or "jit" in vars(provider):
        yield None   # not the code path this was written for: change nothing
        return
    placeholder = _PlaceholderEngine()
    provider.jit = lambda *args, **kwargs: placeholder
    try:
        yield placeholder
    finally:
        del provider.jit


@contextlib.contextmanager
def _dump_dir(path: str):
    from cutlass.cutlass_dsl import CuTeDSL

    envar = CuTeDSL._get_dsl().envar
    old = envar.dump_dir
    envar.dump_dir = path
    try:
        yield
    finally:
        envar.dump_dir = old


@dataclass
class ResourceUsage:
    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    smem_bytes: int


def resource_usage_from_ptx(ptx: str, arch: str = ARCH) -> ResourceUsage | None:
    """Assemble `ptx` with `ptxas -v` (if a ptxas is on PATH) and parse its report.
    Returns None when no ptxas is available."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, f"-arch={arch}", "-v", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ptxas failed:\n{out.stderr[-4000:]}")
    text = out.stdout + out.stderr

    def grab(pattern, default=0):
        m = re.search(pattern, text)
        return int(m.group(1)) if m else default

    return ResourceUsage(
        registers=grab(r"Used (\d+) registers"),
        stack_bytes=grab(r"(\d+) bytes stack frame"),
        spill_store_bytes=grab(r"(\d+) bytes spill stores"),
        spill_load_bytes=grab(r"(\d+) bytes spill loads"),
        smem_bytes=grab(r"(\d+) bytes smem"),
    )
