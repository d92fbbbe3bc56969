"""The on-disk kernel cache (flexattn/kernels/launch/disk_cache.py), on CPU.

One small TVM-FFI forward is compiled on fake tensors and stored once per module; fresh
processes (other hash seeds) load it with ``cute.compile`` made to raise, and the loaded
function checks its arguments like the compiled one (same signature, same arity). Keys:
what changes the code changes them, captured values do not. Corrupt files are recompiled,
the cache can be turned off, and an unwritable directory costs nothing but a warning.
Every cache directory here is a temporary one.
"""

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

pytest.importorskip("tvm_ffi")

import torch  # noqa: E402

from flexattn import mods  # noqa: E402
from flexattn.kernels.launch import cache
from flexattn.kernels.launch import disk_cache  # noqa: E402
from flexattn.kernels.bwd.sm90 import BwdConfig  # noqa: E402
from flexattn.kernels.decode.sm90 import DecodeConfig  # noqa: E402
from flexattn.kernels.launch.forward import FfiForwardRunner  # noqa: E402
from flexattn.kernels.fwd.sm90 import FwdConfig  # noqa: E402
from flexattn.kernels.emit.mod_emit import IRModHook  # noqa: E402
from flexattn.kernels.emit.mod_hook import ModHook  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(score=None, mask=None, **kw):
    return FwdConfig(dtype="bf16", head_dim=64, mods=IRModHook(score, mask), **kw)


def _base():
    return _config(mods.softcap(30.0), mods.causal())


def _path(cfg):
    return disk_cache.location(disk_cache.config_key("fwd", cfg))[1]


