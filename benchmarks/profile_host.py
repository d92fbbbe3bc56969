"""Where the host time of a repeated flexattn call goes (torch or CuPy adapter): the parts
of the prepared path timed one by one, then a cProfile of N steady-state calls of one
bench_overhead variant (after warm-up), top entries by internal time.

    python3 benchmarks/profile_host.py [--adapter torch|cupy] [--variant causal+alibi]
                                       [--shape 1x128x4x64] [--calls 2000]

Parts (µs per call, best of rounds of a submit-only loop, as bench_overhead): the whole
call; the key (call identity + tensor metadata); the cache lookup; the output allocation
(one array; CuPy allocates two per call, torch one unless return_lse); the current-device
check; the prepared launch alone (TVM-FFI, preallocated outputs; for CuPy with its stream
set around it). What the parts do not add up to is the glue between them.
"""

import argparse

import torch

from bench_overhead import VARIANTS, host_us, our_kwargs
from common import cprofile_calls, cprofile_lines


def _call(kw):
    """flex_attention's call tuple (score_mod, block_mask, scale, enable_gqa, mask, score)."""
    return (kw.get("score_mod"), kw.get("block_mask"), None, False, kw.get("mask"), None)


def torch_parts(qh, kh, vh, kw, calls):
    import flexattn.torch as fa
    import flexattn.torch.attention as fa_attention

    fn = lambda: fa.flex_attention(qh, kh, vh, **kw)  # noqa: E731
    warm_up(fn)
    call = _call(kw)
    key = fa_attention._call_key(qh, kh, vh, call)
    entry = fa_attention._PREPARED.get(key)
    assert entry is not None, "the call did not reach the prepared path"
    out, lse = torch.empty_like(qh), entry.lse_sink
    shape, dtype, dev = entry.out_shape, entry.dtype, entry.device
    return fn, {
        "whole call": host_us(fn, calls),
        "key": host_us(lambda: fa_attention._call_key(qh, kh, vh, call), calls),
        "lookup": host_us(lambda: fa_attention._PREPARED.get(key), calls),
        "torch.empty (out)": host_us(lambda: torch.empty(shape, dtype=dtype, device=dev), calls),
        "q.new_empty (out)": host_us(lambda: qh.new_empty(shape), calls),
        "torch.cuda.current_device()": host_us(torch.cuda.current_device, calls),
        "launch (TVM-FFI)": host_us(lambda: entry.launch(qh, kh, vh, out, lse), calls),
    }


def cupy_parts(qh, kh, vh, kw, calls):
    import cupy
    import numpy as np

    import flexattn.cupy as fc

    q, k, v = (cupy.from_dlpack(t) for t in (qh, kh, vh))
    fn = lambda: fc.flex_attention(q, k, v, **kw)  # noqa: E731
    warm_up(fn)
    call = _call(kw)
    key = fc._call_key(q, k, v, call)
    entry = fc._PREPARED.get(key)
    assert entry is not None, "the call did not reach the prepared path"
    out, lse = cupy.empty_like(q), cupy.empty(entry.lse_shape, dtype=np.float32)
    shape, dtype, prepared = entry.out_shape, entry.dtype, entry.prepared
    stream = cupy.cuda.get_current_stream().ptr
    return fn, {
        "whole call": host_us(fn, calls),
        "key": host_us(lambda: fc._call_key(q, k, v, call), calls),
        "lookup": host_us(lambda: fc._PREPARED.get(key), calls),
        "cupy.empty (out)": host_us(lambda: cupy.empty(shape, dtype=dtype), calls),
        "runtime.getDevice()": host_us(cupy.cuda.runtime.getDevice, calls),
        "get_current_stream().ptr": host_us(lambda: cupy.cuda.get_current_stream().ptr, calls),
        "launch (TVM-FFI, stream set)": host_us(lambda: prepared.launch(q, k, v, out, lse, stream=stream), calls),
    }


def warm_up(fn):
    for _ in range(5):   # compile, first sighting, prepared
        fn()
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapter", default="torch", choices=["torch", "cupy"])
    ap.add_argument("--variant", default="causal+alibi", choices=VARIANTS)
    ap.add_argument("--shape", default="1x128x4x64")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    B, S, H, D = map(int, args.shape.split("x"))
    qh, kh, vh = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16) for _ in range(3))
    parts = torch_parts if args.adapter == "torch" else cupy_parts
    kw = our_kwargs(args.variant, H, S)   # the same mod / block-mask objects every call
    with torch.no_grad():
        fn, timed = parts(qh, kh, vh, kw, args.calls // 10)
        prof, _ = cprofile_calls(fn, args.calls)
        torch.cuda.synchronize()
    print("\n".join(cprofile_lines(prof, ("tottime",), args.top)))
    print(f"\nHost µs per part, flexattn/{args.adapter} {args.variant} B{B} S{S} H{H} D{D} fp16, "
          f"{torch.cuda.get_device_name()}:\n")
    print("| part | µs |\n|---|---|")
    for name, us in timed.items():
        print(f"| {name} | {us:.2f} |")


if __name__ == "__main__":
    main()
