"""Warp-stall samples per SASS instruction, kernel beside kernel, from Nsight Compute.

Reads the CSV of ncu's source page (one section per profiled kernel) and prints, for each
kernel: its samples by stall reason; by opcode (samples, instructions executed, the
reasons asked for); its longest back-to-back runs of one opcode (``--runs MUFU``: the
exponentials a step issues in a row); the instructions with the most samples of a reason.
Session 38 found D64's backward MUFU batching this way (docs/experiments.md).

On the device (carry .gpu), e.g. our backward and FA4's at D64:

    cd benchmarks
    ncu --profile-from-start off --clock-control none -k regex:"bwdsm90|bwd_sm90" \\
        --section SourceCounters --section WarpStateStats -o $OUT/src \\
        python3 ncu_step.py --shape 4x4096x16x64 --variants causal --impls flexattn fa4 --mode fwdbwd
    ncu -i $OUT/src.ncu-rep --page source --csv --print-source sass | gzip > $OUT/sass.csv.gz

Then anywhere:

    python3 benchmarks/ncu_stalls.py sass.csv.gz [--reasons stall_wait stall_mio] [--top stall_wait] [--runs MUFU]
"""

import argparse
import collections
import csv
import gzip


def read_kernels(path: str) -> list:
    """[(kernel name, header, rows)] of the CSV: a "Kernel Name" line opens each section,
    its "Address" line is the header, instruction rows start with their address."""
    opener = gzip.open if path.endswith(".gz") else open
    kernels = []
    with opener(path, "rt", newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                kernels.append((row[1], None, []))
            elif row[0] == "Address" and kernels:
                kernels[-1] = (kernels[-1][0], row, kernels[-1][2])
            elif row[0].startswith("0x") and kernels:
                kernels[-1][2].append(row)
    return kernels


def opcode(source: str) -> str:
    """The instruction's opcode without its predicate and modifiers ("@!P0 MUFU.EX2 R1, R2" -> "MUFU")."""
    words = source.split()
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", help="ncu --page source --print-source sass --csv output (.gz or plain)")
    ap.add_argument("--reasons", nargs="*", default=["stall_wait", "stall_mio", "stall_barrier", "stall_long_sb"],
                    help="stall columns shown per opcode")
    ap.add_argument("--top", nargs="*", default=[], help="stall columns whose top instructions are listed")
    ap.add_argument("--runs", default="MUFU", help="opcode whose back-to-back runs are counted")
    ap.add_argument("--name-chars", type=int, default=70)
    args = ap.parse_args()
    for name, header, rows in read_kernels(args.csv):
        col = {h: i for i, h in enumerate(header)}
        count = lambda row, c: int(row[col[c]] or 0)  # noqa: E731
        reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
        by_reason = collections.Counter({r: sum(count(row, r) for row in rows) for r in reasons})
        total = sum(count(row, "# Samples") for row in rows)
        print(f"\n## {name[:args.name_chars]}\n{len(rows)} instructions, {total} samples")
        print("by reason: " + ", ".join(f"{r[6:]} {n}" for r, n in by_reason.most_common() if n))
        ops = collections.defaultdict(lambda: [0, 0] + [0] * len(args.reasons))
        for row in rows:
            agg = ops[opcode(row[col["Source"]])]
            agg[0] += count(row, "# Samples")
            agg[1] += count(row, "Instructions Executed")
            for i, r in enumerate(args.reasons):
                agg[2 + i] += count(row, r)
        print("| opcode | samples | executed (M) | " + " | ".join(r[6:] for r in args.reasons) + " |")
        print("|---|---|---|" + "---|" * len(args.reasons))
        for op, agg in sorted(ops.items(), key=lambda kv: -kv[1][0])[:20]:
            print(f"| {op} | {agg[0]} | {agg[1] / 1e6:.2f} | " + " | ".join(str(x) for x in agg[2:]) + " |")
        runs, run = [], 0
        for row in rows:
            if opcode(row[col["Source"]]) == args.runs:
                run += 1
            elif run:
                runs.append(run)
                run = 0
        runs += [run] if run else []
        print(f"{args.runs} back to back, longest runs: {sorted(runs, reverse=True)[:10]}")
        for reason in args.top:
            print(f"top {reason}:")
            for row in sorted(rows, key=lambda row: -count(row, reason))[:15]:
                print(f"  {count(row, reason):6d}  {row[col['Source']].strip()[:90]}")


if __name__ == "__main__":
    main()