def _cpu_call_error(fn) -> str:
    """Calling with CPU tensors fails the compiled signature's device check: its message
    names every parameter, so it shows the function's arity and argument types."""
    q = torch.zeros(2, 4, 300, 64, dtype=torch.bfloat16)
    lse = torch.zeros(2, 4, 300)
    with pytest.raises(ValueError, match="expected device_type=cuda") as err:
        fn(q, q, q, q, lse, 0.1, (30.0, 1 / 30.0), None, None)
    return str(err.value)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """(cache dir, runner) after compiling and storing the base forward."""
    root = str(tmp_path_factory.mktemp("kernels"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLEXATTN_CACHE_DIR", root)
        mp.delenv("FLEXATTN_DISK_CACHE", raising=False)
        stores = disk_cache.store_count()
        runner = FfiForwardRunner(_base())
        runner.compile()
        assert disk_cache.store_count() == stores + 1
        assert os.path.isfile(_path(_base()))
        yield root, runner


@pytest.fixture
def cache_dir(stored, monkeypatch):
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", stored[0])
    monkeypatch.delenv("FLEXATTN_DISK_CACHE", raising=False)
    return stored[0]


_FRESH_PROCESS = textwrap.dedent("""
    import json

    import cutlass.cute as cute
    import numpy as np

    def refuse(*args, **kwargs):
        raise AssertionError("compiled instead of loading")

    cute.compile = refuse
    import torch
    from flexattn import mods
    from flexattn.kernels.launch import cache
    from flexattn.kernels.launch import disk_cache
    from flexattn.kernels.fwd.sm90 import FwdConfig
    from flexattn.kernels.emit.mod_emit import IRModHook

    cfg = FwdConfig(dtype="bf16", head_dim=64, mods=IRModHook(mods.softcap(30.0), mods.causal()))
    runner = cache.forward_runner(cfg, tvm_ffi=True)
    runner.compile()
    q = torch.zeros(2, 4, 300, 64, dtype=torch.bfloat16)
    try:
        runner.compiled(q, q, q, q, torch.zeros(2, 4, 300), 0.1, (30.0, 1 / 30.0), None, None)
        error = None
    except ValueError as e:
        error = str(e)
    others = [FwdConfig(dtype="fp16", head_dim=128, mods=IRModHook(mods.alibi(num_heads=4),
                                                                   mods.sliding_window(8) & mods.document(np.zeros(9, "int32")))),
              FwdConfig(mods=IRModHook(None, mods.causal()), block_sparse=True)]
    print(json.dumps(dict(
        loads=disk_cache.load_count(), count=cache.compile_count(), type=type(runner.compiled).__module__,
        error=error, paths=[disk_cache.location(disk_cache.config_key("fwd", c))[1] for c in [cfg] + others])))
""")


def _others():
    return [FwdConfig(dtype="fp16", head_dim=128, mods=IRModHook(mods.alibi(num_heads=4),
                                                                   mods.sliding_window(8) & mods.document(np.zeros(9, "int32")))),
            FwdConfig(mods=IRModHook(None, mods.causal()), block_sparse=True)]


def test_fresh_processes_load_the_kernel_without_compiling(stored, cache_dir):
    """Two new processes with other hash seeds find the kernel by the same key and load it
    (``cute.compile`` raises there); the loaded function has the compiled signature."""
    root, runner = stored
    env = dict(os.environ, FLEXATTN_CACHE_DIR=root, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    results = []
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], env=dict(env, PYTHONHASHSEED=seed),
                             capture_output=True, text=True, cwd=REPO, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    want_paths = [_path(c) for c in [_base()] + _others()]
    for r in results:
        assert r["loads"] == 1 and r["count"] == 1  # a load counts where a compile would have
        assert r["type"].startswith("tvm_ffi")
        assert r["paths"] == want_paths, "keys differ between processes"
        assert r["error"] == _cpu_call_error(runner.compiled), "loaded and compiled signatures differ"
    assert len(set(want_paths)) == 3


def test_memory_cache_stays_in_front(cache_dir, monkeypatch):
    runner = cache.forward_runner(_base(), tvm_ffi=True)
    runner.compile()   # compiled or loaded: from now on held in memory
    monkeypatch.setattr(disk_cache, "compiled", lambda *a: pytest.fail("memory hit reached the disk cache"))
    assert cache.forward_runner(_base(), tvm_ffi=True) is runner
    runner.compile()
    assert runner.compiled is not None


def test_loaded_in_process(cache_dir):
    loads = disk_cache.load_count()
    fn = disk_cache.compiled(disk_cache.config_key("fwd", _base()), lambda: pytest.fail("compiled"))
    assert disk_cache.load_count() == loads + 1
    _cpu_call_error(fn)


def test_keys_follow_the_code_not_the_values(cache_dir):
    base = _path(_base())
    # Captured values never enter the key.
    assert _path(_config(mods.softcap(3.0), mods.causal())) == base
    assert (_path(_config(None, mods.sliding_window(5) & mods.document(np.zeros(7, "int64"))))
            == _path(_config(None, mods.sliding_window(900) & mods.document(np.arange(70)))))
    # Structure, dtypes, tiles, schedule and emission options do.
    changed = [
        _config(mods.alibi(num_heads=4), mods.causal()),
        _config(mods.softcap(30.0), mods.sliding_window(4)),
        _config(mods.softcap(30.0), None),
        _config(None, mods.document(np.zeros(7, "int32"))),
        _config(None, mods.document(np.zeros(7, "int64"))),
        FwdConfig(dtype="fp16", head_dim=64, mods=IRModHook(mods.softcap(30.0), mods.causal())),
        _config(mods.softcap(30.0), mods.causal(), tile_n=64),
        _config(mods.softcap(30.0), mods.causal(), max_ctas=132),
        FwdConfig(dtype="bf16", head_dim=64, mods=IRModHook(mods.softcap(30.0), mods.causal(), fast_math=False)),
    ]
    paths = [_path(c) for c in changed]
    assert base not in paths and len(set(paths)) == len(paths)
    # The other kernels' keys render too, each kind apart.
    hook = IRModHook(mods.alibi(num_heads=4), mods.causal())
    others = [disk_cache.location(k)[1] for k in (
        disk_cache.config_key("bwd_main", BwdConfig(head_dim=64, mods=hook)),
        disk_cache.config_key("bwd_main", BwdConfig(head_dim=64, mods=hook.with_grad_filter(()))),
        disk_cache.config_key("decode", DecodeConfig(head_dim=64, mods=hook)),
        ("blockmask_classifier", disk_cache.hook_key(IRModHook(None, mods.causal())), 128, 128, False),
    )]
    assert len(set(others)) == 4 and base not in others


def _copy_sources(dest):
    """Copy the digested source trees (``kernels``, ``mods``, subpackages included) under ``dest``."""
    import shutil

    for d in disk_cache._SOURCE_DIRS:
        shutil.copytree(os.path.join(disk_cache._PACKAGE, d), dest / d,
                        ignore=shutil.ignore_patterns("__pycache__"))


def test_source_digest_covers_nested_kernel_files(tmp_path):
    """Kernels live in subpackages (kernels/fwd, kernels/hopper, ...): an edit, an added file
    or a move inside one must change the digest, or stale kernels would load from disk."""
    _copy_sources(tmp_path)
    base = disk_cache.source_digest(str(tmp_path))
    rels = [rel for rel, _ in disk_cache._sources(str(tmp_path))]
    assert "kernels/fwd/sm90.py" in rels and "kernels/launch/disk_cache.py" in rels
    assert any(rel.count("/") >= 2 for rel in rels)
    modules = dict(disk_cache._sources(str(tmp_path)))
    assert modules["kernels/emit/mod_emit.py"] == "flexattn.kernels.emit.mod_emit"
    assert modules["kernels/fwd/__init__.py"] == "flexattn.kernels.fwd"

    nested = tmp_path / "kernels" / "fwd" / "sm90.py"
    nested.write_bytes(nested.read_bytes() + b"# edited\n")
    edited = disk_cache.source_digest(str(tmp_path))
    assert edited != base

    os.rename(nested, tmp_path / "kernels" / "bwd" / "sm90_moved.py")   # a move alone changes it too
    assert disk_cache.source_digest(str(tmp_path)) not in (base, edited)
    (tmp_path / "kernels" / "decode" / "extra.py").write_text("X = 1\n")
    moved = disk_cache.source_digest(str(tmp_path))
    (tmp_path / "kernels" / "decode" / "extra.py").unlink()
    assert disk_cache.source_digest(str(tmp_path)) != moved


def test_sources_versions_and_settings_name_the_directory(cache_dir, tmp_path, monkeypatch):
    base = _path(_base())
    _copy_sources(tmp_path)   # an edited copy of our sources digests differently
    assert disk_cache.source_digest(str(tmp_path)) == disk_cache.source_digest()
    with open(tmp_path / "kernels" / "hopper" / "softmax.py", "a") as f:
        f.write("# edited\n")
    edited = disk_cache.source_digest(str(tmp_path))
    assert edited != disk_cache.source_digest()

    def moved(**patches):
        with monkeypatch.context() as mp:
            mp.setattr(disk_cache, "_directory", None)
            for name, value in patches.items():
                mp.setattr(disk_cache, name, value)
            path = _path(_base())
        assert os.path.basename(path) == os.path.basename(base)   # same kernel key ...
        return os.path.dirname(path)                                # ... other directory

    assert moved() == os.path.dirname(base)
    others = {moved(source_digest=lambda: edited),
              moved(_versions=lambda: (("nvidia-cutlass-dsl", "0.0.0"),)),
              moved(FORMAT="other")}
    assert os.path.dirname(base) not in others and len(others) == 3
    from cutlass.cutlass_dsl import CuTeDSL

    with monkeypatch.context() as mp:   # a CuTeDSL setting that changes the code (CUTE_DSL_LINEINFO)
        mp.setattr(CuTeDSL._get_dsl().envar, "lineinfo", True)
        assert moved() not in others | {os.path.dirname(base)}


def test_foreign_hooks_and_unrenderable_keys_skip_the_disk(cache_dir):
    class MyHook(ModHook):   # defined outside our digested sources: its code is not in the key
        pass

    assert disk_cache.config_key("fwd", FwdConfig(mods=MyHook())) is None
    assert disk_cache.config_key("bwd_main", BwdConfig()) is not None   # no mods: ours
    with pytest.raises(disk_cache.Unrenderable):
        disk_cache.render(("x", object()))
    assert disk_cache.location(("x", object())) is None
    calls = []
    assert disk_cache.compiled(("x", object()), lambda: calls.append(1) or "fn") == "fn" and calls == [1]
    assert disk_cache.compiled(None, lambda: "fn") == "fn"


def _recompiles(runner, key):
    """compiled(key) with a compile that hands back the runner's function, counting calls."""
    calls = []
    fn = disk_cache.compiled(key, lambda: calls.append(1) or runner.compiled)
    return len(calls), fn


@pytest.mark.parametrize("damage", ["flipped", "truncated", "garbage", "empty"])
def test_corrupt_files_are_replaced(stored, cache_dir, damage):
    _, runner = stored
    key = disk_cache.config_key("fwd", _base())
    path = disk_cache.location(key)[1]
    with open(path, "rb") as f:
        good = f.read()
    bad = {"flipped": good[:2000] + bytes(64) + good[2064:], "truncated": good[: len(good) // 2],
           "garbage": bytes(range(256)) * 20, "empty": b""}[damage]
    with open(path, "wb") as f:
        f.write(bad)
    with pytest.warns(RuntimeWarning, match="discarding unusable cached kernel"):
        calls, fn = _recompiles(runner, key)
    assert calls == 1 and fn is runner.compiled
    calls, fn = _recompiles(runner, key)   # the fresh copy loads
    assert calls == 0
    _cpu_call_error(fn)


def test_a_file_that_does_not_load_is_replaced(stored, cache_dir):
    """A well-formed file without the exported function (e.g. a name clash): deleted, recompiled."""
    _, runner = stored
    key = disk_cache.config_key("fwd", _base())
    directory, path, name = disk_cache.location(key)
    runner.compiled.export_to_c(path, function_name="another_name")
    with open(path, "rb") as f:
        payload = f.read()
    record = disk_cache._name_record("not_in_this_object")   # checksummed, but names nothing there
    with open(path, "ab") as f:
        f.write(record + disk_cache._trailer(payload + record))
    with pytest.warns(RuntimeWarning, match="discarding"):
        calls, _ = _recompiles(runner, key)
    assert calls == 1
    assert _recompiles(runner, key)[0] == 0


def test_stores_the_object_built_while_compiling(stored):
    """compile.compile_kernel keeps the object file CuTeDSL built and linked (no second
    export); the file names that object's own TVM-FFI function."""
    _, runner = stored
    obj, name = runner.compiled.flexattn_object
    with open(_path(_base()), "rb") as f:
        data = f.read()
    assert data.startswith(obj) and disk_cache._name_record(name) in data[len(obj):]


def test_exported_objects_round_trip(cache_dir, monkeypatch):
    """Without a captured object (another CuTeDSL code path) the function is exported
    under the key's name, and that file loads too."""
    from flexattn.kernels.launch import compile as compile_module

    @contextlib.contextmanager
    def nothing_captured():
        yield []

    monkeypatch.setattr(compile_module, "_captured_objects", nothing_captured)
    cfg = _config(None, mods.sliding_window(16))
    key = disk_cache.config_key("fwd", cfg)
    runner = FfiForwardRunner(cfg)
    stores = disk_cache.store_count()
    runner.compile()
    assert disk_cache.store_count() == stores + 1          # compiled and exported here
    assert not hasattr(runner.compiled, "flexattn_object")
    loads = disk_cache.load_count()
    fn = disk_cache.compiled(key, lambda: pytest.fail("compiled"))
    assert disk_cache.load_count() == loads + 1
    _cpu_call_error(fn)


def test_disabled_by_environment(stored, tmp_path, monkeypatch):
    _, runner = stored
    key = disk_cache.config_key("fwd", _base())
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", stored[0])
    monkeypatch.setenv("FLEXATTN_DISK_CACHE", "0")
    assert _recompiles(runner, key)[0] == 1   # the stored copy is not read
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(tmp_path))
    assert _recompiles(runner, key)[0] == 1
    assert os.listdir(tmp_path) == []          # nor anything written


def test_unwritable_directory_falls_back_to_memory(stored, tmp_path, monkeypatch):
    _, runner = stored
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(blocker / "kernels"))
    monkeypatch.delenv("FLEXATTN_DISK_CACHE", raising=False)
    key = disk_cache.config_key("fwd", _base())
    with pytest.warns(RuntimeWarning, match="cannot write the kernel disk cache"):
        assert _recompiles(runner, key) == (1, runner.compiled)
    with warnings.catch_warnings():
        warnings.simplefilter("error")         # warned once: the next store is skipped quietly
        assert _recompiles(runner, disk_cache.config_key("fwd", _config(None, mods.causal())))[0] == 1


def test_export_failures_leave_kernels_in_memory(cache_dir, monkeypatch):
    """A function that cannot be exported (another CuTeDSL, say) is returned as compiled;
    one warning per process, no file left behind."""
    monkeypatch.setattr(disk_cache, "_export_warned", False)

    class Unexportable:
        def export_to_c(self, path, function_name):
            raise NotImplementedError("no AOT export here")

    fn = Unexportable()
    with pytest.warns(RuntimeWarning, match="could not export"):
        assert disk_cache.compiled(("test_unexportable", 1), lambda: fn) is fn
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert disk_cache.compiled(("test_unexportable", 2), lambda: fn) is fn
    directory = disk_cache.location(("test_unexportable", 1))[0]
    assert not [n for n in os.listdir(directory) if n.startswith(".tmp-")]
    assert not os.path.exists(disk_cache.location(("test_unexportable", 1))[1])


def test_location_respects_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("FLEXATTN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert disk_cache.cache_root() == os.path.join(str(tmp_path), "flexattn", "kernels")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert disk_cache.cache_root() == os.path.join(str(tmp_path), "home", ".cache", "flexattn", "kernels")
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", "~/elsewhere")
    assert disk_cache.cache_root() == os.path.join(str(tmp_path), "home", "elsewhere")


def test_other_kernels_round_trip(cache_dir):
    """Not only the forward: the block-list compaction and the backward's postprocess
    export and load the same way (arity checked by calling with the wrong count)."""
    import tvm_ffi

    from flexattn.kernels.launch.compile import compile_compactor, compile_postprocess

    for key, compile, n_args in ((("test_compact",), lambda: compile_compactor(tvm_ffi=True), 3),
                                 (("test_post",), lambda: compile_postprocess("bf16", 64, tvm_ffi=True), 5)):
        compiled = disk_cache.compiled(key, compile)
        loaded = disk_cache.compiled(key, lambda: pytest.fail("compiled twice"))
        assert type(loaded).__module__.startswith("tvm_ffi")
        messages = []
        # (the compiled function wraps the positional tvm_ffi.Function in a Python kwargs wrapper)
        raw = compiled if isinstance(compiled, tvm_ffi.Function) else compiled.__tvm_ffi_object__()
        for fn in (raw, loaded):
            with pytest.raises(TypeError, match=f"Expects {n_args} parameters") as err:
                fn(*([None] * (n_args + 1)))
            messages.append(str(err.value))
        assert messages[0] == messages[1]


# ---- trust: a private cache, refused entries, read-only shared caches --------------------
# A cache entry is native code linked into the process: these plant a *valid* entry (the
# stored base forward, which would load) where it must not be trusted, and check that it is
# neither linked (``load_module`` is recorded) nor counted as a load, but compiled instead.

def _entry_name():
    return os.path.join(disk_cache.directory_name(), os.path.basename(_path(_base())))


def _valid_entry(stored):
    with open(os.path.join(stored[0], _entry_name()), "rb") as f:
        return f.read()


def _plant(root, data, root_mode=0o700, env_mode=0o700, file_mode=0o600):
    """``data`` as the base forward's entry under cache root ``root``, with these modes."""
    path = os.path.join(str(root), _entry_name())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, file_mode)
    os.chmod(os.path.dirname(path), env_mode)
    os.chmod(root, root_mode)
    return path


def _snapshot(root):
    """Every path under ``root`` with its mode, owner, mtime and size (lstat)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(folder, name))
            found[os.path.relpath(os.path.join(folder, name), root)] = (st.st_mode, st.st_uid, st.st_mtime_ns, st.st_size)
    return found


@pytest.fixture
def linked(monkeypatch):
    """The paths ``cutlass.cute.runtime.load_module`` is asked to link (it still links them)."""
    from cutlass.cute import runtime

    calls, real = [], runtime.load_module

    def recording(path, **kwargs):
        calls.append(path)
        return real(path, **kwargs)

    monkeypatch.setattr(runtime, "load_module", recording)
    return calls


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A fresh, not yet existing cache root as FLEXATTN_CACHE_DIR, no trusted roots."""
    root = tmp_path / "kernels"
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(root))
    monkeypatch.delenv("FLEXATTN_DISK_CACHE", raising=False)
    monkeypatch.delenv("FLEXATTN_TRUSTED_CACHE_DIRS", raising=False)
    return root


