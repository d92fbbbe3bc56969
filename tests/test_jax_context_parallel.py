"""flexattn.jax.context_parallel under shard_map on 2 and 4 CPU devices against one call:
outputs, LSE and gradients (q, k, v and a trainable bias) for causal, documents, a window,
ALiBi and a relative bias (each world in a fresh process: the device count is fixed when
jax starts)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax")

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("world", [2, 4])
def test_shard_map_ring_matches_one_call(world):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={world}", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, os.path.join(HERE, "jax_cp_check.py"), str(world)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    errors = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(errors) == {"causal", "documents", "window", "alibi+causal", "bias+causal"} | (
        {"causal/eager"} if world == 2 else set())
    for case, errs in errors.items():
        for what, err in zip(("out", "lse", "dq", "dk", "dv", "d_bias"), errs):
            assert err < 2e-5, f"{case} {what}: relative error {err:.3g}"


def test_errors_before_anything_runs():
    import jax.numpy as jnp

    from flexattn.core.context_parallel import head_tail
    from flexattn.jax import context_parallel as cp

    layout = head_tail(64, 2)
    q = jnp.zeros((1, 2, 32, 16))
    with pytest.raises(TypeError, match="ShardLayout"):
        cp.flex_attention(q, q, q, layout=None, axis_name="cp")
    with pytest.raises(ValueError, match="shard"):
        cp.flex_attention(q[:, :, :16], q, q, layout=layout, axis_name="cp")
