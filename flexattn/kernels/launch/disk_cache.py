"""Compiled TVM-FFI kernels on disk: a new process loads in milliseconds what took seconds to compile.

``cache.py`` keeps one runner per kernel configuration in memory; a runner that has to
compile a TVM-FFI kernel (the forward, the backward's three, decode, the block-mask
builder's two) asks ``compiled(key, compile)`` here first. The kernel is kept as a
relocatable object file — the one CuTeDSL built while compiling (captured by
``compile.compile_kernel``: storing then costs a file write), else its AOT export
(``export_to_c``, ~0.3 s on the CI CPU) — which
``cutlass.cute.runtime.load_module`` JIT-links back in memory (no system linker) as a
``tvm_ffi.Function``: the compiled function's positional signature (the call sites pass
every argument positionally, None for absent ones; the stream is TVM-FFI's environment
stream, read inside the function in both cases).

*Key.* A file's name is the sha256 of the kernel's key — its kind, its config (class,
every dataclass field, ``key()``), the mods by structure key and capture kinds. Its
directory's name is the sha256 of everything else that changes the generated code: the
cutlass-dsl / tvm-ffi versions, CuTeDSL's compile-affecting settings, the target arch and
machine, and the contents of our kernel and mod-language sources (``flexattn/kernels``,
``flexattn/mods``), so editing a kernel starts a new directory. Keys are rendered
canonically (``render``: no ``id()``, no ``hash()`` — salted per process —, sets sorted);
a key part of any other type, or a hook class whose code is not ours (not digested),
means no disk cache for that kernel.

*Where.* ``$FLEXATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/flexattn/kernels``, else
``~/.cache/flexattn/kernels``; ``FLEXATTN_DISK_CACHE=0`` turns it off.

*Safety.* A file is written under a temporary name in its directory, synced, then renamed
into place (atomic: a reader sees a whole file or none; processes storing the same kernel
at once write equivalent files and the last rename wins). After the object bytes come the
TVM-FFI function's name and the sha256 of both (ELF readers ignore trailing bytes),
checked before loading: a file that
fails the check or does not load is deleted and the kernel compiled again. A directory
that cannot be written turns storing off for the process (one warning). Nothing here
raises into a launch: any failure falls back to compiling.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import sys
import tempfile
import warnings

FORMAT = "flexattn-kernel-cache-2"   # bump when the file layout or key rendering changes
_TRAILER_TAG = b"\n#flexattn-sha256:"
_TRAILER_LEN = len(_TRAILER_TAG) + 64 + 1
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # .../flexattn
_SOURCE_DIRS = ("kernels", "mods")   # what emits kernel code (kernels import nothing else of ours)

_directory: str | None = None       # environment()'s directory name, once per process
_modules: frozenset | None = None   # module names whose code the directory name digests
_unwritable: set = set()             # directories that refused a write (warned once each)
_export_warned = False               # export failures are warned about once per process
_loads = 0
_stores = 0


def load_count() -> int:
    """Kernels this process loaded from disk instead of compiling."""
    return _loads


def store_count() -> int:
    """Kernels this process compiled and wrote to disk."""
    return _stores


def enabled() -> bool:
    return os.environ.get("FLEXATTN_DISK_CACHE", "1").strip().lower() not in ("0", "false", "off", "no")


def cache_root() -> str:
    """``$FLEXATTN_CACHE_DIR``, else the user's cache directory (XDG) + ``flexattn/kernels``."""
    explicit = os.environ.get("FLEXATTN_CACHE_DIR")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "flexattn", "kernels")


# ---- keys --------------------------------------------------------------------------------

class Unrenderable(TypeError):
    """A key part with no canonical rendering (its repr could hold an address)."""