def _refused(runner, key, match, replaced=False):
    """compiled(key) warns once (``match``), compiles, and loads nothing; again: no warning,
    and compiled again — or (``replaced``: a bad file in the user's own good directory,
    overwritten by the compiled kernel) loaded."""
    loads = disk_cache.load_count()
    with pytest.warns(RuntimeWarning, match=match) as record:
        assert _recompiles(runner, key) == (1, runner.compiled)
    refusals = [str(w.message) for w in record if "not loading compiled kernels" in str(w.message)]
    assert len(refusals) == 1, refusals
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # warned once per directory
        assert _recompiles(runner, key)[0] == (0 if replaced else 1)
    assert disk_cache.load_count() == loads + replaced
    return refusals[0]


def test_the_cache_is_private(stored, tmp_path, monkeypatch, linked):
    """Every directory level the cache creates is 0700 and its files 0600, whatever the
    umask (0 here: the umask's 0777 / 0666 would be world-writable)."""
    _, runner = stored
    root = tmp_path / "home" / "cache" / "kernels"
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(root))
    monkeypatch.delenv("FLEXATTN_DISK_CACHE", raising=False)
    key = disk_cache.config_key("fwd", _base())
    old = os.umask(0)
    try:
        stores = disk_cache.store_count()
        assert _recompiles(runner, key)[0] == 1
        assert disk_cache.store_count() == stores + 1
    finally:
        os.umask(old)
    env = root / disk_cache.directory_name()
    for d in (tmp_path / "home", tmp_path / "home" / "cache", root, env):
        assert oct(os.stat(d).st_mode & 0o7777) == oct(0o700), d
    assert [oct(os.stat(env / n).st_mode & 0o7777) for n in os.listdir(env)] == [oct(0o600)]
    calls, fn = _recompiles(runner, key)   # and it loads, linked from the checked descriptor
    assert calls == 0 and len(linked) == 1
    assert linked[0].startswith("/proc/self/fd/") or not os.path.isdir("/proc/self/fd")
    _cpu_call_error(fn)


