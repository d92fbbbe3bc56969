"""Where a decode step's time goes, CTA by CTA: the kernel's timeline probe.

A planned step's kernel (as bench_decode.py's "flexattn-k": config, split count,
arguments) is compiled once more with ``DecodeConfig.timeline``: every CTA writes
``%globaltimer_lo`` stamps (ns) past the arrival tickets — entry, producer start, Q
loaded, first kv block done, stream end, ticket taken (cluster merge: the first cluster
barrier passed), merge end (merging CTAs; with a cluster merge, every CTA), and its SM
(``--by-sm`` prints each CTA's stream end by SM id). Each
launch follows a read-only L2 flush, as ``clean_ms``. Per row (medians over launches,
µs from the first CTA's entry):

  kernel       CUDA events around the probed launch (the probe adds a few stores)
  entry        last CTA's entry (how long the launch takes to place every CTA)
  wave1        CTAs that entered within 5 µs of the first (all of them: one wave)
  shared       SMs holding more than one of the launch's CTAs (the block scheduler's placement)
  range        median CTA: entry -> its kv range known (length read, masked-prefix analysis)
  prod/issue/q median CTA: entry -> producer warp started / its first K block's TMA issued
               (the length's load returned) / the packed Q stored to shared memory
  k1/v1        median CTA: entry -> the first block's K / V in shared memory (consumer's waits)
  first        median CTA: entry -> first kv block consumed (Q load, first TMA round trip)
  end p0/10/mean/50/100  stream ends over CTAs (the tail's spread; mean: where a
               perfectly balanced stream would end, to first order)
  ticket       median CTA: stream end -> ticket taken (partial stores, fence, atomic)
  norm         median CTA: stream end -> its partial normalized (finalize; the stores start)
  seen/rounds  polled merge, median merging CTA: the last split's partial issued (any CTA's
               "ticket" stamp) -> its first row seen written; the polling rounds it took
  out          polled merge, median merging CTA: first row seen -> merged row stored (the
               slots are emptied after it, before "merge" ends)
  merge        median merging CTA: ticket -> merged rows written
  done         last stamp of any CTA
  steady       K+V bytes / (median stream end - median first block), TB/s
  tick         the smallest step between two stamps (ns): the timer's resolution
  lead/trail   with --marks (stream_marks.py): a one-thread kernel's stamp just before the
               launch -> the first CTA's entry, and the last stamp -> a mark just after:
               where the event time goes outside the CTAs (launch, completion)
  m2m          with --marks: mark before -> mark after around the production kernel (no
               probe); each shape and variant also gets a line with the same span around
               an empty kernel and around torch's plain reads of the same bytes
               (decode_floor.py's "read"), so the gap to a plain read splits into lead,
               body and trail

Each row three times with ``--merges cluster tickets polled`` (the default): the planner's
cluster merge where it applies (2, 4 or 8 splits), the arrival-ticket merge and the polled
merge (``decode/polled_merge.py``; its "ticket" stamp is the partial's stores done, its
merge from there), same split count.

    python3 benchmarks/decode_timeline.py [--shapes 8x8192 1x131072] [--variants none alibi]

``--after-flush KIND`` runs decode_floor.py's step between each flush and each launch (an
empty kernel, a matmul): what the kernel before a step changes in the step's timeline. With
``--marks`` the probed launches follow the marks' spin instead (``between_marks``), so the
two are read apart.

``--dump-ctas G`` also prints the first launch's first G groups CTA by CTA (``cta_lines``):
which split ends last, and what its merger waits for.
"""

import argparse
import dataclasses
import os

import numpy as np
import torch

from bench_decode import D, HQ, clean_ms, make_inputs, plan_step, slots_zeroer, step_bytes, variant_mods
from common import device_name
from decode_floor import after_flush_step, plain_reads
from stream_marks import mark


def between_marks(fn, marks):
    """``fn`` with stream marks 0 and 1 of ``marks`` (int32 [2] on the GPU) around its
    launches, after a spin (~0.2 ms at H100/H200 clocks): the GPU stays busy while the host
    queues the mark, the launches and the second mark, so no host gap lands between them."""
    stream = torch.cuda.current_stream().cuda_stream

    def marked():
        torch.cuda._sleep(400_000)
        mark(marks, 0, stream)
        fn()
        mark(marks, 1, stream)
    return marked


