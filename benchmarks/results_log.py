"""Machine-readable benchmark rows: ``benchmarks/results/<area>.jsonl`` (schema: results/README.md).

A benchmark script given ``--record`` turns its rows into measurements (one JSON object per
line: the run's date, device, commit and script, the row's fields, ``impl``, ``metric``,
``value``, ``unit``) and appends them to its area's file:

    from results_log import append_rows, tflops_rows
    append_rows("forward", tflops_rows(rows), script="bench_fwd.py", device=device_name(), date=stamp)

Nothing here imports torch; the converters take the row dicts the scripts already build.
"""

import datetime
import json
import os
import pathlib
import subprocess

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"
AREAS = ("forward", "backward", "decode", "host", "first_call", "blockmask")
HEAD = ("date", "device", "commit", "script")
RECORD_HELP = "append this run's rows to benchmarks/results/<area>.jsonl (see benchmarks/results/README.md)"


def git_commit() -> str:
    """``git rev-parse --short HEAD`` of the checkout holding this file; 'unknown' without git.
    ``FLEXATTN_COMMIT`` overrides it: the device machine's copy of the tree may carry an older
    HEAD than its files (session 55), so a device command can pass the local commit in."""
    if os.environ.get("FLEXATTN_COMMIT"):
        return os.environ["FLEXATTN_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=RESULTS_DIR.parent, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def utc_stamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def append_rows(area: str, rows, *, script: str, device: str | None = None, commit: str | None = None,
                date: str | None = None, directory=None) -> pathlib.Path:
    """Append ``rows`` (dicts with at least impl, metric, value, unit) to ``<directory>/<area>.jsonl``,
    each prefixed with the run's date, device, commit and script. Returns the file's path."""
    if area not in AREAS:
        raise ValueError(f"unknown area {area!r}; one of {AREAS}")
    head = {"date": date or utc_stamp(), "device": device or "unknown", "commit": commit or git_commit(),
            "script": script}
    path = pathlib.Path(directory or RESULTS_DIR) / f"{area}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for row in rows:
        missing = {"impl", "metric", "value", "unit"} - row.keys()
        if missing:
            raise ValueError(f"row without {sorted(missing)}: {row}")
        lines.append(json.dumps({**head, **{k: v for k, v in row.items() if k not in HEAD}}, ensure_ascii=False))
    with open(path, "a", encoding="utf-8") as fh:
        fh.writelines(line + "\n" for line in lines)
    print(f"recorded {len(lines)} rows in {path}")
    return path


def _num(x, digits):
    return None if x is None else round(float(x), digits)


def tflops_rows(rows):
    """bench_fwd / bench_bwd rows -> measurements: TFLOP/s per implementation, our deterministic
    step (bench_bwd), our first call (s) and host time per call (µs, bench_fwd)."""
    out = []
    for r in rows:
        key = {"shape": r["shape"], "variant": r["variant"]}
        for impl, v in r["tflops"].items():
            out.append({**key, "impl": impl, "metric": "tflops", "value": _num(v, 1), "unit": "TFLOP/s"})
        if "deterministic_tflops" in r:
            out.append({**key, "impl": "flexattn/deterministic", "metric": "tflops",
                        "value": _num(r["deterministic_tflops"], 1), "unit": "TFLOP/s"})
        if "first_call_s" in r:
            out.append({**key, "impl": "flexattn", "metric": "first_call_s", "value": _num(r["first_call_s"], 2),
                        "unit": "s"})
        if "host_us" in r:
            out.append({**key, "impl": "flexattn", "metric": "host_us", "value": _num(r["host_us"], 0), "unit": "µs"})
    return out


def decode_rows(rows):
    """bench_decode table rows -> measurements: TB/s per column of its table (``flexattn`` —
    the flex_attention door since 2026-11-26, before that ``flexattn.torch.decode`` —,
    ``flexattn-decode``, their ``/loop``, ``flexattn-k``, ``flexattn-k/c``, ``sdpa``,
    ``sdpa/c``, ``fa4``, ``flex``) and the whole calls' host µs."""
    out = []
    for r in rows:
        key = {"shape": f"B{r['B']} L{r['L']}", "variant": r["variant"], "layout": r["layout"], "splits": r.get("splits")}
        for field, suffix in (("tbps", ""), ("tbps_loop", "/loop"), ("tbps_clean", "/c")):
            if r.get(field) is not None:
                out.append({**key, "impl": r["impl"] + suffix, "metric": "tbps", "value": _num(r[field], 2),
                            "unit": "TB/s"})
        if r.get("host_us") is not None:
            out.append({**key, "impl": r["impl"], "metric": "host_us", "value": _num(r["host_us"], 0), "unit": "µs"})
    return out


def host_rows(rows, shape, dtype):
    """bench_overhead rows ({variant, host_us: {impl: (wall, cpu)}}) -> wall and thread-CPU µs per call."""
    out = []
    for r in rows:
        for impl, (wall, cpu) in r["host_us"].items():
            key = {"shape": shape, "dtype": dtype, "variant": r["variant"], "impl": impl}
            out.append({**key, "metric": "host_us", "value": _num(wall, 1), "unit": "µs"})
            out.append({**key, "metric": "host_cpu_us", "value": _num(cpu, 1), "unit": "µs"})
    return out


def blockmask_rows(rows):
    """bench_blockmask rows -> ms per build (value null with a note where a build did not run)."""
    out = []
    for r in rows:
        row = {"shape": f"S{r['S']}", "variant": r["mask"], "impl": r["impl"], "metric": "build_ms",
               "value": _num(r.get("ms"), 3), "unit": "ms"}
        note = r.get("note") or r.get("match_note") or (None if r.get("match", True) else "lists differ from torch's")
        if note:
            row["note"] = note
        out.append(row)
        if r.get("first_call_s") is not None:
            out.append({**{k: row[k] for k in ("shape", "variant", "impl")}, "metric": "first_call_s",
                        "value": _num(r["first_call_s"], 2), "unit": "s"})
    return out
