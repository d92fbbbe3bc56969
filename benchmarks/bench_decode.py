"""Decoding (q_len 1) against long KV caches, side by side on one GPU in one process.

  flexattn      the user's door: flexattn.torch.flex_attention called as a torch user decodes
                with torch's flex_attention (q_len 1 against the cache [B, Hkv, L, D], the
                window as a torch-style mask function through create_block_mask(device=
                "cuda"), ALiBi as a score_mod function; the same functions as "flex"): the
                core routes it to the decode kernel (core/short_query.py). Contiguous only.
  flexattn-decode  flexattn.torch.decode(q, KVCache): one whole step (host planning, upload, launch)
  flexattn-k    the same step's kernel alone (planned once, launched repeatedly; the splits
                are merged inside the decode kernel)
  sdpa          torch SDPA, enable_gqa (cuDNN / flash / efficient, torch's choice); the
                window variant attends only the window slice; ALiBi as a float bias
  fa4           FlashAttention-4 flash_attn_func (no split-KV on Hopper), no ALiBi
  flex          torch flex_attention, torch.compile'd (flex decoding for short queries)

TB/s count the K+V bytes a step needs: 2 · B · Hkv · keys · D · 2 bytes, keys = L, or the
window's 4097 keys for the sliding window. Contiguous caches are one [B, L, Hkv, D]
storage (viewed [B, Hkv, L, D]); paged caches use pages of 64 in shuffled order.

Two kernel timings: ``bench_ms`` (triton's do_bench: L2 flushed by *writing* 256 MB, so
~50 MB of dirty lines are written back during the timed call — ~17 µs, which caps a
268 MB step near 2.6 TB/s whatever the kernel) and ``clean_ms`` (L2 flushed by *reading*
256 MB before each timed call: cold and clean, nothing written back during the call).
Columns ending in "/c" use clean_ms. Whole calls are also timed back to back
(``loop_ms``: 50 calls, no flush, no sync in between — a decoder's steady state, where
host planning overlaps the previous step's kernel; medians of 5 such loops): "/loop" is
the GPU time per call (events around the loop), "host µs" the host's wall time per call.

    python3 benchmarks/bench_decode.py [--shapes 8x8192 8x65536 1x131072] [--out results.json]
    python3 benchmarks/bench_decode.py --sweep     # kernel shapes x split counts, kernels alone
    python3 benchmarks/bench_decode.py --sweep --shapes 1x131072 --variants window4096 --splits 8 13 16 26
    python3 benchmarks/bench_decode.py --no-flex --no-fa4   # skip the slow baselines
    python3 benchmarks/bench_decode.py --profile 8x8192     # host time of a steady-state call, by function
    python3 benchmarks/bench_decode.py --host 8x8192        # host µs of a steady-state call and its pieces
    python3 benchmarks/bench_decode.py --profile-door 1x131072:window4096   # the door's host time beside the API's
    python3 benchmarks/bench_decode.py --door-host 1x131072:window4096      # ... and its pieces, each timed alone
    python3 benchmarks/bench_decode.py --variants none alibi --layouts contiguous   # fewer rows
"""

import argparse
import datetime
import math
import time
import traceback

import numpy as np
import torch

from common import bench_ms, cprofile_calls, cprofile_lines, device_name, report
from results_log import RECORD_HELP, append_rows, decode_rows

HQ, HKV, D, WINDOW, PAGE = 32, 8, 128, 4096, 64
VARIANTS = ("none", "window4096", "alibi")
LAYOUTS = ("contiguous", "paged64")


def step_bytes(B, L, variant="none"):
    """The K+V bytes a step needs (the module doc): L keys, or the window's 4097."""
    keys = min(L, WINDOW + 1) if variant == "window4096" else L
    return 2 * B * HKV * keys * D * 2


