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
from flexattn.kernels.launch.fwd_ffi_runner import FfiForwardRunner  # noqa: E402
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
        fn(q, q, q, q, lse, 0.1, (30.0, 1 / 30.0), None)
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
        runner.compiled(q, q, q, q, torch.zeros(2, 4, 300), 0.1, (30.0, 1 / 30.0), None)
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

    from flexattn.kernels.blockmask.classify import compile_compactor
    from flexattn.kernels.launch.compile_bwd import compile_postprocess

    for key, compile, n_args in ((("test_compact",), lambda: compile_compactor(True), 3),
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
