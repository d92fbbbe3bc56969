"""Block-mask builds on the GPU, beside torch's ``create_block_mask``, in one process.

  flexattn         flexattn.create_block_mask(mask, ..., device="cuda") (interval analysis +
                   early-exit element evaluation + list compaction, CuTeDSL kernels)
  flexattn-varlen  flexattn.blockmask.varlen_block_mask(offsets, device="cuda") (document
                   only: closed-form tile states from the offsets, lists compacted on the GPU)
  torch            torch.nn.attention.flex_attention.create_block_mask(fn, ..., device="cuda")
  torch-compile    the same with _compile=True

Milliseconds per build, steady state (after warm-up and compilation): wall clock over
repeated builds with the GPU synchronized at the end, so host work counts as it does in a
training step. B=1, H=1, BLOCK_SIZE=128; masks: causal, causal sliding window 1024,
document (S/2048 random documents, not causal), prefix-LM (prefix S/4). Every build's
lists are compared with torch's (counts, and the listed indices).

    python3 benchmarks/bench_blockmask.py [--lengths 8192 32768 131072] [--out results.json] [--budget-s 120]
"""

import argparse
import datetime
import time
import traceback

import numpy as np
import torch

from common import report
from results_log import RECORD_HELP, append_rows, blockmask_rows, utc_stamp

MASKS = ("causal", "window1024", "document", "prefix_lm")
IMPLS = ("flexattn", "flexattn-varlen", "torch", "torch-compile")
LISTS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
         "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def offsets_for(S: int) -> np.ndarray:
    rng = np.random.default_rng(S)
    n = max(2, S // 2048)
    return np.concatenate([[0], np.sort(rng.choice(np.arange(1, S), n - 1, replace=False)), [S]])


def masks(name: str, S: int):
    """(our mask mod, torch's mask function) of one variant."""
    from flexattn import mods

    if name == "causal":
        return mods.causal(), lambda b, h, q, kv: q >= kv
    if name == "window1024":
        return mods.causal() & mods.sliding_window(1024), lambda b, h, q, kv: (q >= kv) & (q - kv <= 1024)
    if name == "document":
        off = offsets_for(S)
        ids = torch.from_numpy(mods.document_ids_from_offsets(off)).cuda()
        return mods.document_from_offsets(off), lambda b, h, q, kv: ids[q] == ids[kv]
    if name == "prefix_lm":
        p = S // 4
        return mods.prefix_lm(p), lambda b, h, q, kv: (kv < p) | (q >= kv)
    raise KeyError(name)


def builder(impl: str, name: str, S: int):
    import flexattn.torch as fa
    from flexattn.blockmask import varlen_block_mask
    from torch.nn.attention.flex_attention import create_block_mask as torch_cbm

    ours, fn = masks(name, S)
    if impl == "flexattn":
        return lambda: fa.create_block_mask(ours, None, None, S, S, device="cuda")
    if impl == "flexattn-varlen":
        if name != "document":
            return None
        off = offsets_for(S)
        return lambda: varlen_block_mask(off, device="cuda")
    if impl == "torch":
        return lambda: torch_cbm(fn, None, None, S, S, device="cuda")
    if impl == "torch-compile":
        return lambda: torch_cbm(fn, None, None, S, S, device="cuda", _compile=True)
    raise KeyError(impl)


def wall_ms(fn, budget_s: float = 0.5, max_reps: int = 200):
    """(steady-state ms per call, first-call seconds, last result)."""
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    first = time.perf_counter() - t
    out = fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t, 1e-6)
    reps = int(min(max_reps, max(2, budget_s / one)))
    t = time.perf_counter()
    for _ in range(reps):
        out = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3, first, out


def lists_match(ours, theirs) -> bool:
    """Counts equal and the listed indices equal (the order of the unlisted rest is free)."""
    for name in LISTS[0::2]:
        a, b = getattr(ours, name), getattr(theirs, name)
        a = torch.as_tensor(a).cuda()
        if not torch.equal(a.to(torch.int32), b.to(torch.int32)):
            return False
    for num_name, idx_name in zip(LISTS[0::2], LISTS[1::2]):
        num = getattr(theirs, num_name).long()
        a = torch.as_tensor(getattr(ours, idx_name)).cuda().long()
        b = getattr(theirs, idx_name).long()
        listed = torch.arange(b.shape[-1], device=b.device) < num[..., None]
        if not torch.equal(torch.where(listed, a, 0), torch.where(listed, b, 0)):
            return False
    return True