@pytest.mark.parametrize("level,mode", [("root", 0o777), ("root", 0o1777), ("root", 0o770),
                                        ("environment", 0o775), ("environment", 0o757)])
def test_planted_entry_in_an_open_directory_is_not_loaded(stored, own_cache, linked, level, mode):
    """A valid entry in a cache directory others can write to (a world-writable root, a
    sticky /tmp-like one, a group-writable level) is not linked: one warning naming the
    directory and the fix, the kernel compiled, and nothing stored there either."""
    _, runner = stored
    modes = dict(root_mode=mode) if level == "root" else dict(env_mode=mode)
    path = _plant(own_cache, _valid_entry(stored), **modes)
    before = _snapshot(own_cache)
    key = disk_cache.config_key("fwd", _base())
    message = _refused(runner, key, "writable by group or others")
    bad = str(own_cache) if level == "root" else os.path.dirname(path)
    assert f"{bad} is a directory writable" in message and f"chmod 700 {bad}" in message
    assert linked == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # another kernel: compiled, not stored, no second warning
        assert _recompiles(runner, ("test_open_directory", level, mode))[0] == 1
    assert _snapshot(own_cache) == before


@pytest.mark.parametrize("mode", [0o666, 0o620, 0o602])
def test_entry_writable_by_others_is_refused_and_replaced(stored, own_cache, linked, mode):
    _, runner = stored
    path = _plant(own_cache, _valid_entry(stored), file_mode=mode)
    key = disk_cache.config_key("fwd", _base())
    loads = disk_cache.load_count()
    with pytest.warns(RuntimeWarning, match=f"{path} is a file writable by group or others .*chmod 600"):
        assert _recompiles(runner, key) == (1, runner.compiled)
    assert linked == [] and disk_cache.load_count() == loads
    # The directory is the user's own: the compiled kernel replaced the entry, privately.
    assert oct(os.lstat(path).st_mode & 0o7777) == oct(0o600)
    assert _recompiles(runner, key)[0] == 0 and len(linked) == 1


