"""How fast can any kernel move a decode step's bytes, timed as bench_decode.py times ours?

For each row of the decode table, the K+V bytes a step needs (bench_decode.py's count:
the window rows need the window's 4097 keys) and, each timed by ``clean_ms`` (CUDA events
around one launch after a read-only L2 flush):

  empty      a kernel that does nothing (``torch.cuda._sleep(0)``): launch and completion
             as the events see them, the floor of every row
  read       the fastest of torch's plain reductions over a buffer of exactly those bytes
             (int64 sum, int32 max): a stream with nothing to compute and one tiny output,
             the ceiling a decode kernel can hope for
  ours       the planned decode step's kernel (bench_decode.py's "flexattn-k/c")

  bound      bytes / (empty + bytes / R), R the rate of the fastest plain read of 2 GiB
             (or of any row, if faster): launch and completion plus a stream at the best
             average rate measured, with no ramp, no tail and no merge — to beat it a
             kernel would have to stream faster than any plain read measured here

TB/s = bytes / µs. A row whose "bound" stays under a target shows that the target cannot
hold there for any kernel timed this way; "read" shows what a plain stream gets.

    python3 benchmarks/decode_floor.py [--rows 8x8192:none 1x131072:window4096 ...] [--splits N] [--short-by N]

``--zero-slots`` zeroes the polled merge's slots before each timed step (outside the events);
with ``FLEXATTN_DECODE_SLOTS=caller`` the kernel then skips its own emptying
(``DecodeConfig.caller_empties_slots``): what the merger's emptying costs, by its absence;
with ``parity-caller`` the parity kernel skips its zeroing (the plan's parity slots,
both sets, are zeroed instead).

``--after-flush gemm`` runs a small bf16 matmul (cuBLAS, 256³: 384 KB touched) between each
flush and each timed launch, for every kernel timed (empty, read, ours, SDPA with ``--sdpa``);
``gemm-add`` then a tiny elementwise kernel too (a decoder's order: the projection, RoPE or
the append, attention). It asks what the kernel before a step costs the step: the flush is
a reduction with little shared memory, like the read. H200, session 74 (B1 L128k window):
after the matmul ours and SDPA took ~0.7 µs longer and the read did not; after the add the
read was ~0.4 µs faster (docs/experiments.md, Decode, session 74). ``smem`` / ``l1`` run an empty
kernel instead that leaves the SMs' L1 / shared-memory split at all shared memory (carveout 100, 100 KB per
CTA) / all L1 (carveout 0): whether a kernel's start pays for switching that split (session 75's hypothesis for
the matmul's +0.7 µs). H200, session 76: ours ~0.35 µs faster after either (B1 L128k window), SDPA and an empty
kernel slower, and the CTAs' own timeline unchanged (decode_timeline.py --after-flush): not a split switch.
"""

import argparse
import dataclasses

import torch

from bench_decode import D, HQ, baselines, clean_ms, make_inputs, plan_step, slots_zeroer, step_bytes, variant_mods
from common import device_name

ROWS = ["8x8192:none", "8x8192:window4096", "8x65536:none", "8x65536:window4096",
        "1x131072:none", "1x131072:window4096", "1x8192:none", "8x1024:none"]


