"""The one compile entry: every kernel compiled ahead of time on fake tensors (``fakes.py``),
with no GPU and no driver query.

``compile_forward(cfg, ...)`` (and ``compile_backward``, ``compile_preprocess``,
``compile_postprocess``, ``compile_decode``, ``compile_classifier``, ``compile_compactor``,
``compile_merge``)
traces the kernel on symbolic-shape fake tensors and returns a ``cute.compile`` result that
can be launched with real tensors of the same dtypes and ranks (any sizes / strides with
the last dim contiguous). The target is a compile option (``ARCH_OPTION``), so a CPU-only
machine needs no settings; PTX and CUBIN are kept on request so tests can inspect them.
``compile_kernel`` is what every compile on fakes goes through; the from_dlpack runners
(``forward.py``, ``backward.py``, ``decode.py``) compile on the very views they launch with
(``compile_on_views``).
"""

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass

from flexattn.kernels.launch import fakes
from flexattn.kernels.launch.compile_lock import COMPILING

ARCH = "sm_90a"
# Passed to every compile: it overrides CUTE_DSL_ARCH / GPU detection, so compiling works
# on a GPU-less machine whatever the environment, and never probes the driver.
ARCH_OPTION = f"--gpu-arch={ARCH}"


def compile_on_fakes(kernel, args, *, keep_ptx: bool = False, keep_cubin: bool = False,
                     extra_options: str = "", tvm_ffi: bool = False):
    """Compile ``kernel`` on fake arguments (``fakes.py``) for sm_90a.

    ``tvm_ffi``: for TVM-FFI calls — the result takes framework tensors directly (DLPack
    exchanged in C, arguments checked against the compiled signature) and runs on the
    framework's current stream; a call costs microseconds instead of the ~35 µs per tensor
    of ``from_dlpack``. ``keep_ptx`` / ``keep_cubin``: the result carries ``__ptx__`` /
    ``__cubin__`` (for tests and benchmarks/compile_time.py)."""
    opts = " ".join(o for o in (
        ARCH_OPTION, "--keep-ptx" if keep_ptx else "", "--keep-cubin" if keep_cubin else "",
        "--enable-tvm-ffi" if tvm_ffi else "", extra_options,
    ) if o)
    if not (keep_ptx or keep_cubin):
        return compile_kernel(kernel, args, opts, tvm_ffi)
    # Kept artifacts go to the DSL's dump dir (the CWD at import time) and are read back
    # into the result at once; point it at a scratch directory for this compile (a global
    # setting: held under the compile lock with the compile itself).
    with COMPILING, tempfile.TemporaryDirectory() as d, _dump_dir(d):
        return compile_kernel(kernel, args, opts, tvm_ffi)


def compile_on_views(kernel, args) -> tuple:
    """A from_dlpack runner's compile: ``cute.compile`` on the very dynamic-layout views it
    launches with (the compiled function reads its arguments in the layout it was traced
    with, and checks none of them) -> (function, seconds)."""
    import cutlass.cute as cute

    with COMPILING:
        t0 = time.perf_counter()
        with pipeline_options():
            fn = cute.compile(kernel, *args, options=ARCH_OPTION)
        return fn, time.perf_counter() - t0


# One entry per kernel; ``mod_args``: the hook's runtime args as typed stand-ins
# (``emit.mod_emit.fake_args``), whose values are irrelevant.

def compile_forward(cfg, mod_args: tuple = (), *, tvm_ffi: bool = False, **options):
    """The sm90 forward (``FlashFwdSm90``) for a ``FwdConfig``."""
    from flexattn.kernels.fwd.sm90 import FlashFwdSm90

    return compile_on_fakes(FlashFwdSm90(cfg), fakes.fake_forward_args(cfg, mod_args, tvm_ffi),
                            tvm_ffi=tvm_ffi, **options)


def compile_backward(cfg, mod_args: tuple = (), *, tvm_ffi: bool = False, **options):
    """The backward main kernel for a ``BwdConfig`` (``FlashBwdSm90``; float32:
    ``FlashBwdTf32``)."""
    from flexattn.kernels.bwd.tf32_sync import backward_kernel

    return compile_on_fakes(backward_kernel(cfg), fakes.fake_backward_args(cfg, mod_args, tvm_ffi),
                            tvm_ffi=tvm_ffi, **options)