@pytest.mark.parametrize("kind", ["file symlink", "directory symlink", "fifo"])
def test_symlinks_and_special_files_are_refused(stored, own_cache, tmp_path, linked, kind):
    """An entry (or the environment directory) that is a symlink — even to a valid, private
    file of the user's — or a FIFO (which must not block the open) is not loaded."""
    _, runner = stored
    key = disk_cache.config_key("fwd", _base())
    path = os.path.join(str(own_cache), _entry_name())
    elsewhere = tmp_path / "elsewhere"
    target = _plant(elsewhere, _valid_entry(stored))
    os.makedirs(own_cache, mode=0o700)
    if kind == "directory symlink":
        os.symlink(os.path.dirname(target), os.path.dirname(path))
    else:
        os.makedirs(os.path.dirname(path), mode=0o700)
        os.symlink(target, path) if kind == "file symlink" else os.mkfifo(path, 0o600)
    outside = _snapshot(elsewhere)
    replaced = kind != "directory symlink"   # a bad entry in a good directory: overwritten
    message = _refused(runner, key, "is a symbolic link" if "symlink" in kind else "is not a regular file",
                       replaced=replaced)
    assert (path if replaced else os.path.dirname(path)) in message
    assert len(linked) == replaced and _snapshot(elsewhere) == outside   # the link's target untouched
    if replaced:   # by a regular file of ours, which then loaded
        assert os.path.isfile(path) and not os.path.islink(path)
        assert oct(os.lstat(path).st_mode & 0o7777) == oct(0o600)