def render(x) -> str:
    """A canonical text of a key made of None, bool, int, float, str, bytes, tuples / lists
    (named tuples keep their class name), sets and dicts: equal keys render equally in every
    process."""
    if x is None or isinstance(x, (bool, int, float, str, bytes)):
        return f"{type(x).__name__}:{x!r}"   # type names keep 1, 1.0 and True apart
    if isinstance(x, (tuple, list)):
        return f"{type(x).__name__}(" + ",".join(render(v) for v in x) + ")"
    if isinstance(x, (set, frozenset)):
        return f"{type(x).__name__}{{" + ",".join(sorted(render(v) for v in x)) + "}"
    if isinstance(x, dict):
        return "dict{" + ",".join(sorted(f"{render(k)}:{render(v)}" for k, v in x.items())) + "}"
    raise Unrenderable(f"no canonical rendering for {type(x).__qualname__}")


def hook_key(hook) -> tuple | None:
    """A mod hook's part of a key: its class, ``key()`` and the kinds of its runtime args;
    None for hook classes defined outside the digested sources (their code could change
    without changing the cache directory)."""
    if type(hook).__module__ not in our_modules():
        return None
    from flexattn.kernels.emit.mod_emit import IRModHook, capture_kinds

    kinds = capture_kinds(hook) if isinstance(hook, IRModHook) else ()
    return (type(hook).__qualname__, hook.key(), kinds)


def config_key(kind: str, cfg) -> tuple | None:
    """The key of the ``kind`` kernel of a config dataclass (FwdConfig, BwdConfig,
    DecodeConfig): every field (the hook by ``hook_key``) and ``key()``; None where the
    hook is not ours."""
    hook = hook_key(cfg.mods)
    if hook is None:
        return None
    fields = tuple((f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.name != "mods")
    return (kind, type(cfg).__qualname__, fields, cfg.key(), hook)


def _sources(root: str = _PACKAGE, dirs: tuple = _SOURCE_DIRS) -> list:
    """[(relative path, module name)] of every ``*.py`` file under ``root/<dir>``, in
    subpackages too (a kernel moved into a subfolder must still change the digest), sorted."""
    found = []
    for d in dirs:
        for folder, subdirs, names in os.walk(os.path.join(root, d)):
            subdirs[:] = sorted(s for s in subdirs if s != "__pycache__")
            package = os.path.relpath(folder, root).replace(os.sep, "/")
            for name in sorted(names):
                if name.endswith(".py"):
                    module = "flexattn." + package.replace("/", ".") + ("" if name == "__init__.py" else "." + name[:-3])
                    found.append((f"{package}/{name}", module))
    return sorted(found)


def source_digest(root: str = _PACKAGE, dirs: tuple = _SOURCE_DIRS) -> str:
    """sha256 of the names and contents of our kernel and mod-language sources."""
    h = hashlib.sha256()
    for rel, _ in _sources(root, dirs):
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        h.update(f"{rel}:{len(data)}:".encode())
        h.update(data)
    return h.hexdigest()


def our_modules() -> frozenset:
    """Names of the modules ``source_digest`` covers."""
    global _modules
    if _modules is None:
        _modules = frozenset(module for _, module in _sources())
    return _modules


def _versions() -> tuple:
    from importlib import metadata

    found = []
    for name in ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
                 "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13", "apache-tvm-ffi"):
        try:
            found.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            pass
    import cutlass
    import tvm_ffi

    # The modules' own versions too: an unpacked (not pip-installed) package has no metadata.
    return tuple(found) + (("cutlass", getattr(cutlass, "__version__", None)),
                           ("tvm_ffi", getattr(tvm_ffi, "__version__", None)))


def environment() -> tuple:
    """Everything besides the kernel's own key that decides the generated code."""
    from cutlass.cutlass_dsl import CuTeDSL

    from flexattn.kernels.launch.compile import ARCH_OPTION

    settings = CuTeDSL._get_dsl().envar.cache_key_str()   # CuTeDSL's compile-affecting settings
    return (FORMAT, ARCH_OPTION, sys.platform, platform.machine(), _versions(), settings, source_digest())


def directory_name() -> str:
    """The cache directory of this environment (computed once per process)."""
    global _directory
    if _directory is None:
        from flexattn.kernels.launch.compile import ARCH

        _directory = f"{ARCH}-{hashlib.sha256(render(environment()).encode()).hexdigest()[:32]}"
    return _directory


