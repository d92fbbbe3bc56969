"""flexattn.cupy without CuPy: the import error, and the module's logic on a fake ``cupy``
namespace (numpy-backed arrays, a fake current stream, ``forward_into`` recorded and
emulated by the reference) — which stream and device helpers reach the core, what is
allocated, and that ``vjp``'s backward returns the reference gradients."""

import contextlib
import importlib
import subprocess
import sys
import types

import numpy as np
import pytest

from flexattn import mods, reference
from flexattn.core import AttentionSpec


def test_import_without_cupy_names_the_package():
    code = (
        "import sys\n"
        "sys.modules['cupy'] = None\n"
        "try:\n"
        "    import flexattn.cupy\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ImportError:" in r.stdout and "pip install cupy-cuda12x" in r.stdout, r.stdout + r.stderr


class _FakeArray(np.ndarray):
    """A numpy array posing as a CuPy one (device 0, ``get()`` to the host)."""

    device = types.SimpleNamespace(id=0)

    def get(self):
        return np.asarray(self)


def _fake_cupy():
    cp = types.ModuleType("cupy")
    cp.ndarray = _FakeArray
    cp.asarray = lambda x: np.asarray(x).view(_FakeArray)
    cp.ascontiguousarray = lambda x: np.ascontiguousarray(x).view(_FakeArray)
    cp.empty = lambda shape, dtype: np.full(shape, np.nan, dtype).view(_FakeArray)
    cp.zeros = lambda shape, dtype: np.zeros(shape, dtype).view(_FakeArray)
    stream = types.SimpleNamespace(ptr=0xC0FFEE)
    used_devices = []

    @contextlib.contextmanager
    def device(i):
        used_devices.append(i)
        yield

    current_device = [0]
    cp.cuda = types.SimpleNamespace(get_current_stream=lambda: stream, Device=device,
                                    runtime=types.SimpleNamespace(getDevice=lambda: current_device[0]))
    cp.used_devices = used_devices
    cp.current_device = current_device
    return cp


@pytest.fixture
def fake(monkeypatch):
    cp = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.delitem(sys.modules, "flexattn.cupy", raising=False)
    module = importlib.import_module("flexattn.cupy")
    calls = []

    def fake_forward_into(q, k, v, out, lse, shape, spec, device):
        calls.append(device)
        assert all(isinstance(device.to_device(x), _FakeArray) for x in (np.arange(3), q))
        assert device.to_device(np.ones((4, 4))[:, ::2]).flags.c_contiguous
        o, l = reference.forward(q, k, v, spec)
        out[...] = o
        lse[...] = l

    def fake_backward_into(arrays, shape, spec, device, alloc, deterministic=False, grad_captures=None):
        """The reference behind backward_into's contract: writes dq/dk/dv, returns fp32
        buffer gradients (0-d as [1]) allocated through ``alloc``."""
        calls.append(("bwd", device, deterministic))
        assert np.isfinite(arrays.out).all() and np.isfinite(arrays.lse).all()  # the forward's
        g = reference.backward(arrays.q, arrays.k, arrays.v, arrays.d_out, arrays.d_lse, spec, out=arrays.out)
        for dst, src in ((arrays.dq, g.dq), (arrays.dk, g.dk), (arrays.dv, g.dv)):
            dst[...] = src
        grads = []
        for c, d in zip(spec.score.captures if spec.score is not None else (), g.d_captures):
            if d is None:
                grads.append(None)
                continue
            a = alloc(tuple(np.shape(d)) or (1,), "float32", True)
            a[...] = np.reshape(d, a.shape)
            grads.append(a)
        return types.SimpleNamespace(capture_grads=tuple(grads))

    monkeypatch.setattr(module, "forward_into", fake_forward_into)
    monkeypatch.setattr(module, "prepare_forward", lambda *a, **k: None)   # no kernels here
    monkeypatch.setattr(module, "backward_into", fake_backward_into)
    yield module, cp, calls
    sys.modules.pop("flexattn.cupy", None)


def _qkv(seed=0, dtype=np.float16, D=64):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((1, 2, 20, D)) * 0.3).astype(dtype).view(_FakeArray) for _ in range(3)]