def make_inputs(B, L, layout):
    from flexattn import KVCache, PagedKVCache

    torch.manual_seed(0)
    k = torch.randn(B, L, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lengths = torch.full((B,), L, dtype=torch.int32)       # host lengths: no sync per step
    if layout == "contiguous":
        return KVCache(k.transpose(1, 2), v.transpose(1, 2), lengths), k, v
    n_pages = B * L // PAGE
    # "paged64": shuffled pages (a long-running server's pool); "paged64sorted": in order;
    # "paged64local": shuffled only within each 2 MB run of the pool (the GPU's large
    # page), "paged64groups": the 2 MB runs shuffled, pages in order inside. Both keep a
    # sequence's 16 consecutive pages in one large page (one address translation, as in
    # order); fully shuffled pages need one per page.
    if layout.endswith("sorted"):
        order = torch.arange(n_pages, device="cuda")
    elif layout.endswith(("local", "groups")):
        run = max(1, (2 << 20) // (PAGE * HKV * D * 2))
        assert n_pages % run == 0, (n_pages, run)
        runs = torch.arange(n_pages, device="cuda").view(-1, run)
        if layout.endswith("local"):
            order = torch.stack([r[torch.randperm(run, device="cuda")] for r in runs]).flatten()
        else:
            order = runs[torch.randperm(len(runs), device="cuda")].flatten()
    else:
        order = torch.randperm(n_pages, device="cuda")
    table = order.view(B, L // PAGE).to(torch.int32)
    pages_k, pages_v = k.view(n_pages, PAGE, HKV, D), v.view(n_pages, PAGE, HKV, D)
    return PagedKVCache(pages_k, pages_v, table, lengths), None, None


_FLUSH = {}


def clean_ms(fn, reps=40, warmup=3, before=None, after_flush=None):
    """Median ms per call, each call after a read-only L2 flush (see the module doc);
    ``before()``, if given, runs before each flush, ``after_flush()`` after it (both outside
    the timed span)."""
    buf = _FLUSH.get("buf")
    if buf is None:
        buf = _FLUSH["buf"] = torch.ones(64 << 20, dtype=torch.int32, device="cuda")   # 256 MB
    times = []
    for i in range(warmup + reps):
        if before is not None:
            before()
        buf.sum()                   # reads only: evicts everything, leaves L2 clean
        if after_flush is not None:
            after_flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        if i >= warmup:
            times.append((start, end))
    torch.cuda.synchronize()
    return float(np.median([s.elapsed_time(e) for s, e in times]))


def loop_ms(fn, n=50, reps=5):
    """(GPU ms per call, host µs per call) for n back-to-back calls (see the module doc),
    medians of ``reps`` loops (the benchmark host is noisy)."""
    fn()
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(n):
            fn()
        end.record()
        host.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) / n)
    return float(np.median(gpu)), float(np.median(host))


def plan_step(q, cache, score, mask, tuning=None, num_splits=None):
    """A planned decode step (its kernel launched by ``step.launch()``) with a chosen kernel
    shape and split count: the core planner with the torch adapter's device glue."""
    from flexattn.core import decode_path
    from flexattn.core.kernel_path import Device
    from flexattn.torch.devices import _decode_workspace, _DeviceCopies

    B, Hq, n, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, n, device="cuda")
    stream = torch.cuda.current_stream()
    device = Device(stream.cuda_stream, _DeviceCopies(q.device), tvm_ffi_stream=True)
    table = cache.page_table if hasattr(cache, "page_table") else None
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    step = decode_path.prepare_decode(q, cache, out, lse,
                                      decode_path.DecodeSite(device, sms, _decode_workspace(q.device, stream)),
                                      decode_path.DecodeMods(score, mask), page_table=table,
                                      overrides=decode_path.DecodeOverrides(tuning, num_splits))
    return step, out