def mark_to_mark_us(fn, reps: int, before=None) -> float:
    """Median µs from a stream mark just before ``fn``'s launches to one just after them,
    each after a read-only L2 flush (``between_marks``; ``before()`` ahead of the flush)."""
    marks = torch.zeros(2, dtype=torch.int32, device="cuda")
    marked = between_marks(fn, marks)
    spans = []
    for _ in range(reps + 1):        # the first: the marks' compile and warm-up
        clean_ms(marked, reps=1, warmup=0, before=before)
        m = marks.cpu().numpy().view(np.uint32).astype(np.int64)
        spans.append(((m[1] - m[0]) % (1 << 32)) / 1e3)
    return float(np.median(spans[1:]))


def read_spans(nbytes: int, reps: int) -> str:
    """Mark-to-mark µs around torch's plain reads of ``nbytes`` (decode_floor.py's)."""
    return ", ".join(f"read {name} {mark_to_mark_us(read, reps):.1f}" for name, read in plain_reads(nbytes).items())


def probed_launch(step, q, cache):
    """(launch, stamps tensor, grid size, zeroer) for `step`'s kernel compiled with the
    probe; zeroer: None, or where the kernel leaves its slots written (FLEXATTN_DECODE_SLOTS=
    caller / parity-caller) the function that zeroes them between launches."""
    from flexattn.core.decode_path import slot_views
    from flexattn.kernels.launch.decode import DecodeRunner
    from flexattn.kernels.decode.sm90 import TIMELINE_STAMPS
    from flexattn.kernels.emit.mod_emit import runtime_args

    plan = step.plan
    cfg = dataclasses.replace(step.config, timeline=True)   # the step's merge (cluster or tickets)
    runner = DecodeRunner(cfg, tvm_ffi=False)
    paged = hasattr(cache, "page_table")
    k, v = (cache.k_pages, cache.v_pages) if paged else (cache.k, cache.v)
    table = cache.page_table if paged else None
    splits = step.num_splits
    groups = plan.batch * plan.kv_heads * plan.m_blocks
    ctas = groups * splits
    sets = 2 if cfg.parity_slots else 1   # (parity slots: two sets of slots, a phase word per group)
    tickets = torch.zeros(sets * groups + ctas * TIMELINE_STAMPS, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device="cuda")
    # (zeroed: the polled merge reads a slot as written once its bits are not zero; laid out
    # as the plan lays its own, parity slots a split's two side by side: slot_views)
    o_slots, lse_slots = (torch.zeros(sets * splits * n, dtype=torch.float32, device="cuda") for n in plan._part_sizes)
    o_part, lse_part = slot_views(o_slots, lse_slots, splits, sets, plan.part_shapes[0], plan._group_major)
    args = runtime_args(cfg.mods, plan._to_device)
    stream = torch.cuda.current_stream().cuda_stream

    def launch():
        runner.run(q, k, v, table, plan.seq_lens, out, lse, o_part, lse_part, tickets, plan.scale, args, stream)

    stamps = tickets[sets * groups:].view(ctas, TIMELINE_STAMPS)
    zeroer = (lambda: (o_slots.zero_(), lse_slots.zero_())) if cfg.caller_empties_slots else None
    return launch, stamps, splits, zeroer


def relative_us(stamps: np.ndarray, cols: list) -> np.ndarray:
    """Stamp columns `cols` (uint32 ns of %globaltimer_lo) as µs from the first CTA's
    entry, safe across the 32-bit wrap."""
    return since_first_entry(stamps[:, cols], stamps)


def since_first_entry(values: np.ndarray, stamps: np.ndarray) -> np.ndarray:
    """``%globaltimer_lo`` readings (uint32 ns: stamps, stream marks) as µs from the first
    CTA's entry in ``stamps``, safe across the 32-bit wrap."""
    base = stamps[:, 0].astype(np.int64).min()
    return ((values.astype(np.int64) - base + (1 << 31)) % (1 << 32) - (1 << 31)) / 1e3