def plain_reads(nbytes) -> dict:
    """torch's plain read-only reductions over a buffer of exactly `nbytes`, by name: the
    "read" every decode row is judged against (here and in decode_timeline.py's marks)."""
    buf = torch.ones(nbytes // 8, dtype=torch.int64, device="cuda")
    as_i32 = buf.view(torch.int32)
    return {"int64 sum": lambda: buf.sum(), "int32 amax": lambda: as_i32.amax()}


def best_read_ms(nbytes, reps, after_flush=None):
    """The fastest plain read-only reduction of `nbytes` (median µs of each, best of them)."""
    return min(clean_ms(read, reps=reps, after_flush=after_flush) for read in plain_reads(nbytes).values())


def shared_memory_config_step(carveout: int, smem_bytes: int):
    """A launch of an empty kernel on every SM (two CTAs each) with ``smem_bytes`` of dynamic
    shared memory and a preferred carveout of ``carveout`` percent: it leaves the SMs' L1 /
    shared-memory split where that kernel wants it, so the next kernel starts from a known
    configuration (``--after-flush smem`` / ``l1``: does the timed kernel pay to switch it?)."""
    from cuda.bindings import driver

    from flexattn.kernels.hopper.device_facts import driver_checker, load_empty_kernel, primary_context

    ok = driver_checker("the shared-memory config step")
    torch.cuda.synchronize()   # (torch's CUDA state up: its context is the device's primary one, kept retained)
    with primary_context(torch.cuda.current_device(), ok) as dev:
        module, fn, _ = load_empty_kernel(ok, dev, smem_bytes, carveout)
    ctas = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    _FLOOR_MODULES.append(module)        # (kept loaded for the process)

    def launch():
        stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
        ok(driver.cuLaunchKernel(fn, ctas, 1, 1, 32, 1, 1, smem_bytes, stream, None, 0))

    return launch


_FLOOR_MODULES = []


def after_flush_step(kind: str):
    """What runs between the L2 flush and each timed launch (``--after-flush``): None, a
    small cuBLAS matmul (large shared memory; 384 KB touched, a trace of the 50 MB L2), or an
    empty kernel that sets the SMs' shared-memory split (``smem``: all shared memory, 100 KB
    per CTA; ``l1``: carveout 0, no shared memory)."""
    if kind == "none":
        return None
    if kind == "smem":
        return shared_memory_config_step(100, 100 << 10)
    if kind == "l1":
        return shared_memory_config_step(0, 0)
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    if kind == "gemm":
        return lambda: a @ a
    b = torch.zeros(256, device="cuda")

    def gemm_then_add():   # (a decoder's step: the projection, then an elementwise kernel — RoPE, the append)
        a @ a
        b.add_(1)

    return gemm_then_add


def _shortened(cache, keys: int):
    """``cache`` with every sequence ``keys`` shorter, its memory unchanged."""
    from flexattn import KVCache, PagedKVCache

    lengths = cache.lengths - keys
    if isinstance(cache, KVCache):
        return KVCache(cache.k, cache.v, lengths)
    return PagedKVCache(cache.k_pages, cache.v_pages, cache.page_table, lengths)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="*", default=ROWS)
    ap.add_argument("--layout", default="contiguous")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--zero-slots", action="store_true",
                    help="zero the polled merge's slots before each timed step (outside the events); "
                         "with FLEXATTN_DECODE_SLOTS=caller the kernel leaves them written: the "
                         "merger's emptying measured by its absence")
    ap.add_argument("--short-by", type=int, default=0,
                    help="sequences this many keys below the cache's capacity (a cache preallocated past them: "
                         "the bound block reads rows past the length; bytes and the read stay the full row's)")
    ap.add_argument("--after-flush", choices=("none", "gemm", "gemm-add", "smem", "l1"), default="none",
                    help="gemm: a small matmul between each flush and each timed launch; gemm-add: then an "
                         "elementwise kernel too; smem / l1: an empty kernel that sets the SMs' shared-memory "
                         "split to all shared memory / all L1 (module doc)")
    ap.add_argument("--sdpa", action="store_true", help="also time torch SDPA on the row (its µs on the row's # line)")
    ap.add_argument("--splits", type=int, default=None,
                    help="our kernel with this many splits (default tuning, merged without a cluster) "
                         "instead of the planner's")
    args = ap.parse_args()
    tuning = None
    if args.splits:   # (the default tuning, merged without a cluster)
        from flexattn.core import decode_path

        tuning = dataclasses.replace(decode_path.DEFAULT_TUNING, cluster_merge=False)
    after = after_flush_step(args.after_flush)
    empty_us = clean_ms(lambda: torch.cuda._sleep(0), reps=args.reps, after_flush=after) * 1e3
    rows = []
    for row in args.rows:
        shape, variant = row.split(":")
        B, L = map(int, shape.split("x"))
        nbytes = step_bytes(B, L, variant)
        read_us = best_read_ms(nbytes, args.reps, after) * 1e3
        cache, k, v = make_inputs(B, L, args.layout)
        if args.short_by:
            cache = _shortened(cache, args.short_by)
        q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
        mask, score = variant_mods(variant)
        step, _ = plan_step(q, cache, score, mask, tuning=tuning, num_splits=args.splits)
        before = slots_zeroer(step) if args.zero_slots else None
        ours_us = clean_ms(step.launch, reps=args.reps, before=before, after_flush=after) * 1e3
        sdpa = ""
        if args.sdpa and k is not None:
            fn = baselines(variant, q, k, v, L, 1 / D ** 0.5, fa4=False, flex=False)["sdpa"]
            sdpa = f", sdpa {clean_ms(fn, reps=args.reps, after_flush=after) * 1e3:.2f} µs"
        del cache, step, k, v
        rows.append((B, L, variant, nbytes, read_us, ours_us))
        print(f"# {row}: read {read_us:.2f} µs, ours {ours_us:.2f} µs{sdpa}", flush=True)
    reference = 2 << 30     # a long read: its ramp is a small part of it
    rate = max([reference / (best_read_ms(reference, args.reps, after) * 1e3)]
               + [nbytes / read_us for *_, nbytes, read_us, _ in rows])   # bytes per µs
    print(f"\n{device_name()}, {args.layout}, after the flush: {args.after_flush}; empty kernel {empty_us:.1f} µs, "
          f"fastest read {rate / 1e6:.2f} TB/s (CUDA events, clean L2)")
    print("| B | L | variant | MB | bound TB/s | read µs | read TB/s | ours µs | ours TB/s | ours / read |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for B, L, variant, nbytes, read_us, ours_us in rows:
        bound = nbytes / (empty_us + nbytes / rate) / 1e6
        print(f"| {B} | {L} | {variant} | {nbytes / 1e6:.1f} | {bound:.2f} | {read_us:.2f} | "
              f"{nbytes / read_us / 1e6:.2f} | {ours_us:.2f} | {nbytes / ours_us / 1e6:.2f} | "
              f"{read_us / ours_us:.1%} |")

if __name__ == "__main__":
    main()