@pytest.mark.parametrize("how", ["file chowned", "process uid"])
def test_entries_owned_by_another_user_are_refused(stored, own_cache, linked, monkeypatch, how):
    """A file owned by someone else (chowned: needs root, as the tests run), or the whole cache
    seen from another uid (``os.geteuid`` patched), is not loaded."""
    _, runner = stored
    path = _plant(own_cache, _valid_entry(stored))
    me = os.geteuid()
    other = me + 54321
    if how == "file chowned":
        if me != 0:
            pytest.skip("chown needs root")
        os.chown(path, other, -1)
        bad = path
    else:
        monkeypatch.setattr(os, "geteuid", lambda: other)
        bad = str(own_cache)
    before = _snapshot(own_cache)
    key = disk_cache.config_key("fwd", _base())
    replaced = how == "file chowned"   # a stranger's file in the user's own directory
    message = _refused(runner, key, f"is owned by uid ({me}|{other}), not by you", replaced=replaced)
    assert f"{bad} is owned by uid" in message
    assert len(linked) == replaced
    if replaced:
        assert os.stat(path).st_uid == me
    else:   # the whole tree is someone else's: nothing stored there
        assert _snapshot(own_cache) == before


def test_trusted_read_only_cache(stored, own_cache, tmp_path, monkeypatch, linked):
    """FLEXATTN_TRUSTED_CACHE_DIRS: an image-built cache (0755 / 0644) is read after the
    user's own misses, and never written: misses go to the user's cache, bad entries stay."""
    _, runner = stored
    image = tmp_path / "image-cache"
    path = _plant(image, _valid_entry(stored), root_mode=0o755, env_mode=0o755, file_mode=0o644)
    monkeypatch.setenv("FLEXATTN_TRUSTED_CACHE_DIRS", os.pathsep.join([str(tmp_path / "absent"), "", str(image)]))
    before = _snapshot(image)
    key = disk_cache.config_key("fwd", _base())
    loads = disk_cache.load_count()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        calls, fn = _recompiles(runner, key)
    assert calls == 0 and disk_cache.load_count() == loads + 1 and len(linked) == 1
    _cpu_call_error(fn)
    assert not os.path.exists(own_cache)   # loading writes nothing anywhere
    # A miss everywhere is compiled and stored in the user's cache only.
    miss = ("test_trusted_miss",)
    assert _recompiles(runner, miss)[0] == 1
    assert os.path.isfile(disk_cache.location(miss)[1]) and str(own_cache) in disk_cache.location(miss)[1]
    assert _snapshot(image) == before
    # The user's own cache comes first: its entry is the one linked.
    own = _plant(own_cache, _valid_entry(stored))
    assert _recompiles(runner, key)[0] == 0
    os.unlink(own)
    # A corrupt trusted entry is skipped (warned once), not deleted or rewritten.
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(b"\0" * 64)
    before = _snapshot(image)
    with pytest.warns(RuntimeWarning, match="skipping unusable kernel .* trusted read-only cache"):
        assert _recompiles(runner, key)[0] == 1
    assert _snapshot(image) == before
    # FLEXATTN_DISK_CACHE=0 turns the trusted roots off too.
    monkeypatch.setenv("FLEXATTN_DISK_CACHE", "0")
    n = len(linked)
    assert _recompiles(runner, ("test_trusted_off",))[0] == 1 and len(linked) == n