def summarize(stamps: np.ndarray, gbytes: float) -> dict:
    """One launch's stamps [ctas, TIMELINE_STAMPS] (uint32 ns) -> the row's figures in µs."""
    t = stamps[:, :7].astype(np.int64)     # column 7: the CTA's SM
    rel = relative_us(stamps, list(range(7)))
    merged = stamps[:, 6] != 0
    first = np.median(rel[:, 3] - rel[:, 0])
    ends = rel[:, 4]
    steady = gbytes / ((np.median(ends) - np.median(rel[:, 3])) * 1e-6) / 1e3
    return {
        "entry": rel[:, 0].max(), "wave1": float((rel[:, 0] < 5.0).sum()), "first": first,
        # SMs that hold more than one of the launch's CTAs (the block scheduler's placement)
        "shared": float((np.bincount(stamps[:, 7].astype(np.int64)) > 1).sum()),
        "end p0": ends.min(), "end p50": np.median(ends), "end p100": ends.max(),
        "ticket": np.median(rel[:, 5] - rel[:, 4]),
        "merge": np.median(rel[merged, 6] - rel[merged, 5]) if merged.any() else 0.0,
        "done": max(rel[:, 5].max(), rel[merged, 6].max() if merged.any() else 0.0),
        "steady": steady,
        # the timer's step: 1000 if %globaltimer ticks in µs, ~32 if in ns
        "tick": float(np.diff(np.unique(t[t > 0])).min()) if (t > 0).sum() > 1 else 0.0,
        "end mean": ends.mean(), "end p10": np.percentile(ends, 10),
        # entry -> the split's range known (length read, masked-prefix analysis)
        "range": np.median(relative_us(stamps, [11])[:, 0] - rel[:, 0]),
        # entry -> producer start, Q in shared memory, the first K block's TMA issued
        "prod": np.median(rel[:, 1] - rel[:, 0]), "q": np.median(rel[:, 2] - rel[:, 0]),
        "issue": np.median(relative_us(stamps, [12])[:, 0] - rel[:, 0]),
        # entry -> the first block's K and V arrived (the consumer's waits done)
        "k1": np.median(relative_us(stamps, [17])[:, 0] - rel[:, 0]),
        "v1": np.median(relative_us(stamps, [18])[:, 0] - rel[:, 0]),
        # stream end -> the partial normalized (the stores' start; "ticket" ends when issued)
        "norm": np.median(relative_us(stamps, [15])[:, 0] - rel[:, 4]),
        # polled mergers: the last split's partial stores issued -> its first row seen
        # written, and the polling rounds that took
        "seen": polled_seen(stamps, rel, merged),
        "rounds": float(np.median(stamps[merged, 14])) if polled_probe(stamps, merged) else 0.0,
        # polled mergers: first row seen -> merged row stored (before emptying the slots)
        "out": (float(np.median(relative_us(stamps, [16])[merged, 0] - relative_us(stamps, [13])[merged, 0]))
                if polled_probe(stamps, merged) else 0.0),
    }


def polled_seen(stamps: np.ndarray, rel: np.ndarray, merged: np.ndarray) -> float:
    """Median over groups (CTAs in runs of the split count, one merger each): the group's
    last partial issued (its CTAs' latest stamp 5) -> its merger saw the first row written
    (stamp 13). 0 without the probe."""
    if not polled_probe(stamps, merged):
        return 0.0
    groups = int(merged.sum())
    last_issued = rel[:, 5].reshape(groups, -1).max(axis=1)
    seen = relative_us(stamps, [13])[merged, 0]      # mergers in CTA order: one per group, in order
    return float(np.median(seen - last_issued))


def polled_probe(stamps: np.ndarray, merged: np.ndarray) -> bool:
    """Whether the merging CTAs stamped the polled merge's probe (13: seen, 14: rounds)."""
    return bool(merged.any() and (stamps[merged, 14] > 0).all())


def lead_and_trail(stamps: np.ndarray, marks: np.ndarray, done: float) -> dict:
    """``stream_marks``' two stamps around the launch -> lead (mark before -> first CTA
    entry) and trail (last stamp, ``done`` µs after the first entry -> mark after), µs."""
    rel = since_first_entry(marks, stamps)
    return {"lead": -rel[0], "trail": rel[1] - done}


