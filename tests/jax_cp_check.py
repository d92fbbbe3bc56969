"""Run by tests/test_jax_context_parallel.py in a fresh process with N CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=N`` must precede importing jax):
flexattn.jax.context_parallel under shard_map against one flexattn.jax call, forward and
gradients (q, k, v, a trainable relative bias), for each mask, under jax.jit (and the causal
case eagerly too on 2 devices); prints the largest error of each as JSON."""

import json
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import flexattn.jax as fj
from flexattn import mods
from flexattn.core.context_parallel import choose_layout, head_tail
from flexattn.jax import context_parallel as cp


def main(world: int):
    B, H, HK, S, D = 1, 4, 2, 256, 16
    rng = np.random.default_rng(world)
    q, k, v, d_out = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                      for s in ((B, H, S, D), (B, HK, S, D), (B, HK, S, D), (B, H, S, D)))
    bias = jnp.asarray(rng.standard_normal(2 * S + 1) * 0.5, jnp.float32)
    doc = jnp.asarray(np.repeat(np.arange(4), [100, 50, 70, 36]), jnp.int32)
    cases = {
        "causal": (lambda b, h, qi, ki: qi >= ki, False),
        "documents": (lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (qi >= ki), False),
        "window": (lambda b, h, qi, ki: abs(qi - ki) <= 40, False),
        "alibi+causal": (lambda b, h, qi, ki: qi >= ki, "alibi"),
        "bias+causal": (lambda b, h, qi, ki: qi >= ki, "bias"),
    }
    mesh = jax.make_mesh((world,), ("cp",))
    errors = {}
    for name, (mask, scored) in cases.items():
        layout = head_tail(S, world) if name != "window" else choose_layout(S, world, None)

        def score_for(bias):
            if scored == "bias":
                return lambda s, b, h, qi, ki: s + bias[qi - ki + S]
            return mods.alibi(H) if scored == "alibi" else None

        def whole(q, k, v, bias):
            out, lse = fj.flex_attention(q, k, v, score_mod=score_for(bias), mask=mask, enable_gqa=True,
                                         return_lse=True)
            return jnp.sum(out * d_out) + 0.5 * jnp.sum(lse), (out, lse)

        @partial(jax.shard_map, mesh=mesh, in_specs=(P(None, None, "cp"),) * 4 + (P(),),
                 out_specs=(P(), (P(None, None, "cp"), P(None, None, "cp"))))
        def sharded_loss(q, k, v, d_local, bias):
            out, lse = cp.flex_attention(q, k, v, score_for(bias), mask=mask, enable_gqa=True, return_lse=True,
                                         layout=layout, axis_name="cp")
            loss = jax.lax.psum(jnp.sum(out * d_local) + 0.5 * jnp.sum(lse), "cp")
            return loss, (out, lse)

        def sharded(q, k, v, bias):
            on_mesh = NamedSharding(mesh, P(None, None, "cp"))
            return sharded_loss(*(jax.reshard(cp.shard(x, layout), on_mesh) for x in (q, k, v, d_out)), bias)

        (_, (out, lse)), grads = jax.value_and_grad(whole, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, bias)
        step = jax.value_and_grad(sharded, argnums=(0, 1, 2, 3), has_aux=True)
        # Under jit, as models run it (eager shard_map dispatches the ring op by op: ~20x slower
        # on CPU); one case also eagerly, on 2 devices.
        runs = {name: jax.jit(step)} | ({name + "/eager": step} if world == 2 and name == "causal" else {})
        back = np.argsort(layout.order())     # (the outputs are sharded over the mesh: back to one host array)
        want = [out, lse] + list(grads)
        for run_name, run in runs.items():
            with jax.set_mesh(mesh):
                (_, (s_out, s_lse)), s_grads = run(q, k, v, bias)
            got = [np.take(np.asarray(s_out), back, axis=2), np.take(np.asarray(s_lse), back, axis=2)] + [
                np.asarray(g) for g in s_grads]
            errors[run_name] = [float(np.max(np.abs(a - np.asarray(b))) / (np.max(np.abs(np.asarray(b))) + 1e-6))
                                for a, b in zip(got, want)]
    print(json.dumps(errors))


if __name__ == "__main__":
    main(int(sys.argv[1]))
