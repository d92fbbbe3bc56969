"""Host time per call (launch overhead) on small shapes, per adapter, beside the anchors.

The kernel of a small shape finishes in a few µs, so what a caller waits for is the host
work of a call: argument checks, planning, allocation, the launch. Measured as the wall
time of a loop of N calls that only submits work (the GPU queue never fills: N is small
and each kernel is shorter than the host time), after warm-up (compiles, caches).

  flexattn/torch   flexattn.torch.flex_attention (inference: no autograd recording)
  flexattn/cupy    flexattn.cupy.flex_attention on the same data through DLPack
  flexattn/jax     flexattn.jax.flex_attention in a jax.jit function, same data through DLPack;
                   each call waits for its result (block_until_ready): jax dispatches
                   asynchronously and the launch runs later in XLA's thread
  jax x+1          a jitted ``x + 1`` in the same blocking loop: jax's own floor (first row)
  fa4              flash_attn.cute.flash_attn_func
  flex             torch flex_attention, torch.compile'd (Triton)
  sdpa             torch scaled_dot_product_attention (its default backend choice)

    python3 benchmarks/bench_overhead.py [--shape 1x128x4x64] [--calls 200] [--out overhead.json]

``--train``: host time per *training step* instead (the call, then ``torch.autograd.grad`` of
q, k, v: forward and backward kernels, autograd's bookkeeping), for the torch-side columns.
"""

import argparse
import datetime
import math
import time
import traceback

import torch

from common import device_name, report
from results_log import RECORD_HELP, append_rows, host_rows

VARIANTS = ("full", "causal", "causal+alibi", "window64")


def warm_up(fn) -> None:
    for _ in range(3):   # compiles, caches, the prepared entry
        fn()
    torch.cuda.synchronize()


def loop_us(fn, calls: int) -> tuple[float, float]:
    """(wall, cpu) mean µs per call of one submit-only loop of ``calls`` calls, as wall time
    and as the calling thread's CPU time (``time.thread_time``). The device's host is
    shared: wall time also counts the moments our thread is descheduled; CPU time counts
    only the work a call does on the host (interference through shared caches remains)."""
    c0, t0 = time.thread_time(), time.perf_counter()
    for _ in range(calls):
        fn()
    t1, c1 = time.perf_counter(), time.thread_time()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6, (c1 - c0) / calls * 1e6


def best_of_interleaved(fns: dict, calls: int, rounds: int) -> dict:
    """Best-of-rounds (wall, cpu) per entry of ``fns``. Each round times every entry once,
    so a burst of load on the shared host falls on all entries alike instead of on the
    ones measured while it lasted (run-to-run spreads of 1.5-2x were seen that way)."""
    best = {name: (math.inf, math.inf) for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            wall, cpu = loop_us(fn, calls)
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    return best


def host_us(fn, calls: int, rounds: int = 5) -> float:
    """Best-of-rounds wall µs per call of a submit-only loop of ``fn`` alone (profile_host.py,
    profile_gpt_fast.py)."""
    return best_of_interleaved({"fn": fn}, calls, rounds)["fn"][0]


def our_kwargs(variant, H, S):
    """flexattn's arguments for a variant (the same mod and block-mask objects every call,
    as a steady-state caller would pass them)."""
    from flexattn import create_block_mask, mods

    if variant == "causal":
        return {"mask": mods.causal()}
    if variant == "causal+alibi":
        return {"mask": mods.causal(), "score_mod": mods.alibi(num_heads=H)}
    if variant == "window64":
        return {"block_mask": create_block_mask(mods.sliding_window(64), None, None, S, S)}
    return {}


def ours_torch(qh, kh, vh, variant, S):
    import flexattn.torch as fa

    kw = our_kwargs(variant, qh.shape[1], S)
    return lambda: fa.flex_attention(qh, kh, vh, **kw)


def ours_cupy(qh, kh, vh, variant, S):
    import cupy

    import flexattn.cupy as fc

    if qh.dtype != torch.float16:
        return None
    q, k, v = (cupy.from_dlpack(t) for t in (qh, kh, vh))
    kw = our_kwargs(variant, qh.shape[1], S)
    return lambda: fc.flex_attention(q, k, v, **kw)


def ours_jax(qh, kh, vh, variant, S):
    import os

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave torch its memory
    import jax
    import jax.dlpack

    import flexattn.jax as fj

    q, k, v = (jax.dlpack.from_dlpack(t) for t in (qh, kh, vh))
    kw = our_kwargs(variant, qh.shape[1], S)
    f = jax.jit(lambda q, k, v: fj.flex_attention(q, k, v, **kw))
    return lambda: f(q, k, v).block_until_ready()


def jax_floor(qh, kh, vh, variant, S):
    """jax's own cost of a blocking jitted call (a jitted ``x + 1`` on q): the floor under
    the flexattn/jax column. Once, in the first row."""
    if variant != VARIANTS[0]:
        return None
    import jax
    import jax.dlpack

    q = jax.dlpack.from_dlpack(qh)
    f = jax.jit(lambda x: x + 1)
    return lambda: f(q).block_until_ready()


def fa4(q, k, v, variant, S):
    from flash_attn.cute import flash_attn_func

    if variant == "causal+alibi":
        return None
    kw = {"causal": variant != "full"}
    if variant == "window64":
        kw["window_size"] = (64, 0)
    return lambda: flash_attn_func(q, k, v, **kw)


def flex(qh, kh, vh, variant, S):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    fn = torch.compile(flex_attention, dynamic=False)
    H = qh.shape[1]
    masks = {"causal": lambda b, h, q, kv: q >= kv, "causal+alibi": lambda b, h, q, kv: q >= kv,
             "window64": lambda b, h, q, kv: (q >= kv) & (q - kv <= 64)}
    bm = create_block_mask(masks[variant], None, None, S, S, device="cuda") if variant in masks else None
    score = None
    if variant == "causal+alibi":
        slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, device="cuda") / H)
        score = lambda s, b, h, q, kv: s + slopes[h] * (kv - q)  # noqa: E731
    return lambda: fn(qh, kh, vh, score_mod=score, block_mask=bm)