def table(rows, dev, stamp) -> str:
    cells = {(r["mask"], r["S"], r["impl"]): r for r in rows}
    keys = sorted({(r["mask"], r["S"]) for r in rows}, key=lambda k: (MASKS.index(k[0]), k[1]))
    head = "| mask | S | " + " | ".join(f"{i} ms" for i in IMPLS) + " | speedup vs best torch |"
    lines = [f"Block-mask build, B=1 H=1 BLOCK_SIZE=128, ms per build (steady state, host included) — {dev}, {stamp}",
             "", head, "|" + "---|" * (len(IMPLS) + 3)]
    for mask, S in keys:
        vals = []
        for impl in IMPLS:
            r = cells.get((mask, S, impl))
            if r is None:
                vals.append("—")
            elif r.get("ms") is None:
                vals.append(r.get("note", "n/a"))
            else:
                vals.append(f"{r['ms']:.3f}" + ("" if r.get("match", True) else " (lists differ!)"))
        ours = [cells[(mask, S, i)]["ms"] for i in IMPLS[:2] if cells.get((mask, S, i), {}).get("ms") is not None]
        theirs = [cells[(mask, S, i)]["ms"] for i in IMPLS[2:] if cells.get((mask, S, i), {}).get("ms") is not None]
        speed = f"{min(theirs) / min(ours):.1f}x" if ours and theirs else "—"
        lines.append(f"| {mask} | {S} | " + " | ".join(vals) + f" | {speed} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", nargs="*", type=int, default=[8192, 32768, 131072])
    ap.add_argument("--masks", nargs="*", default=list(MASKS), choices=MASKS)
    ap.add_argument("--impls", nargs="*", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--out", default=None, help="write rows + markdown table as JSON")
    ap.add_argument("--budget-s", type=float, default=600.0, help="skip what would start after this many seconds")
    ap.add_argument("--record", action="store_true", help=RECORD_HELP)
    args = ap.parse_args()
    start = time.perf_counter()
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    dev = torch.cuda.get_device_name()
    rows = []
    # ours first (cheap), then torch eager, then torch compiled (slow first calls): whatever the budget allows
    for impl in args.impls:
        # torch-compile's first calls take seconds: its longest length first, where it matters most
        for S in (sorted(args.lengths, reverse=True) if impl == "torch-compile" else args.lengths):
            for name in args.masks:
                row = {"mask": name, "S": S, "impl": impl}
                if time.perf_counter() - start > args.budget_s:
                    row.update(ms=None, note="skipped (time)")
                    rows.append(row)
                    continue
                try:
                    fn = builder(impl, name, S)
                    if fn is None:
                        continue
                    ms, first, bm = wall_ms(fn, budget_s=0.3)
                    row.update(ms=ms, first_call_s=first)
                    if impl.startswith("flexattn") and "torch" in args.impls:
                        try:
                            row["match"] = lists_match(bm, builder("torch", name, S)())
                        except Exception as e:  # noqa: BLE001  (torch's builder may run out of memory)
                            row["match_note"] = f"not compared: {type(e).__name__}"
                            torch.cuda.empty_cache()
                    print(f"{impl:16s} {name:11s} S={S:6d}: {ms:9.3f} ms  (first call {first:.2f} s)"
                          + ("" if row.get("match", True) else "  LISTS DIFFER"), flush=True)
                    del bm
                except Exception as e:  # noqa: BLE001  (one failing cell must not lose the table)
                    traceback.print_exc()
                    row.update(ms=None, note=type(e).__name__)
                    torch.cuda.empty_cache()
                rows.append(row)
    report(table(rows, dev, stamp), rows, args.out, stamp)
    if args.record:
        append_rows("blockmask", blockmask_rows(rows), script="bench_blockmask.py", device=dev, date=utc_stamp())


if __name__ == "__main__":
    main()