def slots_zeroer(step):
    """A function that zeroes ``step``'s polled-merge slots as they stand (its plan's parity
    slots, both sets, or the workspace's whole marked scratch): what a kernel that leaves
    them written (``DecodeConfig.caller_empties_slots``, FLEXATTN_DECODE_SLOTS=caller /
    parity-caller) needs between timed steps, outside the events."""
    parts = step.plan._parity_parts
    if parts is not None:
        return lambda: (parts[1].zero_(), parts[2].zero_())
    return lambda ws=step.plan.workspace: ws.marked_scratch(1).zero_()


def variant_mods(name):
    from flexattn import mods

    if name == "none":
        return None, None
    if name == "window4096":
        return mods.sliding_window(WINDOW), None
    return mods.causal(), mods.alibi(num_heads=HQ)


def baselines(name, q, k, v, L, scale, fa4=True, flex=True):
    """{impl: fn} for contiguous [B, L, Hkv, D] k/v and q [B, Hq, 1, D]."""
    from flexattn import mods

    out = {}
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)
    slopes = torch.from_numpy(mods.alibi_slopes(HQ)).cuda()
    F = torch.nn.functional
    if name == "none":
        out["sdpa"] = lambda: F.scaled_dot_product_attention(q, kh, vh, scale=scale, enable_gqa=True)
    elif name == "window4096":
        ks, vs = kh[:, :, L - WINDOW - 1:], vh[:, :, L - WINDOW - 1:]
        out["sdpa"] = lambda: F.scaled_dot_product_attention(q, ks, vs, scale=scale, enable_gqa=True)
    else:
        bias = (slopes.view(1, HQ, 1, 1) * (torch.arange(L, device="cuda") - (L - 1)).view(1, 1, 1, L)).to(q.dtype)
        out["sdpa"] = lambda: F.scaled_dot_product_attention(q, kh, vh, attn_mask=bias, scale=scale, enable_gqa=True)
    if name != "alibi" and fa4:
        try:
            from flash_attn.cute import flash_attn_func

            qf = q.transpose(1, 2)
            win = (WINDOW, 0) if name == "window4096" else (None, None)
            out["fa4"] = lambda: flash_attn_func(qf, k, v, softmax_scale=scale, causal=name == "window4096",
                                                 window_size=win)
        except Exception as e:  # noqa: BLE001
            print(f"fa4 unavailable: {e!r}")
    if flex:
        out["flex"] = _flex(name, q, kh, vh, L, scale, slopes)
    return out


_FLEX = {}


def torch_style_mods(name, L, slopes, create_block_mask):
    """(score_mod, block_mask) of a variant as a torch user decodes with flex_attention:
    the query at position 0, the newest key at L - 1 (``off``)."""
    off = L - 1
    score = block_mask = None
    if name == "window4096":
        def window(b, h, q_idx, kv_idx):
            return (q_idx + off >= kv_idx) & (q_idx + off - kv_idx <= WINDOW)
        block_mask = create_block_mask(window, None, None, 1, L, device="cuda")
    elif name == "alibi":
        def alibi(s, b, h, q_idx, kv_idx):
            return s + slopes[h] * (kv_idx - q_idx - off)
        score = alibi
    return score, block_mask


def _flex(name, q, kh, vh, L, scale, slopes):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    fn = _FLEX["fn"]
    score, block_mask = torch_style_mods(name, L, slopes, create_block_mask)
    return lambda: fn(q, kh, vh, score_mod=score, block_mask=block_mask, scale=scale, enable_gqa=True)


def door(name, q, k, v, L, scale):
    """The headline: flexattn.torch.flex_attention with the torch-style functions."""
    import flexattn.torch as fa
    from flexattn import mods

    slopes = torch.from_numpy(mods.alibi_slopes(HQ)).cuda()
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)
    score, block_mask = torch_style_mods(name, L, slopes, fa.create_block_mask)
    return lambda: fa.flex_attention(q, kh, vh, score_mod=score, block_mask=block_mask, scale=scale,
                                     enable_gqa=True)


