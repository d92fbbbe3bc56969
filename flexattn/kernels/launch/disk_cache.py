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
``~/.cache/flexattn/kernels``; ``FLEXATTN_DISK_CACHE=0`` turns it off (reading and
writing, the trusted directories below included).

*Trust.* A cache entry is native code JIT-linked into this process, so whoever can write
a cache file or directory can run code in every process that loads from it. The user's
cache is therefore private: every directory level this module creates is made 0700, every
file 0600 (``mkstemp``'s mode, kept through the rename). Before an entry is loaded, the
cache root (followed if it is a symlink: ``~/.cache`` may live on another disk), the
environment directory under it and the file must each be owned by the current user
(``os.geteuid()``) and not writable by group or others (``st_mode & 0o022 == 0``); the
directory below the root and the file are opened with ``O_NOFOLLOW`` (a symlink is
refused), each next one relative to the last one's descriptor, the checks are ``fstat``s
of the opened descriptors, the file must be a regular file, and its bytes are read from
that descriptor and linked from it (``/proc/self/fd/N``), so what was checked is what
runs. An entry failing any of this is not loaded and nothing is stored into a directory
that fails it: one warning per directory naming the path and the fix, then the kernel is
compiled (a bad *file* in a good directory is replaced by the freshly compiled one).
Caches written by earlier versions (0755 / 0644) pass: readable by others, writable by no
one else. The root's own parent directories are not checked.

*Sharing* is read-only and explicit: ``$FLEXATTN_TRUSTED_CACHE_DIRS`` lists (``os.pathsep``
separated) cache roots with the same layout that the user trusts — say one filled at image
build time by running with ``FLEXATTN_CACHE_DIR`` pointing there, then
``chown -R root: DIR && chmod -R a+rX,go-w DIR``. They are looked up, in order, after the
user's own cache misses, under the same rules except that the owner may be the user or
root (uid 0); they are never written to, and a bad entry there is skipped (one warning),
not deleted. A kernel found in none is compiled and stored in the user's cache only.

*Integrity.* A file is written under a temporary name in its directory, synced, then
renamed into place (atomic: a reader sees a whole file or none; processes storing the same
kernel at once write equivalent files and the last rename wins). After the object bytes
come the TVM-FFI function's name and the sha256 of both (ELF readers ignore trailing
bytes), checked before loading: this detects torn or corrupted files — it is a checksum,
not a signature (anyone who can write the file can write a matching one), so it is no
defence against a planted file; the ownership and mode checks above are. A file in the
user's cache that fails the check or does not load is deleted and the kernel compiled
again. A directory that cannot be written turns storing off for the process (one
warning). Nothing here raises into a launch: any failure falls back to compiling.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import platform
import stat
import sys
import tempfile
import warnings

from flexattn.kernels.launch.compile_lock import COMPILING

FORMAT = "flexattn-kernel-cache-2"   # bump when the file layout or key rendering changes
_TRAILER_TAG = b"\n#flexattn-sha256:"
_TRAILER_LEN = len(_TRAILER_TAG) + 64 + 1
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # .../flexattn
_SOURCE_DIRS = ("kernels", "mods")   # what emits kernel code (kernels import nothing else of ours)

_directory: str | None = None       # environment()'s directory name, once per process
_modules: frozenset | None = None   # module names whose code the directory name digests
_unwritable: set = set()             # directories that refused a write (warned once each)
_untrusted: set = set()              # directories warned about as unsafe to load from (once each)
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


def trusted_roots() -> list:
    """``$FLEXATTN_TRUSTED_CACHE_DIRS`` (``os.pathsep`` separated): read-only cache roots the
    user trusts (owned by the user or root, writable by no one else), after the user's own."""
    own = cache_root()
    found = []
    for part in os.environ.get("FLEXATTN_TRUSTED_CACHE_DIRS", "").split(os.pathsep):
        if part.strip():
            root = os.path.abspath(os.path.expanduser(part.strip()))
            if root != own and root not in found:
                found.append(root)
    return found


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
    """``compile()``'s TVM-FFI function — or the same kernel loaded from disk: the user's
    cache first, then each trusted read-only root. ``key``: everything the kernel's code
    depends on besides ``environment()`` (None: no disk cache). One load or compile at a
    time in the process (``compile_lock``)."""
    with COMPILING:
        return _load_or_compile(key, compile)