def test_forward_uses_the_current_stream_and_allocates_outputs(fake):
    fc, cp, calls = fake
    q, k, v = _qkv()
    out, lse = fc.flex_attention(q, k, v, score=mods.softcap(5.0), mask=mods.causal())
    assert [d.stream for d in calls] == [0xC0FFEE] and cp.used_devices == [0]
    assert isinstance(out, _FakeArray) and out.dtype == np.float16 and lse.dtype == np.float32
    want, want_lse = reference.forward(q, k, v, AttentionSpec.from_args(score=mods.softcap(5.0), mask=mods.causal()))
    np.testing.assert_allclose(out.astype(np.float64), want, atol=1e-3)
    np.testing.assert_allclose(lse, want_lse, atol=1e-5)


def test_vjp_backward_matches_the_reference(fake):
    fc, _, calls = fake
    q, k, v = _qkv(1)
    slopes = np.linspace(0.2, 0.6, 2).astype(np.float32)
    out, backward = fc.vjp(q, k, v, score_mod=mods.alibi(slopes), mask=mods.sliding_window(4), deterministic=True)
    d_out = np.ones(out.shape, np.float16).view(_FakeArray)
    dq, dk, dv, d_caps = backward(d_out)
    assert [(c[0], c[1].stream, c[2]) for c in calls if isinstance(c, tuple)] == [("bwd", 0xC0FFEE, True)]
    with pytest.raises(ValueError, match="d_out must have"):
        backward(d_out[:, :1])
    spec = AttentionSpec.from_args(score=mods.alibi(slopes), mask=mods.sliding_window(4))
    want = reference.backward(q, k, v, d_out, None, spec, out=out)  # delta from the saved output, as the kernels
    for got, ref in zip((dq, dk, dv), (want.dq, want.dk, want.dv)):
        assert isinstance(got, _FakeArray) and got.dtype == np.float16
        np.testing.assert_allclose(got.astype(np.float64), ref, atol=2e-3, rtol=2e-3)
    slot = next(i for i, c in enumerate(spec.score.captures) if c is slopes)
    assert d_caps[slot].dtype == np.float32
    np.testing.assert_allclose(d_caps[slot], want.d_captures[slot], rtol=1e-5, atol=1e-6)


def test_unsupported_inputs_are_clear_errors(fake):
    fc, _, calls = fake
    q, k, v = _qkv(2, dtype=np.float32, D=240)
    with pytest.raises(ValueError, match="does not fit shared memory"):
        fc.vjp(q, k, v)                      # float32 at head dim 240: the forward alone, refused before it runs
    q, k, v = _qkv(2, dtype=np.float64)
    with pytest.raises(ValueError, match="bfloat16, float16 and float32"):
        fc.flex_attention(q, k, v)
    with pytest.raises(TypeError, match="cupy.ndarray"):
        fc.flex_attention(np.zeros((1, 1, 4, 64), np.float16), *_qkv()[1:])
    assert calls == []


def test_repeated_calls_launch_the_prepared_forward_on_the_current_stream(fake, monkeypatch):
    fc, cp, calls = fake
    launches = []

    class FakePrepared:
        def __init__(self, spec):
            self.spec = spec

        def launch(self, q, k, v, out, lse, stream=None):
            launches.append(stream)
            o, l = reference.forward(q, k, v, self.spec)
            out[...] = o
            lse[...] = l

    monkeypatch.setattr(fc, "prepare_forward", lambda q, shape, spec, device: FakePrepared(spec))
    kw = dict(score=mods.softcap(4.0), mask=mods.causal())
    for i in range(4):
        q, k, v = _qkv(20 + i)
        out, lse = fc.flex_attention(q, k, v, **kw)
        want, want_lse = reference.forward(q, k, v, AttentionSpec.from_args(**kw))
        np.testing.assert_allclose(out.astype(np.float64), want, atol=1e-3)
        np.testing.assert_allclose(lse, want_lse, atol=1e-5)
    assert len(calls) == 2 and launches == [0xC0FFEE, 0xC0FFEE]   # calls 3, 4: prepared
    q, k, v = _qkv(30)
    fc.flex_attention(q, k, v, score=mods.softcap(4.0), mask=kw["mask"])   # another mod object
    assert len(calls) == 3
    cp.current_device[0] = 1           # the inputs' device is not the current one
    cp.used_devices.clear()
    out, _ = fc.flex_attention(q, k, v, **kw)
    assert len(calls) == 4 and len(launches) == 2 and cp.used_devices == [0]   # full path, on device 0
    np.testing.assert_allclose(out.astype(np.float64), reference.forward(q, k, v, AttentionSpec.from_args(**kw))[0],
                               atol=1e-3)