def cta_lines(stamps: np.ndarray, splits: int, groups: int) -> list:
    """One launch's first ``groups`` groups, CTA by CTA (split order; "M": the merging CTA),
    µs from the first entry: entry, K / V of the first block in, first block consumed,
    stream end, partial normalized, partial stores issued (or, merging, the merge's start),
    and merging CTAs' first row seen written, merged row stored, merge end: which split ends
    last, and what the merger waits for."""
    cols = [0, 17, 18, 3, 4, 15, 5, 13, 16, 6]
    names = ["entry", "k1", "v1", "first", "end", "norm", "stored", "seen", "out", "merged"]
    rel = since_first_entry(stamps[:, cols], stamps)
    lines = ["group split M " + " ".join(f"{n:>6}" for n in names)]
    for g in range(min(groups, stamps.shape[0] // splits)):
        for sp in range(splits):
            i = g * splits + sp
            merging = stamps[i, 6] != 0
            cells = [f"{rel[i, c]:6.2f}" if (c < 7 or merging) else "     -" for c in range(len(cols))]
            lines.append(f"{g:5d} {sp:5d} {'M' if merging else ' '} " + " ".join(cells))
    return lines


def ends_by_sm(stamps: np.ndarray) -> list:
    """One launch: stream end (µs from the first entry) per SM id, slowest first — whether
    the tail's spread follows the SMs (their place on the chip) or the CTAs' work — and the
    quarters of the stream (first block -> 1/4 -> 1/2 -> 3/4 of the blocks -> end), median
    µs over the early-ending CTAs (stream end > 10 µs before the median) and the others:
    whether the others speed up once the early ones are idle (HBM shared: balancing the
    work gains little) or not (a per-SM or per-GPC limit: it gains the spread)."""
    first, end, q1, q2, q3 = relative_us(stamps, [3, 4, 8, 9, 10]).T
    order = np.argsort(-end)
    lines = [" ".join(f"{int(stamps[i, 7])}:{end[i]:.1f}" for i in order)]
    early = end < np.median(end) - 10.0
    for name, sel in (("early", early), ("others", ~early)):
        if sel.any():
            quarters = [np.median(b[sel] - a[sel]) for a, b in ((first, q1), (q1, q2), (q2, q3), (q3, end))]
            lines.append(f"{name} ({int(sel.sum())} CTAs, end {np.median(end[sel]):.1f}): quarters "
                         + " / ".join(f"{x:.1f}" for x in quarters) + " µs")
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["8x8192"])
    ap.add_argument("--variants", nargs="*", default=["none", "alibi"])
    ap.add_argument("--layouts", nargs="*", default=["contiguous", "paged64"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--merges", nargs="*", default=["cluster", "tickets", "polled"])
    ap.add_argument("--tuning", default=None, help="tile_n x stages x CTAs/SM, e.g. 64x6x1 (default: the planner's)")
    ap.add_argument("--splits", type=int, default=None, help="split count (default: the planner's)")
    ap.add_argument("--by-sm", action="store_true", help="also print each row's stream end per SM (3 launches)")
    ap.add_argument("--dump-ctas", type=int, default=0, metavar="GROUPS",
                    help="print the first launch's first GROUPS groups CTA by CTA (cta_lines)")
    ap.add_argument("--after-flush", choices=("none", "gemm", "gemm-add", "smem", "l1"), default="none",
                    help="what runs between each flush and each launch (decode_floor.py's --after-flush)")
    ap.add_argument("--marks", action="store_true",
                    help="stream marks before and after each probed launch: the lead and trail columns")
    args = ap.parse_args()
    from flexattn.core import decode_path
    from flexattn.core.decode_path import DEFAULT_TUNING, DecodeTuning

    print(f"# {device_name()}, tuning {args.tuning or 'default'}, splits {args.splits or 'planned'}, "
          f"after the flush: {args.after_flush}")
    after = after_flush_step(args.after_flush)
    cols = ["kernel", "plain", "entry", "wave1", "shared", "range", "prod", "issue", "q", "k1", "v1", "first", "end p0",
            "end p10", "end mean", "end p50", "end p100", "ticket", "norm", "seen", "rounds", "out", "merge", "done",
            "steady", "tick"]
    if args.marks:
        cols += ["lead", "trail", "m2m"]
    empty_us = None   # --marks: an empty kernel's mark-to-mark µs, measured once
    print("| B | L | layout | variant | splits | merge | " + " | ".join(cols) + " |")
    print("|" + "---|" * (6 + len(cols)))
    for shape in args.shapes:
        B, L = map(int, shape.split("x"))
        for layout in args.layouts:
            cache, _, _ = make_inputs(B, L, layout)
            q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
            for name, merge in ((n, m) for n in args.variants for m in args.merges):
                mask, score = variant_mods(name)
                base = DEFAULT_TUNING
                if args.tuning:
                    tile_n, stages, per_sm = map(int, args.tuning.split("x"))
                    base = DecodeTuning(tile_n=tile_n, num_stages=stages, ctas_per_sm=per_sm)
                tuning = dataclasses.replace(base, cluster_merge=merge == "cluster")
                os.environ["FLEXATTN_DECODE_MERGE"] = "tickets" if merge == "tickets" else "auto"
                decode_path._PREPARED.clear()   # (a plan reads the merge once)
                step, _ = plan_step(q, cache, score, mask, tuning, args.splits)
                merge = ("cluster" if step.config.cluster_splits > 1 else "polled" if step.config.polled_merge
                         else "tickets")
                plain_zeroer = slots_zeroer(step) if step.config.caller_empties_slots else None
                plain_ms = clean_ms(step.launch, before=plain_zeroer, after_flush=after)
                launch, stamps, splits, zeroer = probed_launch(step, q, cache)
                # (compiles on its warm-up calls)
                kernel_ms = clean_ms(launch, reps=args.reps, before=zeroer, after_flush=after)
                rows, notes = [], []   # (lines printed under the row: --by-sm, --dump-ctas)
                marks = torch.zeros(2, dtype=torch.int32, device="cuda")
                marked = between_marks(launch, marks)   # (the probed launch builds its views per call)
                for rep in range(args.reps):
                    stamps.zero_()
                    clean_ms(marked if args.marks else launch, reps=1, warmup=0, before=zeroer, after_flush=after)
                    launch_stamps = stamps.cpu().numpy().view(np.uint32)
                    rows.append(summarize(launch_stamps, step_bytes(B, L, name) / 1e9))
                    if args.marks:
                        rows[-1].update(lead_and_trail(launch_stamps, marks.cpu().numpy().view(np.uint32),
                                                       rows[-1]["done"]))
                    if args.by_sm and rep < 3:
                        notes += ends_by_sm(launch_stamps)
                    if args.dump_ctas and rep == 0:
                        notes += cta_lines(launch_stamps, splits, args.dump_ctas)
                fig = {c: float(np.median([r[c] for r in rows])) for c in rows[0]}
                fig["kernel"], fig["plain"] = kernel_ms * 1e3, plain_ms * 1e3
                if args.marks:
                    fig["m2m"] = mark_to_mark_us(step.launch, args.reps, plain_zeroer)
                cells = [f"{fig[c]:.2f}" if c == "steady" else f"{fig[c]:.0f}" if c in ("wave1", "shared")
                         else f"{fig[c]:.1f}" for c in cols]
                print(f"| {B} | {L} | {layout} | {name} | {splits} | {merge} | " + " | ".join(cells) + " |", flush=True)
                for line in notes:
                    print(f"#   {line}")
            if args.marks:
                if empty_us is None:   # (launch and completion alone: the same for every row)
                    empty_us = mark_to_mark_us(lambda: torch.cuda._sleep(0), args.reps)
                for name in args.variants:
                    print(f"# {B}x{L} {name}, mark to mark µs: empty {empty_us:.1f}, "
                          + read_spans(step_bytes(B, L, name), args.reps), flush=True)
    print("µs from the first CTA's entry (kernel, plain: µs by CUDA events, probed / production kernel); "
          "steady: TB/s")


if __name__ == "__main__":
    main()