def _load_or_compile(key, compile):
    global _loads
    where = location(key) if key is not None and enabled() else None
    if where is None:
        return compile()
    directory, path, _ = where
    sub, filename = os.path.basename(directory), os.path.basename(path)
    fn = _load(os.path.dirname(directory), sub, filename, private=True)
    for root in trusted_roots() if fn is None else ():
        fn = _load(root, sub, filename, private=False)
        if fn is not None:
            break
    if fn is not None:
        _loads += 1
        return fn
    fn = compile()
    _store(fn, *where)
    return fn


# ---- trust -------------------------------------------------------------------------------

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)   # a planted FIFO must not block the open


class _Untrusted(Exception):
    """A cache path that must not be loaded from (or written to): (path, why, fix, the
    directory it is or is in: the unit warned about once)."""


def _owners(private: bool) -> set:
    """Who may own what we load: the user; for a trusted read-only root, root too."""
    uid = os.geteuid()
    return {uid} if private else {uid, 0}


def _check(fd: int, path: str, owners: set, regular: bool) -> None:
    """Raise _Untrusted unless the opened ``fd`` is owned by one of ``owners``, writable by
    no group or other user, and (``regular``) a regular file."""
    st = os.fstat(fd)
    kind = "file" if regular else "directory"
    unit = os.path.dirname(path) if regular else path
    if regular and not stat.S_ISREG(st.st_mode):
        raise _Untrusted(path, "is not a regular file", f"delete it (rm {path})", os.path.dirname(path))
    if st.st_uid not in owners:
        who = "you" if len(owners) == 1 else "you or root"
        raise _Untrusted(path, f"is owned by uid {st.st_uid}, not by {who} (uid {os.geteuid()})",
                         f"delete it (rm -r {path})", unit)
    if st.st_mode & 0o022:
        fix = f"chmod {'600' if regular else '700'} {path}" if st.st_uid == os.geteuid() else f"chmod go-w {path}"
        raise _Untrusted(path, f"is a {kind} writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})",
                         fix, unit)


def _open(name: str, flags: int, dir_fd: int | None, path: str, regular: bool) -> int | None:
    """os.open, None when absent; below the root (``dir_fd``), a symlink (``O_NOFOLLOW``) or
    non-directory raises _Untrusted."""
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if dir_fd is not None and e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            raise _Untrusted(path, "is a symbolic link" + ("" if regular else " or not a directory"),
                             f"delete it (rm {path})", os.path.dirname(path) if regular else path) from None
        raise


def _open_chain(root: str, sub: str, filename: str | None, owners: set) -> list:
    """Open ``root``, ``root/sub`` (and ``root/sub/filename``), each checked (``_check``)
    and each relative to the last one's descriptor; the open descriptors (the caller closes
    them), fewer where a level is absent. Raises _Untrusted, or OSError where unreadable."""
    fds = []
    try:
        levels = [(root, _DIR_FLAGS, root), (sub, _DIR_FLAGS | _NOFOLLOW, os.path.join(root, sub))]
        if filename is not None:
            levels.append((filename, os.O_RDONLY | os.O_CLOEXEC | _NOFOLLOW | _NONBLOCK,
                           os.path.join(root, sub, filename)))
        for i, (name, flags, path) in enumerate(levels):
            fd = _open(name, flags, fds[-1] if fds else None, path, regular=i == 2)
            if fd is None:
                break
            fds.append(fd)
            _check(fd, path, owners, regular=i == 2)
        return fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _warn_untrusted(err: _Untrusted, private: bool) -> None:
    path, why, fix, directory = err.args
    if directory in _untrusted:
        return
    _untrusted.add(directory)
    where = "the kernel disk cache" if private else "the trusted kernel cache (FLEXATTN_TRUSTED_CACHE_DIRS)"
    then = " (and storing nothing there)" if private and directory == path else ""
    warnings.warn(f"flexattn: not loading compiled kernels from {where}: {path} {why}; whoever can write "
                  f"there could run code in this process. Compiling instead{then}. "
                  f"Fix: {fix}, or point FLEXATTN_CACHE_DIR at a directory of your own "
                  "(FLEXATTN_DISK_CACHE=0 turns the cache off)", RuntimeWarning, stacklevel=3)