def run_shape(B, L, rows, fa4=True, flex=True, variants=VARIANTS, layouts=LAYOUTS):
    import flexattn.torch as fa
    from flexattn.torch.decoding import _kernel_decode

    scale = 1 / math.sqrt(D)
    for layout in layouts:
        cache, k, v = make_inputs(B, L, layout)
        q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
        for name in variants:
            mask, score = variant_mods(name)
            gbytes = step_bytes(B, L, name) / 1e9
            impls = {}
            if layout == "contiguous":
                impls["flexattn"] = door(name, q, k, v, L, scale)
            impls["flexattn-decode"] = lambda: fa.decode(q, cache, score_mod=score, mask=mask)
            try:
                _, _, step = _kernel_decode(q, cache, score, mask, None, launch=False)
                impls["flexattn-k"] = step.launch
                splits = step.num_splits
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                splits = None
            if layout == "contiguous":
                impls.update(baselines(name, q, k, v, L, scale, fa4, flex))
            ref = None
            for impl, fn in impls.items():
                row = dict(B=B, L=L, layout=layout, variant=name, impl=impl, splits=splits)
                try:
                    o = fn()
                    torch.cuda.synchronize()
                    if ref is None:
                        ref = o
                    elif ref is not None and isinstance(o, torch.Tensor) and o.shape[-1] == D and layout == "contiguous":
                        o4 = o if o.shape == ref.shape else o.transpose(1, 2)
                        row["rel_diff_vs_flexattn"] = ((o4.float() - ref.float()).norm() / ref.float().norm()).item()
                    ms = bench_ms(fn, 25, 150)
                    row.update(ms=ms, tbps=gbytes / ms)
                    if impl in ("flexattn", "flexattn-decode"):
                        ms_l, host_us = loop_ms(fn)
                        row.update(ms_loop=ms_l, tbps_loop=gbytes / ms_l, host_us=host_us)
                    if impl in ("flexattn-k", "sdpa"):
                        ms_c = clean_ms(fn)
                        row.update(ms_clean=ms_c, tbps_clean=gbytes / ms_c)
                except Exception as e:  # noqa: BLE001
                    row.update(ms=None, tbps=None, error=repr(e)[:200])
                print(row, flush=True)
                rows.append(row)
        cache = k = v = impls = None  # free this layout's cache before the next one
        torch.cuda.empty_cache()


