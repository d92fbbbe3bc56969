"""Timing and reporting helpers shared by the benchmark scripts."""

import time

import torch


def bench_ms(fn, warmup_ms=100, rep_ms=400):
    """Median ms per call (triton's do_bench: CUDA events, L2 flushed between calls)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def rel_diff(out, ref):
    """Relative Frobenius difference of two outputs ([B, H, S, D] or [B, S, H, D])."""
    o = out[0] if isinstance(out, tuple) else out
    if o.shape != ref.shape:
        o = o.transpose(1, 2)
    return ((o.float() - ref.float()).norm() / ref.float().norm()).item()


def tflops_ratio(row, impl: str, ours: str = "flexattn") -> str:
    """A table cell: ours / ``impl`` of ``row["tflops"]``, or "—" where either is missing."""
    t, o = row["tflops"].get(impl), row["tflops"].get(ours)
    return "—" if t is None or o is None else f"{o / t:.2f}"


def accumulate_time(owner, name: str, totals: dict, key: str):
    """Wrap ``owner.name`` so that each call's wall time (s) adds to ``totals[key]``: how
    the host-time tools split a process's time into parts (compile phases, a step's parts)."""
    inner = getattr(owner, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - t0
    setattr(owner, name, timed)


def measure_until_stopped(measure, rows: list):
    """Run ``measure()`` (which appends to ``rows``); a SIGTERM (the device script's ``timeout``) ends it
    early instead of killing the process, so the rows measured so far are still reported and recorded."""
    import signal

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        measure()
    except KeyboardInterrupt:
        print(f"stopped early: reporting the {len(rows)} rows measured", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)


def cprofile_calls(fn, calls: int, between=None):
    """cProfile of ``calls`` back-to-back calls of ``fn``: (the profile, host seconds per call
    with the profiler on). ``between()`` (a synchronize, say) runs after each call outside
    the profile; without it the profiler stays on across the loop. The GPU is not
    synchronized here: sync_probe profiles while a sleep kernel keeps it busy."""
    import cProfile

    profile = cProfile.Profile()
    t0 = time.perf_counter()
    if between is None:
        profile.enable()
        for _ in range(calls):
            fn()
        profile.disable()
    else:
        for _ in range(calls):
            profile.enable()
            fn()
            profile.disable()
            between()
    return profile, (time.perf_counter() - t0) / calls


def cprofile_lines(profile, orders=("tottime",), limit: int = 30) -> list:
    """The non-blank lines of pstats' top ``limit`` entries, for each sort order in turn
    ("tottime": own time, "cumulative": with callees)."""
    import io
    import pstats

    text = io.StringIO()
    for order in orders:
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(limit)
    return [line for line in text.getvalue().splitlines() if line.strip()]


def device_name():
    return torch.cuda.get_device_name()


def report(md: str, rows: list, out: str | None, stamp: str):
    """Print the markdown table; with ``out``, also write rows + table as JSON."""
    import json

    print("\n" + md)
    if out:
        with open(out, "w") as fh:
            json.dump({"device": device_name(), "date": stamp, "rows": rows, "markdown": md}, fh, indent=1)
