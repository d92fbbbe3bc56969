"""The context-parallel schedules' elementwise bookkeeping on row slices of [B, H, S, D]
(issue 26): a row slice of every head is strided (one run of rows per head), so torch takes
its non-vectorized elementwise path, one element per thread step. This measures copies as
they are and through wider views of the same bytes (int64, complex128: 4 / 8 bf16 per
element), and the in-place adds of 16-bit rows, in GB/s of bytes read + written.

    python3 benchmarks/bench_row_copies.py [--seq 65536] [--heads 16] [--dim 128]
"""

import argparse
import datetime

import torch

from common import bench_ms, device_name


def wide(x, dtype):
    return x.view(dtype) if dtype is not None else x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    args = ap.parse_args()
    S, H, D = args.seq, args.heads, args.dim
    c = S // 4
    x = torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC  {device_name()}  "
          f"B1 H{H} S{S} D{D} bf16, chunks of {c} rows")
    print("| operation | as bf16 | int64 view | complex128 view |")
    print("|---|---|---|---|")
    views = (None, torch.int64, torch.complex128)
    chunk_bytes = H * c * D * 2

    def row(name, make, nbytes):
        cells = []
        for dt in views:
            fn = make(dt)
            ms = bench_ms(fn)
            cells.append(f"{ms * 1e3:.0f} µs, {nbytes / ms / 1e6:.0f} GB/s")
        print(f"| {name} | " + " | ".join(cells) + " |")

    # a send's staging: three of four chunks laid end to end (torch.cat of row slices)
    row("cat 3 chunks (send staging)",
        lambda dt: lambda: torch.cat([wide(x[:, :, a * c:(a + 1) * c], dt) for a in (0, 2, 3)], dim=2),
        3 * chunk_bytes * 2)
    # a run of rows made contiguous (.contiguous() of a slice)
    row("contiguous(1 chunk)", lambda dt: lambda: wide(x[:, :, c:2 * c], dt).contiguous(), chunk_bytes * 2)
    # a contiguous contribution copied into the result's rows (assign_rows)
    part = torch.randn(1, H, c, D, device="cuda", dtype=torch.bfloat16)
    row("rows <- contribution (1 chunk)", lambda dt: lambda: wide(out[:, :, c:2 * c], dt).copy_(wide(part, dt)),
        chunk_bytes * 2)
    # two contributions summed into the result's rows (16-bit; no wider view applies)
    cells = []
    heads_out, heads_part = list(out[:, :, c:2 * c].view(H, c, D).unbind(0)), list(part.view(H, c, D).unbind(0))
    for name, fn in (("add_(strided)", lambda: out[:, :, c:2 * c].add_(y[:, :, c:2 * c])),
                     ("add(out=strided)", lambda: torch.add(x[:, :, c:2 * c], part, out=out[:, :, c:2 * c])),
                     ("_foreach_add_ per head", lambda: torch._foreach_add_(heads_out, heads_part)),
                     ("add contiguous", lambda: torch.add(part, part, out=part))):
        ms = bench_ms(fn)
        cells.append(f"{name} {ms * 1e3:.0f} µs, {3 * chunk_bytes / ms / 1e6:.0f} GB/s")
    print("| 16-bit adds (1 chunk) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