def compile_preprocess(dtype: str, head_dim: int, with_dlse: bool = False, *, deterministic: bool = False,
                       grad_fixed: bool = False, tile_m: int = 64, head_dim_v: int | None = None,
                       dq_finish: bool = False, pdl: bool = False, dq_first_store: bool = False,
                       tvm_ffi: bool = False, **options):
    """The backward's preprocess. ``deterministic``: it also zeroes the dQ semaphores;
    ``dq_finish``: those and dQ's empty rows (the main kernel stores the rest of dQ);
    ``dq_first_store``: the semaphores (tickets), and dq_accum only in the rows whose LSE is
    -inf (the main kernel's first visit to a tile stores it);
    ``grad_fixed``: and the fixed-point buffer-gradient accumulators. ``tile_m``: the main
    kernel's (one CTA per q tile). ``head_dim_v``: O's and dO's (None: ``head_dim``).
    ``pdl``: its CTAs let the main kernel launch early (``BwdConfig.pdl``)."""
    from flexattn.kernels.bwd.preprocess import BwdPreprocess
    from flexattn.kernels.bwd.sm90 import BwdConfig

    cfg = BwdConfig(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, tile_m=tile_m,
                    deterministic=deterministic, dq_finish=dq_finish, pdl=pdl, dq_first_store=dq_first_store)
    return compile_on_fakes(BwdPreprocess(cfg), fakes.fake_preprocess_args(cfg, with_dlse, grad_fixed, tvm_ffi),
                            tvm_ffi=tvm_ffi, **options)


def compile_postprocess(dtype: str, head_dim: int, *, grad_ranks: tuple = (), tile_m: int = 64,
                        pdl: bool = False, tvm_ffi: bool = False, **options):
    """The backward's postprocess. ``grad_ranks``: deterministic mode's buffer gradients
    (their ranks) to finish; ``tile_m``: the main kernel's (it wrote dq_accum in its tiles'
    fragment order); ``pdl``: launched as the main kernel's programmatic dependent."""
    from flexattn.kernels.bwd.postprocess import postprocess_kernel
    from flexattn.kernels.bwd.sm90 import BwdConfig

    cfg = BwdConfig(dtype=dtype, head_dim=head_dim, tile_m=tile_m, pdl=pdl)
    return compile_on_fakes(postprocess_kernel(cfg), fakes.fake_postprocess_args(cfg, grad_ranks, tvm_ffi),
                            tvm_ffi=tvm_ffi, **options)


def compile_fp32_operands(cfg, *, tvm_ffi: bool = False, **options):
    """The fp32 forward's operand pass (``fp32_operands.Fp32Operands``) for an ``OperandsConfig``."""
    from flexattn.kernels.fwd.fp32_operands import Fp32Operands

    return compile_on_fakes(Fp32Operands(cfg), fakes.fake_fp32_operands_args(cfg, tvm_ffi), tvm_ffi=tvm_ffi, **options)


def compile_decode(cfg, mod_args: tuple = (), *, tvm_ffi: bool = False, **options):
    """The split-KV decode kernel (``DecodeSm90``) for a ``DecodeConfig``."""
    from flexattn.kernels.decode.sm90 import DecodeSm90

    return compile_on_fakes(DecodeSm90(cfg), fakes.fake_decode_args(cfg, mod_args, tvm_ffi),
                            tvm_ffi=tvm_ffi, **options)


def compile_merge(dtype: str, head_dim_v: int, *, acc_dtype: str = "fp32", tvm_ffi: bool = False, **options):
    """The log-sum-exp merge of a partial result (``merge.partial.MergePartial``) into an
    fp32 accumulator, or (``acc_dtype`` = ``dtype``) into the result's own rows."""
    from flexattn.kernels.merge.partial import MergePartial

    kernel = MergePartial(dtype, head_dim_v, acc_dtype)
    return compile_on_fakes(kernel, fakes.fake_merge_args(kernel.dtype, head_dim_v, tvm_ffi, kernel.acc_dtype),
                            tvm_ffi=tvm_ffi, **options)


def compile_classifier(hook, q_block: int, kv_block: int, count_allowed: bool = False, *,
                       tvm_ffi: bool = False, **options):
    """The block-mask tile classifier of a mask hook (``BlockClassifierSm90``)."""
    from flexattn.kernels.blockmask.classify import BlockClassifierSm90
    from flexattn.kernels.emit.mod_emit import fake_args

    return compile_on_fakes(BlockClassifierSm90(hook, q_block, kv_block, count_allowed),
                            fakes.fake_classifier_args(fake_args(hook), count_allowed, tvm_ffi),
                            tvm_ffi=tvm_ffi, **options)


def compile_compactor(*, tvm_ffi: bool = False, full_as_partial: bool = False, **options):
    """The block-mask list compaction (``BlockListCompactor``)."""
    from flexattn.kernels.blockmask.compact import BlockListCompactor

    return compile_on_fakes(BlockListCompactor(full_as_partial), fakes.fake_compactor_args(tvm_ffi), tvm_ffi=tvm_ffi,
                            **options)


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

    with COMPILING, pipeline_options(), _no_pyir_auto_load():
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
    # ptxas's "wgmma.mma_async instructions are serialized" (C7510-C7515, with its reason):
    # every wgmma then waits for the one before, whatever the kernel's commit groups say.
    wgmma_serialized: str | None = None


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
        wgmma_serialized=(m.group(1) if (m := re.search(r"(\(C75\d\d\)[^\n]*wgmma[^\n]*serialized[^\n']*)", text))
                          else None),
    )