def _read(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _fd_path(fd: int, path: str) -> str:
    """A path that opens the very file behind ``fd`` (Linux), so the file whose owner, mode
    and checksum were checked is the one linked even if ``path`` changes meanwhile."""
    proc = f"/proc/self/fd/{fd}"
    return proc if os.path.exists(proc) else path


_NAME_TAG = b"\n#flexattn-function:"


def _name_record(name: str) -> bytes:
    """The TVM-FFI function's name, after the object bytes: the object CuTeDSL built while
    compiling keeps its own (``__tvm_ffi_<name>``), an exported one the name we gave it."""
    return _NAME_TAG + name.encode() + b"\n"


def _trailer(payload: bytes) -> bytes:
    return _TRAILER_TAG + hashlib.sha256(payload).hexdigest().encode() + b"\n"


def _load(root: str, sub: str, filename: str, private: bool):
    """The function in ``root/sub/filename``, or None: absent, untrusted (warned once per
    directory), failing the checksum or not loading (warned; deleted in the user's own cache,
    left in place in a trusted read-only one)."""
    path = os.path.join(root, sub, filename)
    try:
        fds = _open_chain(root, sub, filename, _owners(private))
    except _Untrusted as e:
        _warn_untrusted(e, private)
        return None
    except OSError:   # unreadable
        return None
    try:
        if len(fds) < 3:   # absent (the usual miss)
            return None
        try:
            data = _read(fds[2])
        except OSError:
            return None
        payload = data[:-_TRAILER_LEN]
        if len(data) <= _TRAILER_LEN or data[-_TRAILER_LEN:] != _trailer(payload):
            return _discard(path, "checksum mismatch", private)
        at = payload.rfind(_NAME_TAG)
        if at < 0 or not payload.endswith(b"\n"):
            return _discard(path, "no function name", private)
        name = payload[at + len(_NAME_TAG):-1].decode(errors="replace")
        try:
            from cutlass.cute.runtime import load_module

            return getattr(load_module(_fd_path(fds[2], path), enable_tvm_ffi=True), name)
        except Exception as e:  # noqa: BLE001  (a bad file must never fail the launch)
            return _discard(path, f"{type(e).__name__}: {e}", private)
    finally:
        for fd in fds:
            os.close(fd)


def _discard(path: str, why: str, private: bool = True) -> None:
    if not private:   # a trusted read-only cache is never written to: skip the entry
        if path not in _untrusted:
            _untrusted.add(path)
            warnings.warn(f"flexattn: skipping unusable kernel {path} in a trusted read-only cache "
                          f"({why[:200]}); compiling", RuntimeWarning, stacklevel=2)
        return None
    warnings.warn(f"flexattn: discarding unusable cached kernel {path} ({why[:200]}); recompiling",
                  RuntimeWarning, stacklevel=2)
    try:
        os.unlink(path)
    except OSError:
        pass
    return None


def _make_private_dirs(directory: str) -> None:
    """Create ``directory`` and any missing parents, each 0700 (``os.makedirs`` gives the
    parents the umask's mode). An existing directory is left as it is (and checked later)."""
    missing = []
    at = directory
    while not os.path.isdir(at):
        missing.append(at)
        parent = os.path.dirname(at)
        if parent == at:
            break
        at = parent
    for at in reversed(missing):
        try:
            os.mkdir(at, 0o700)   # the umask can only narrow it
        except FileExistsError:
            pass                  # made meanwhile (by another process): checked like any other


def _store(fn, directory: str, path: str, name: str) -> None:
    global _stores, _export_warned
    if directory in _unwritable:
        return
    tmp = None
    try:
        _make_private_dirs(directory)
        try:   # only into a directory no one else can write (as the loader will check)
            for fd in _open_chain(os.path.dirname(directory), os.path.basename(directory), None, _owners(True)):
                os.close(fd)
        except _Untrusted as e:
            _warn_untrusted(e, True)
            return
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".o")   # 0600; export reads the suffix
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
            os.fchmod(f.fileno(), 0o600)   # mkstemp's mode, in case the export re-created the file
            f.flush()
            os.fsync(f.fileno())   # a crash after the rename must not leave a torn file
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
