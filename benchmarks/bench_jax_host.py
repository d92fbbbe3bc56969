"""Host time of a jitted flexattn.jax call, and how much of it is our Python.

For each adapter module (default: flexattn.jax; pass another module with the same API, e.g.
an older copy, to compare in one process) and variant, after warm-up (compiles, caches):

  pipelined  µs per call of a loop of N jitted calls, one block_until_ready at the end
             (jax dispatches asynchronously: host time, as long as the GPU keeps up)
  blocking   µs per call waiting for each result (dispatch + launch + kernel + sync)
  ours       Python frames of flexattn executed per steady-state call, in any thread
             (sys.setprofile; threading.setprofile_all_threads where Python has it)

beside jax's own floor on this host: a jitted ``x + 1`` on q.

    python3 benchmarks/bench_jax_host.py [--modules flexattn.jax other.module] [--variants full causal+alibi]
        [--shape 1x128x4x64] [--calls 200]
"""

import argparse
import datetime
import importlib
import math
import os
import sys
import threading
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def variant_kwargs(variant, H, S):
    from flexattn import create_block_mask, mods

    if variant == "causal":
        return {"mask": mods.causal()}
    if variant == "causal+alibi":
        return {"mask": mods.causal(), "score_mod": mods.alibi(jnp.asarray(np.exp2(-np.arange(1, H + 1.0)), jnp.float32))}
    if variant == "window64":
        return {"block_mask": create_block_mask(mods.sliding_window(64), None, None, S, S)}
    return {}


def timed(fn, calls, rounds, block_each):
    best = math.inf
    for _ in range(rounds):
        t0 = time.perf_counter()
        if block_each:
            for _ in range(calls):
                fn().block_until_ready()
        else:
            for _ in range(calls):
                r = fn()
            r.block_until_ready()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def our_frames(fn, calls):
    """flexattn Python frames entered per call (every thread the profiler reaches)."""
    root = os.path.dirname(importlib.import_module("flexattn").__file__)
    count = [0]

    def prof(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            count[0] += 1

    set_all = getattr(threading, "setprofile_all_threads", None)
    (set_all or threading.setprofile)(prof)
    sys.setprofile(prof)
    try:
        for _ in range(calls):
            fn().block_until_ready()
    finally:
        sys.setprofile(None)
        (set_all or threading.setprofile)(None)
    return count[0] / calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modules", nargs="+", default=["flexattn.jax"])
    ap.add_argument("--variants", nargs="+", default=["full", "causal", "causal+alibi", "window64"])
    ap.add_argument("--shape", default="1x128x4x64", help="BxSxHxD")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    B, S, H, D = map(int, args.shape.split("x"))
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((B, H, S, D)), args.dtype) for _ in range(3))
    floor = jax.jit(lambda x: x + 1)
    rows = [("jax floor (jit x+1)", "-", timed(lambda: floor(q), args.calls, args.rounds, False),
             timed(lambda: floor(q), args.calls, args.rounds, True), "-")]
    for name in args.modules:
        mod = importlib.import_module(name)
        for variant in args.variants:
            try:
                kw = variant_kwargs(variant, H, S)
                f = jax.jit(lambda q, k, v, kw=kw: mod.flex_attention(q, k, v, **kw))
                call = lambda f=f: f(q, k, v)  # noqa: E731
                for _ in range(3):
                    call().block_until_ready()
                rows.append((name, variant, timed(call, args.calls, args.rounds, False),
                             timed(call, args.calls, args.rounds, True), f"{our_frames(call, 50):.1f}"))
            except Exception as e:  # one failure must not hide the rest
                print(f"[{name} {variant}] failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            print(rows[-1], flush=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\nHost µs per jitted call, B{B} S{S} H{H} D{D} {args.dtype}, {jax.devices()[0].device_kind}, "
          f"jax {jax.__version__}, best of {args.rounds} × {args.calls}, {stamp}\n")
    print("| module | variant | pipelined µs | blocking µs | flexattn frames/call |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]} |")


if __name__ == "__main__":
    main()
