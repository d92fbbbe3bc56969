"""The framework-agnostic core: numpy in, numpy out, no framework imports."""

import subprocess
import sys

import numpy as np
import pytest

import flexattn
from flexattn import mods

import naive_attention as naive


def test_core_imports_without_any_framework():
    code = (
        "import sys\n"
        "for name in ('torch', 'jax', 'cupy'):\n"
        "    sys.modules[name] = None  # any import of them now fails\n"
        "import numpy as np, flexattn\n"
        "from flexattn import mods\n"
        "x = np.random.default_rng(0).standard_normal((1, 2, 40, 8))\n"
        "m = mods.causal() & mods.document(np.repeat([0, 1], 20))\n"
        "out = flexattn.flex_attention(x, x, x, mask=m, score=mods.softcap(5.0))\n"
        "assert out.shape == x.shape and np.isfinite(out).all()\n"
        "bm = flexattn.create_block_mask(m, None, None, 40, 40, BLOCK_SIZE=8)\n"
        "print('ok', bm.sparsity())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr


def test_numpy_entry_point_matches_naive():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 4, 50, 16)).astype(np.float32) for _ in range(3))
    out, lse = flexattn.flex_attention(q, k, v, mask=mods.causal(), return_lse=True)
    assert out.dtype == np.float32 and lse.shape == (2, 4, 50)
    allowed = np.tril(np.ones((50, 50), bool))
    np.testing.assert_allclose(out, naive.numpy_attention(q, k, v, allowed), atol=1e-5)


def test_numpy_backward_entry_point():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 2, 9, 4)) for _ in range(3))
    slopes = rng.uniform(0.1, 1.0, 2)
    g = flexattn.flex_attention_backward(q, k, v, np.ones((1, 2, 9, 4)), score=mods.alibi(slopes))
    assert g.dq.shape == q.shape and g.d_captures[0].shape == (2,)
    # finite differences on one slope
    eps = 1e-6
    def loss(s):
        return flexattn.flex_attention(q, k, v, score=mods.alibi(s)).sum()
    bumped = slopes.copy(); bumped[1] += eps
    lowered = slopes.copy(); lowered[1] -= eps
    fd = (loss(bumped) - loss(lowered)) / (2 * eps)
    assert abs(fd - g.d_captures[0][1]) < 1e-6


def test_invalid_arrays_rejected_before_work():
    x = np.zeros((1, 1, 4, 4))
    with pytest.raises(TypeError, match="query must be an array"):
        flexattn.flex_attention([[1.0]], x, x)
    with pytest.raises(ValueError, match="empty dimension"):
        flexattn.flex_attention(np.zeros((1, 1, 0, 4)), x, x)


def test_keep_bounded_evicts_the_oldest_and_replaces_in_place():
    from flexattn.bounded import keep_bounded

    table = {}
    for i in range(5):
        assert keep_bounded(table, i, str(i), 3) == str(i)
    assert list(table) == [2, 3, 4]
    keep_bounded(table, 3, "again", 3)          # a key already held: replaced, nothing evicted
    assert table == {2: "2", 3: "again", 4: "4"}