def test_trusted_cache_must_not_be_writable_by_others(stored, own_cache, tmp_path, monkeypatch, linked):
    _, runner = stored
    image = tmp_path / "image-cache"
    _plant(image, _valid_entry(stored), root_mode=0o755, env_mode=0o777, file_mode=0o644)
    monkeypatch.setenv("FLEXATTN_TRUSTED_CACHE_DIRS", str(image))
    before = _snapshot(image)
    key = disk_cache.config_key("fwd", _base())   # compiled, stored in the user's cache, loaded from there
    message = _refused(runner, key, "FLEXATTN_TRUSTED_CACHE_DIRS", replaced=True)
    assert "writable by group or others" in message and len(linked) == 1   # the user's copy
    assert _snapshot(image) == before and os.path.isfile(_path(_base()))


def test_trusted_cache_may_be_owned_by_root(stored, own_cache, tmp_path, monkeypatch, linked):
    """Owned by root is trusted in a trusted root, not in the user's own cache."""
    if os.geteuid() != 0:
        pytest.skip("needs files owned by root")
    _, runner = stored
    key = disk_cache.config_key("fwd", _base())
    image = tmp_path / "image-cache"
    _plant(image, _valid_entry(stored), root_mode=0o755, env_mode=0o755, file_mode=0o644)
    monkeypatch.setattr(os, "geteuid", lambda: 54321)   # a user who is not root
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(image))
    assert "is owned by uid 0, not by you" in _refused(runner, key, "owned by uid 0")
    assert linked == []
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(own_cache))
    monkeypatch.setenv("FLEXATTN_TRUSTED_CACHE_DIRS", str(image))
    assert _recompiles(runner, key)[0] == 0 and len(linked) == 1