def location(key: tuple) -> tuple | None:
    """(directory, file path, exported function name) of ``key``; None when the key has no
    canonical rendering."""
    try:
        digest = hashlib.sha256(render(key).encode()).hexdigest()
    except Unrenderable:
        return None
    directory = os.path.join(cache_root(), directory_name())
    return directory, os.path.join(directory, digest + ".o"), "flexattn_" + digest[:32]


# ---- load / store ------------------------------------------------------------------------

def compiled(key: tuple | None, compile):
    """``compile()``'s TVM-FFI function — or the same kernel loaded from disk. ``key``:
    everything the kernel's code depends on besides ``environment()`` (None: no disk cache)."""
    global _loads
    where = location(key) if key is not None and enabled() else None
    if where is None:
        return compile()
    fn = _load(*where[1:])
    if fn is not None:
        _loads += 1
        return fn
    fn = compile()
    _store(fn, *where)
    return fn


_NAME_TAG = b"\n#flexattn-function:"


def _name_record(name: str) -> bytes:
    """The TVM-FFI function's name, after the object bytes: the object CuTeDSL built while
    compiling keeps its own (``__tvm_ffi_<name>``), an exported one the name we gave it."""
    return _NAME_TAG + name.encode() + b"\n"


def _trailer(payload: bytes) -> bytes:
    return _TRAILER_TAG + hashlib.sha256(payload).hexdigest().encode() + b"\n"


def _load(path: str, name: str):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:   # absent (the usual miss) or unreadable
        return None
    payload = data[:-_TRAILER_LEN]
    if len(data) <= _TRAILER_LEN or data[-_TRAILER_LEN:] != _trailer(payload):
        return _discard(path, "checksum mismatch")
    at = payload.rfind(_NAME_TAG)
    if at < 0 or not payload.endswith(b"\n"):
        return _discard(path, "no function name")
    name = payload[at + len(_NAME_TAG):-1].decode(errors="replace")
    try:
        from cutlass.cute.runtime import load_module

        return getattr(load_module(path, enable_tvm_ffi=True), name)
    except Exception as e:  # noqa: BLE001  (a bad file must never fail the launch)
        return _discard(path, f"{type(e).__name__}: {e}")


def _discard(path: str, why: str) -> None:
    warnings.warn(f"flexattn: discarding unusable cached kernel {path} ({why[:200]}); recompiling",
                  RuntimeWarning, stacklevel=2)
    try:
        os.unlink(path)
    except OSError:
        pass
    return None


def _store(fn, directory: str, path: str, name: str) -> None:
    global _stores, _export_warned
    if directory in _unwritable:
        return
    tmp = None
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".o")   # export reads the suffix
        os.close(fd)
        built = getattr(fn, "flexattn_object", None)   # compile.compile_kernel kept it
        if built is not None:
            payload, name = built
            with open(tmp, "wb") as f:
                f.write(payload)
        else:
            fn.export_to_c(tmp, function_name=name)
            with open(tmp, "rb") as f:
                payload = f.read()
        with open(tmp, "ab") as f:
            f.write(_name_record(name) + _trailer(payload + _name_record(name)))
            f.flush()
            os.fsync(f.fileno())   # a crash after the rename must not leave a torn file
        os.chmod(tmp, 0o644)       # mkstemp's 0600 would hide a shared cache from its other users
        os.replace(tmp, path)
        tmp = None
        _stores += 1
    except OSError as e:
        _unwritable.add(directory)
        warnings.warn(f"flexattn: cannot write the kernel disk cache in {directory} ({e}); compiled "
                      "kernels stay in memory (FLEXATTN_CACHE_DIR moves the cache, FLEXATTN_DISK_CACHE=0 "
                      "turns it off)", RuntimeWarning, stacklevel=2)
    except Exception as e:  # noqa: BLE001  (an export failure costs the cache entry, not the call)
        if not _export_warned:
            _export_warned = True
            warnings.warn(f"flexattn: could not export a compiled kernel to {path} ({type(e).__name__}: "
                          f"{str(e)[:200]}); it stays in memory", RuntimeWarning, stacklevel=2)
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