def table(rows, stamp) -> str:
    impls = ["flexattn", "flexattn/loop", "flexattn-decode", "flexattn-decode/loop", "flexattn-k", "flexattn-k/c",
             "sdpa", "sdpa/c", "fa4", "flex"]
    lines = [f"Decode, q_len 1, Hq {HQ} Hkv {HKV} D {D} bf16 — TB/s of K+V bytes needed ({device_name()}, {stamp})", "",
             "| B | L | layout | variant | splits | " + " | ".join(impls) + " | host µs door | host µs decode |",
             "|---|---|---|---|---|" + "---|" * (len(impls) + 2)]
    keyed = {}
    for r in rows:
        keyed.setdefault((r["B"], r["L"], r["layout"], r["variant"]), {})[r["impl"]] = r
    for (B, L, layout, name), by in keyed.items():
        cells = []
        for i in impls:
            impl, _, timing = i.partition("/")
            r = by.get(impl)
            key = {"c": "tbps_clean", "loop": "tbps_loop"}.get(timing, "tbps")
            cells.append("—" if r is None or r.get(key) is None else f"{r[key]:.2f}")
        for impl in ("flexattn", "flexattn-decode"):
            host = by.get(impl, {}).get("host_us")
            cells.append("—" if host is None else f"{host:.0f}")
        splits = next(iter(by.values())).get("splits")
        lines.append(f"| {B} | {L} | {layout} | {name} | {splits} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_tunings():
    from flexattn.core.decode_path import DecodeTuning

    return {"t128s3": DecodeTuning(128, 3, 1), "t64s3c2": DecodeTuning(64, 3, 2),
            "t64s6": DecodeTuning(64, 6, 1), "t64s2c2": DecodeTuning(64, 2, 2)}


def sweep_shape(B, L, rows, split_factors=(1, 2), only=None, variant="none", splits=None, layouts=LAYOUTS):
    """The kernel alone for every sweep tuning x split count (the heuristic's, and
    multiples; or the given ``splits``), with ``variant``'s mods, SDPA beside them."""
    from flexattn.core.decode_path import choose_splits, live_blocks

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gbytes = step_bytes(B, L, variant) / 1e9
    scale = 1 / math.sqrt(D)
    mask, score = variant_mods(variant)
    for layout in layouts:
        cache, k, v = make_inputs(B, L, layout)
        q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
        if layout == "contiguous":
            sdpa = baselines(variant, q, k, v, L, scale, fa4=False, flex=False)["sdpa"]
            ms, ms_c = bench_ms(sdpa, 25, 150), clean_ms(sdpa)
            rows.append(dict(B=B, L=L, layout=layout, tuning="sdpa", splits=None, tbps=gbytes / ms,
                             tbps_clean=gbytes / ms_c))
            print(rows[-1], flush=True)
        for name, tuning in sweep_tunings().items():
            if only and name not in only:
                continue
            blocks = live_blocks(mask, B, HQ, 1, L, tuning.tile_n) if mask is not None else -(-L // tuning.tile_n)
            base = choose_splits(B, HKV, 1, blocks, sms, tuning)
            for n in (splits or [base * f for f in split_factors]):
                row = dict(B=B, L=L, layout=layout, tuning=name, splits=n, variant=variant)
                try:
                    step, _ = plan_step(q, cache, score, mask, tuning, n)
                    step.launch()
                    torch.cuda.synchronize()
                    ms, ms_c = bench_ms(step.launch, 25, 150), clean_ms(step.launch)
                    row.update(tbps=gbytes / ms, tbps_clean=gbytes / ms_c)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    row.update(error=repr(e)[:200])
                print(row, flush=True)
                rows.append(row)
        cache = k = v = None
        torch.cuda.empty_cache()


def sweep_table(rows, stamp) -> str:
    lines = [f"Decode kernel sweep, TB/s ({device_name()}, {stamp}); /c: clean-L2 timing", "",
             "| B | L | layout | variant | tuning | splits | do_bench | /c |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = [f"{r[k]:.2f}" if r.get(k) is not None else "—" for k in ("tbps", "tbps_clean")]
        lines.append(f"| {r['B']} | {r['L']} | {r['layout']} | {r.get('variant', 'none')} | {r['tuning']} | "
                     f"{r['splits']} | {' | '.join(f)} |")
    return "\n".join(lines)


def _steady_alibi_step(B, L, warmup: int):
    """(cache, q, mask, score) of a decoder's steady state — contiguous cache, one query
    token, causal + ALiBi, the same mod objects — after ``warmup`` whole calls (compiled,
    planned, prepared) and a sync."""
    import flexattn.torch as fa

    cache, _, _ = make_inputs(B, L, "contiguous")
    q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    mask, score = variant_mods("alibi")
    for _ in range(warmup):
        fa.decode(q, cache, score_mod=score, mask=mask)
    torch.cuda.synchronize()
    return cache, q, mask, score


def burst_seconds(fn, calls: int, burst: int, warmup: int) -> list:
    """Host seconds per call of ``fn``, one reading per burst of ``burst`` calls after a
    sync (``calls // burst`` bursts, after ``warmup`` calls): unprofiled, and the GPU never
    holds the host back."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls // burst):
        t0 = time.perf_counter()
        for _ in range(burst):
            fn()
        times.append((time.perf_counter() - t0) / burst)
        torch.cuda.synchronize()
    return times


def piece_lines(pieces: dict, calls: int, burst: int) -> list:
    """One line per ``name: fn`` of ``pieces``: its host µs per call (``burst_seconds``,
    warmed up by one burst), median and mean over the bursts."""
    lines = []
    for name, fn in pieces.items():
        times = burst_seconds(fn, calls, burst, warmup=burst)
        lines.append(f"  {name:38s} median {np.median(times) * 1e6:6.1f}   mean {np.mean(times) * 1e6:6.1f}")
    return lines


def cprofile_top(fn, calls: int, limit: int) -> tuple:
    """(seconds per call with the profiler on, the non-blank lines of cProfile's top
    ``limit`` functions by own time) over ``calls`` back-to-back calls of ``fn``."""
    prof, per_call = cprofile_calls(fn, calls)
    torch.cuda.synchronize()
    return per_call, cprofile_lines(prof, ("tottime",), limit)


def profile_host(B, L, calls=300):
    """cProfile of back-to-back whole calls (contiguous cache, causal + ALiBi, the same mod
    objects: the steady state of a decoder), top functions by own time."""
    import flexattn.torch as fa

    cache, q, mask, score = _steady_alibi_step(B, L, warmup=20)
    per_call, lines = cprofile_top(lambda: fa.decode(q, cache, score_mod=score, mask=mask), calls, 18)
    text = "\n".join(lines)
    return f"Host profile, B {B} L {L} causal+alibi, {calls} calls: {per_call * 1e6:.0f} µs/call (profiled)\n{text}"


def profile_door(B, L, variant, calls=300, burst=32):
    """The door (``door``: flex_attention with the torch-style functions) beside the API
    (``fa.decode`` on a KVCache) for one variant, contiguous: host µs per steady-state call
    (bursts of ``burst`` calls after a sync, unprofiled: the GPU never holds the host back),
    then each one's cProfile, top functions by own time — where the door's extra host time goes."""
    import flexattn.torch as fa

    cache, k, v = make_inputs(B, L, "contiguous")
    q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    mask, score = variant_mods(variant)
    calls_of = {"door": door(variant, q, k, v, L, 1 / math.sqrt(D)),
                "api": lambda: fa.decode(q, cache, score_mod=score, mask=mask)}
    lines = [f"Host µs per call, B {B} L {L} {variant} (median of bursts of {burst}, unprofiled)"]
    for name, fn in calls_of.items():
        lines.append(f"  {name}: {np.median(burst_seconds(fn, calls, burst, warmup=20)) * 1e6:.1f}")
    for name, fn in calls_of.items():
        lines += [f"\n== {name} ({calls} calls, profiled)"] + cprofile_top(fn, calls, 22)[1]
    return "\n".join(lines)


def door_breakdown(B, L, variant, calls=2000, burst=32):
    """Host µs per call of the door (flex_attention, q_len 1, torch-style mods) and of its
    pieces, each timed alone as ``host_breakdown`` times the API's, with the API's whole
    call and plan beside them: where the door's extra host time lies."""
    import flexattn.torch as fa
    from flexattn.core.decode_device import decode_key
    from flexattn.torch import attention
    from flexattn.torch.decoding import _DECODES, _step_facts
    from flexattn.torch.devices import _current_raw_stream, _written_empty

    cache, k, v = make_inputs(B, L, "contiguous")
    q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    mask, score = variant_mods(variant)
    door_call = door(variant, q, k, v, L, 1 / math.sqrt(D))
    api_call = lambda: fa.decode(q, cache, score_mod=score, mask=mask)  # noqa: E731
    for _ in range(5):
        door_call(), api_call()
    torch.cuda.synchronize()
    # The door's call as flex_attention keys it (the closure's arguments).
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)
    cells = dict(zip(door_call.__code__.co_freevars, (c.cell_contents for c in door_call.__closure__)))
    call = (cells["score"], cells["block_mask"], cells["scale"], True, None, None)
    key = attention._call_key(q, kh, vh, call)
    entry = attention._PREPARED.get(key)
    if entry is None:
        return f"the door's call was not prepared (key {key is not None}): nothing to break down"
    short = entry.launch.__self__
    plan = short._run.__self__
    api_plan = _DECODES.get(decode_key((score, None, None, True, mask, None), q, cache, _step_facts)).run.__self__
    out, lse = torch.empty_like(q), torch.empty(B, HQ, 1, device="cuda")
    lengths, sms, stream = short._lengths, short._num_sms, _current_raw_stream(entry.device_index)

    def kernel_call(p, kk, vv):
        kernel, _, o_part, lse_part = p._stage(lengths, sms, None)
        return p._launcher(kernel, q, kk, vv, None, out, lse, o_part, lse_part)

    pieces = {
        "door (whole call)": door_call,
        "api: fa.decode (whole call)": api_call,
        "  door: _call_key": lambda: attention._call_key(q, kh, vh, call),
        "  door: _PREPARED.run (entry)": lambda: attention._PREPARED.run(key, q, kh, vh, False, call),
        "    torch.cuda.current_device": torch.cuda.current_device,
        "    _written_empty (out)": lambda: _written_empty(entry.out_shape, dtype=entry.dtype, device=entry.device),
        "    _current_raw_stream": lambda: _current_raw_stream(entry.device_index),
        "    PreparedShortQuery.launch": lambda: short.launch(q, kh, vh, out, lse, stream),
        "      door plan.run": lambda: plan.run(q, kh, vh, None, out, lse, lengths, sms),
        "      door plan._stage": lambda: plan._stage(lengths, sms, None),
        "      door kernel call": kernel_call(plan, kh, vh),
        "  api plan.run": lambda: api_plan.run(q, cache.k, cache.v, None, out, lse, lengths, sms),
        "  api plan._stage": lambda: api_plan._stage(lengths, sms, None),
        "  api kernel call": kernel_call(api_plan, cache.k, cache.v),
        "  door: _broadcast_kv_batch": lambda: attention._broadcast_kv_batch(q, kh, vh),
        "  torch.empty (out)": lambda: torch.empty(entry.out_shape, dtype=entry.dtype, device=entry.device),
        "  an empty lambda": lambda: None,
    }
    lines = [f"Host µs per call, B {B} L {L} {variant}, door beside API, {calls} calls each in bursts of {burst}, "
             f"{device_name()}; door plan is the API's: {plan is api_plan}"]
    lines += piece_lines(pieces, calls, burst)
    ready = (out, lse)

    class Stubbed:   # the door's wrapper alone: its repeated-call lookup answers at once
        @staticmethod
        def run(*_):
            return ready
    kept, attention._PREPARED = attention._PREPARED, Stubbed
    try:
        lines += piece_lines({"  door wrapper (entry stubbed)": door_call}, calls, burst)
    finally:
        attention._PREPARED = kept
    return "\n".join(lines)


def host_breakdown(B, L, calls=2000, burst=32):
    """Host µs per call of a steady-state whole step (contiguous cache, causal + ALiBi) and
    of its pieces, each timed alone without a profiler: bursts of ``burst`` calls after a
    sync, so the GPU (a ~96 µs kernel per launch at B 8 L 8k) never holds the host back —
    neither the launch queue nor the staging ring (the host may run 48 steps ahead)."""
    import flexattn.torch as fa
    from flexattn.core.decode_device import decode_key
    from flexattn.torch.decoding import _DECODES, _step_facts

    cache, q, mask, score = _steady_alibi_step(B, L, warmup=5)
    call = (score, None, None, True, mask, None)
    entry = _DECODES.get(decode_key(call, q, cache, _step_facts))
    plan = entry.run.__self__
    out = torch.empty_like(q)
    lse = torch.empty(B, HQ, 1, device="cuda")
    lengths = cache.lengths.tolist()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    put = plan._put
    values = [*lengths, *[n - 1 for n in lengths]]
    kernel, _, o_part, lse_part = plan._stage(lengths, sms, None)
    fn = plan._fns[kernel]   # compiled by the warm-up steps
    args = plan._args if plan._args is not None else plan._convert()
    pieces = {
        "fa.decode (whole step)": lambda: fa.decode(q, cache, score_mod=score, mask=mask),
        "fa.decode, return_lse": lambda: fa.decode(q, cache, score_mod=score, mask=mask, return_lse=True),
        "  decode_key": lambda: decode_key(call, q, cache, _step_facts),
        "  entry (whole step but the key)": lambda: entry(q, cache, False),
        "    plan.run (no allocation)": lambda: plan.run(q, cache.k, cache.v, None, out, lse, lengths, sms),
        "      plan._stage (checks, upload)": lambda: plan._stage(lengths, sms, None),
        "        ring put (pack + HtoD)": lambda: put(values),
        "      kernel call (TVM-FFI)": lambda: fn(q, cache.k, cache.v, None, plan.seq_lens, out, lse, o_part,
                                                   lse_part, plan._tickets, plan.scale, args),
        "    torch.empty (out)": lambda: torch.empty(B, HQ, 1, D, dtype=torch.bfloat16, device="cuda"),
        "    lengths.tolist": lambda: cache.lengths.tolist(),
        "    torch.cuda.current_device": lambda: torch.cuda.current_device(),
    }
    lines = [f"Host µs per call, B {B} L {L} causal+alibi, {calls} calls each in bursts of {burst}, {device_name()}"]
    return "\n".join(lines + piece_lines(pieces, calls, burst))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="*", default=["8x8192", "8x65536", "1x131072"])
    p.add_argument("--out", default=None)
    p.add_argument("--sweep", action="store_true", help="kernel shapes x split counts instead of the table")
    p.add_argument("--no-fa4", action="store_true")
    p.add_argument("--no-flex", action="store_true")
    p.add_argument("--tunings", nargs="*", default=None, help="sweep only these (names in sweep_tunings)")
    p.add_argument("--split-factors", nargs="*", type=int, default=[1, 2])
    p.add_argument("--splits", nargs="*", type=int, default=None, help="--sweep: these split counts instead")
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--profile", default=None, help="BxL: cProfile a steady-state whole call instead")
    p.add_argument("--profile-door", default=None, metavar="BxL:VARIANT",
                   help="the door's and the API's host µs per call and their cProfiles instead")
    p.add_argument("--door-host", default=None, metavar="BxL:VARIANT",
                   help="host µs of the door's steady-state call and its pieces, beside the API's")
    p.add_argument("--host", default=None, help="BxL: host µs of a steady-state whole call and its pieces instead")
    p.add_argument("--record", action="store_true", help=RECORD_HELP + " (the table, not --sweep)")
    args = p.parse_args()
    if args.profile:
        B, L = (int(x) for x in args.profile.split("x"))
        print(profile_host(B, L))
        return
    if args.profile_door:
        shape, variant = args.profile_door.split(":")
        B, L = (int(x) for x in shape.split("x"))
        print(profile_door(B, L, variant))
        return
    if args.door_host:
        shape, variant = args.door_host.split(":")
        B, L = (int(x) for x in shape.split("x"))
        print(door_breakdown(B, L, variant))
        return
    if args.host:
        B, L = (int(x) for x in args.host.split("x"))
        print(host_breakdown(B, L))
        return
    torch._dynamo.config.cache_size_limit = 64
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rows = []
    for s in args.shapes:
        B, L = (int(x) for x in s.split("x"))
        try:
            if args.sweep:
                for variant in args.variants:
                    sweep_shape(B, L, rows, tuple(args.split_factors), args.tunings, variant, args.splits,
                                args.layouts)
            else:
                run_shape(B, L, rows, fa4=not args.no_fa4, flex=not args.no_flex, variants=args.variants,
                          layouts=args.layouts)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    report(sweep_table(rows, stamp) if args.sweep else table(rows, stamp), rows, args.out, stamp)
    if args.record and not args.sweep:
        append_rows("decode", decode_rows(rows), script="bench_decode.py", device=device_name(), date=stamp)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