def test_compiles_and_loads_take_turns_across_threads(monkeypatch):
    """Every compile entry (on fakes, on views, a mod evaluator's, a disk-cache load or
    compile) holds the one process-wide compile lock: CuTeDSL's compile is not thread-safe,
    and ranks as threads compiled at once crashed a process (compile_lock.py)."""
    import threading
    import time

    import cutlass.cute as cute

    from flexattn.kernels.launch import compile as compile_mod

    inside, most = [0], [0]
    count = threading.Lock()

    def slow_compile(kernel, *args, options=""):
        with count:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.03)
        with count:
            inside[0] -= 1
        return kernel

    monkeypatch.setattr(cute, "compile", slow_compile)
    entries = [lambda: compile_mod.compile_kernel("k", (), "", False),
               lambda: compile_mod.compile_on_views("k", ()),
               lambda: disk_cache.compiled(None, lambda: slow_compile("k"))]
    threads = [threading.Thread(target=entry) for entry in entries * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1, f"{most[0]} compiles ran at once"


def test_threads_that_miss_a_kernel_at_once_compile_it_once():
    """``compile_lock.once``: every runner's and builder's in-memory cache — threads that
    find no kernel at the same moment make it once; the others wait and take it."""
    import threading
    import time

    from flexattn.kernels.launch.compile_lock import once

    cache, made = {}, []

    def make():
        made.append(1)
        time.sleep(0.05)
        return object()

    got = []
    threads = [threading.Thread(target=lambda: got.append(once(cache, "k", make))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and len(got) == 6 and all(g is got[0] for g in got)
