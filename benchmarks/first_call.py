"""First call of a new mod, on the GPU, measured alone (issue 3's ≤ 2 s target).

bench_fwd.py prints a first-call column too, but there each of our first calls follows
other libraries' work in the same process (torch.compile of flex keeps compile workers
busy in the background), which moved our numbers by up to ~1 s between runs. Here each
repetition is a fresh process that only runs flexattn.torch: one untimed warm-up call
(``full``: CuTeDSL's one-time start-up, the CUDA context), then the first call of each
mod variant, B4 S4096 H16 D128 bf16, without the on-disk kernel cache. The variants'
order rotates between repetitions, so no variant is always the first after the warm-up.
Block masks are built before the timed call (as a caller builds them once). Each call
is timed as wall time and as the process's CPU time (all threads): the device's host is
shared, and its wall times moved by ~40% between minutes in one session. "compiling": the
seconds the call's new kernel runners spent compiling (trace, MLIR, ptxas, host object;
``last_compile_seconds``); the rest of the wall time is the door's (planning, loading,
the launch).

``--phases`` also splits each first call's compile as compile_time.py does (trace, MLIR
passes, NVVM + ptxas, host object) inside the GPU process, so a slow first call can be
set beside compile_time.py's CPU-only compile of the same kernel on the same host.

    python3 benchmarks/first_call.py [--reps 3] [--variants causal window1024 ...] [--out first_call.json] [--phases]
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("causal", "window1024", "document4", "causal+softcap30", "causal+alibi")


B, S, H, D = 4, 4096, 16, 128


def variant_kwargs(name: str, device: str = "cuda") -> dict:
    """``flex_attention``'s keyword arguments for variant ``name`` (also compile_time.py's
    door-<variant> kernels). Block masks are built here, before a timed call, as a caller
    builds them once."""
    import torch

    import flexattn.torch as fa
    from flexattn import mods

    if name == "causal":
        return {"mask": mods.causal()}
    if name == "window1024":
        return {"block_mask": fa.create_block_mask(mods.sliding_window(1024), None, None, S, S, device=device)}
    if name == "document4":
        doc = torch.arange(S, device=device) * 4 // S
        return {"block_mask": fa.create_block_mask(mods.document(doc), None, None, S, S, device=device)}
    if name == "causal+softcap30":
        return {"mask": mods.causal(), "score_mod": mods.softcap(30.0)}
    if name == "causal+alibi":
        slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, device=device) / H)
        return {"mask": mods.causal(), "score_mod": mods.alibi(slopes)}
    raise ValueError(f"unknown variant {name}")


def child(order):
    """One process: warm up, then print the first-call seconds of each variant as JSON."""
    import torch

    import flexattn.torch as fa

    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fa.flex_attention(q, k, v)  # warm-up: the dense kernel
    torch.cuda.synchronize()
    timer = None
    if os.environ.get("FIRST_CALL_PHASES") == "1":   # (--phases: compile_time.py's phase split, here)
        from compile_time import PhaseTimer
        timer = PhaseTimer()
    from flexattn.kernels.launch import cache

    def compiles():   # runner -> (kernels compiled, seconds of its last compile)
        return {id(r): (r.num_compiled, getattr(r, "last_compile_seconds", 0.0)) for r in cache._RUNNERS.values()}

    def described(runner):
        """A runner's kernel: its class and the config fields it sets away from their defaults."""
        import dataclasses
        cfg = getattr(runner, "cfg", None)
        if cfg is None or not dataclasses.is_dataclass(cfg):
            return type(runner).__name__
        changed = [f"{f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg)
                   if f.name != "mods" and f.default is not dataclasses.MISSING and getattr(cfg, f.name) != f.default]
        return f"{type(runner).__name__}({', '.join(changed)})"

    out = {}
    for name in order:
        kw = variant_kwargs(name)
        torch.cuda.synchronize()
        before = compiles()
        if timer is not None:
            timer.t.clear()
        c0, t0 = time.process_time(), time.perf_counter()
        fa.flex_attention(q, k, v, **kw)
        torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        # the kernel compiles inside the call (trace, MLIR, ptxas, host object): the rest is the door's
        after = compiles()
        compiled = [(r, after[id(r)][1]) for r in cache._RUNNERS.values()
                    if before.get(id(r), (0, 0.0))[0] < after[id(r)][0]]
        out[name] = (wall, cpu, sum(s for _, s in compiled))
        print(f"KERNELS {name}: " + "; ".join(f"{described(r)} {s:.2f} s" for r, s in compiled), flush=True)
        if timer is not None:
            row = timer.phases(wall)
            shown = ("total", "trace", "mlir", "backend", "host")
            print(f"PHASES {name}: " + "  ".join(f"{k} {row[k]:.2f}" for k in shown), flush=True)
    print("FIRST_CALLS " + json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--out", default=None)
    ap.add_argument("--phases", action="store_true", help="split each compile into phases (compile_time.py's)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    env = dict(os.environ, FLEXATTN_DISK_CACHE="0", FIRST_CALL_PHASES="1" if args.phases else "0")
    times = {v: [] for v in args.variants}
    for rep in range(args.reps):
        n = rep % len(args.variants)
        order = args.variants[n:] + args.variants[:n]
        res = subprocess.run([sys.executable, __file__, "--child", *order], env=env, capture_output=True, text=True)
        line = [ln for ln in res.stdout.splitlines() if ln.startswith("FIRST_CALLS ")]
        if rep == 0:   # which kernels each first call compiled (the same in every repetition)
            print("\n".join(ln for ln in res.stdout.splitlines() if ln.startswith("KERNELS ")), flush=True)
        print("\n".join(ln for ln in res.stdout.splitlines() if ln.startswith("PHASES ")), flush=True)
        if res.returncode != 0 or not line:
            print(res.stdout[-2000:], res.stderr[-4000:])
            raise SystemExit(f"repetition {rep} failed (rc {res.returncode})")
        got = json.loads(line[0].split(" ", 1)[1])
        print(f"rep {rep} order {order}: " + ", ".join(f"{k} {t:.2f} ({c:.2f} cpu, {s:.2f} compiling)"
                                                        for k, (t, c, s) in got.items()), flush=True)
        for k, t in got.items():
            times[k].append(t)
    import torch

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"First call of a new mod (s), fresh process after one warm-up call, no disk cache, "
             f"{torch.cuda.get_device_name()}, {stamp}, {args.reps} processes:", "",
             "| variant | wall median | wall min | wall max | process CPU median | compiling median |",
             "|---|---|---|---|---|---|"]
    for k, ts in times.items():
        wall = [t for t, _, _ in ts]
        cpu = [c for _, c, _ in ts]
        comp = [s for _, _, s in ts]
        lines.append(f"| {k} | {statistics.median(wall):.2f} | {min(wall):.2f} | {max(wall):.2f} |"
                     f" {statistics.median(cpu):.2f} | {statistics.median(comp):.2f} |")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"stamp": stamp, "times": times}, f, indent=1)


if __name__ == "__main__":
    main()