def sdpa(qh, kh, vh, variant, S):
    if variant not in ("full", "causal"):
        return None
    causal = variant == "causal"
    return lambda: torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)


IMPLS = ("flexattn/torch", "flexattn/cupy", "flexattn/jax", "jax x+1", "fa4", "flex", "sdpa")
TRAIN_IMPLS = ("flexattn/torch", "fa4", "flex", "sdpa")


def training_step(fn, inputs):
    """A training step of ``fn``'s call: the forward, then the gradients of ``inputs``."""
    grad = []

    def step():
        out = fn()
        out = out[0] if isinstance(out, tuple) else out
        if not grad:
            grad.append(torch.randn_like(out))
        return torch.autograd.grad(out, inputs, grad[0])
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1x128x4x64", help="BxSxHxD")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=None)
    ap.add_argument("--record", action="store_true", help=RECORD_HELP)
    ap.add_argument("--train", action="store_true", help="host time per training step (forward + backward)")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    args = ap.parse_args()
    B, S, H, D = map(int, args.shape.split("x"))
    dtype = getattr(torch, args.dtype)
    train = args.train
    impls = TRAIN_IMPLS if train else IMPLS
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=dtype, requires_grad=train)
               for _ in range(3))                                                          # [B, S, H, D]
    qh, kh, vh = (t.detach().transpose(1, 2).contiguous().requires_grad_(train) for t in (q, k, v))   # [B, H, S, D]
    fns = {}
    with torch.set_grad_enabled(train):
        for variant in args.variants:
            makers = {"flexattn/torch": lambda: ours_torch(qh, kh, vh, variant, S),
                      "flexattn/cupy": lambda: ours_cupy(qh, kh, vh, variant, S),
                      "flexattn/jax": lambda: ours_jax(qh, kh, vh, variant, S),
                      "jax x+1": lambda: jax_floor(qh, kh, vh, variant, S),
                      "fa4": lambda: fa4(q, k, v, variant, S),
                      "flex": lambda: flex(qh, kh, vh, variant, S),
                      "sdpa": lambda: sdpa(qh, kh, vh, variant, S)}
            for impl, make in makers.items():
                if impl not in impls:
                    continue
                try:
                    fn = make()
                    if fn is not None and train:
                        fn = training_step(fn, (q, k, v) if impl == "fa4" else (qh, kh, vh))
                    if fn is not None:
                        warm_up(fn)
                        fns[variant, impl] = fn
                except Exception as e:  # a missing library must not hide the rest
                    print(f"[{impl} {variant}] failed: {type(e).__name__}: {str(e)[:200]}")
                    traceback.print_exc(limit=1)
        best = best_of_interleaved(fns, args.calls, args.rounds)
    rows = []
    for variant in args.variants:
        res = {impl: best[variant, impl] for impl in impls if (variant, impl) in best}
        rows.append({"variant": variant, "host_us": res})
        print(variant, {i: f"{t:.1f} / {c:.1f}" for i, (t, c) in res.items()}, flush=True)

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    what = "training step (forward + autograd.grad)" if train else "call"
    lines = [f"Host µs per {what}, wall / thread CPU time (submit-only loop, best of {args.rounds} interleaved"
             f" rounds × {args.calls}),"
             f" B{B} S{S} H{H} D{D} {args.dtype}, {device_name()}, {stamp}.", "",
             "| variant | " + " | ".join(impls) + " |", "|---|" + "---|" * len(impls)]
    for r in rows:
        lines.append(f"| {r['variant']} | " + " | ".join(
            "{:.1f} / {:.1f}".format(*r["host_us"][i]) if i in r["host_us"] else "n/a" for i in impls) + " |")
    report("\n".join(lines), rows, args.out, stamp)
    if args.record and not train:   # (the host log's rows are per inference call)
        append_rows("host", host_rows(rows, f"B{B} S{S} H{H} D{D}", args.dtype), script="bench_overhead.py",
                    device=device_name(), date=stamp)


if __name__ == "__main__":
    main()
