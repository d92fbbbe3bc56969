"""Where short queries should leave the forward kernel for the decode kernel.

``flexattn.torch.flex_attention(q, k, v)`` with q_len tokens against a long cache, timed
twice in one process: as routed (the decode kernel up to ``short_query.SHORT_QUERY_MAX``
tokens) and with the route closed (the forward kernel). Hq 32, Hkv 8 (GQA), D 128, bf16,
no mods and a torch-style causal-at-the-end mask. TB/s count the K+V bytes read once.

    python3 benchmarks/bench_short_query.py [--shapes 8x8192 1x131072] [--q-lens 1 4 16 32]
"""

import argparse
import datetime
import math

import torch

from common import bench_ms, device_name, report

HQ, HKV, D = 32, 8, 128


def run(B, L, q_lens, rows):
    import flexattn.torch as fa
    from flexattn.core import short_query

    torch.manual_seed(0)
    k = torch.randn(B, HKV, L, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    gbytes = 2 * B * HKV * L * D * 2 / 1e9
    opened = short_query.SHORT_QUERY_MAX
    for q_len in q_lens:
        q = torch.randn(B, HQ, q_len, D, device="cuda", dtype=torch.bfloat16)
        off = L - q_len
        end_causal = fa.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx + off >= kv_idx, None, None, q_len, L,
                                          device="cuda")
        for variant, bm in (("none", None), ("causal-at-end", end_causal)):
            row = {"B": B, "L": L, "q_len": q_len, "variant": variant}
            for route, limit in (("decode", max(opened, q_len)), ("forward", 0)):
                short_query.SHORT_QUERY_MAX = limit
                try:
                    fn = lambda: fa.flex_attention(q, k, v, block_mask=bm, scale=1 / math.sqrt(D), enable_gqa=True)  # noqa: E731
                    out = fn()
                    torch.cuda.synchronize()
                    row[route] = bench_ms(fn, 25, 100)
                    row[route + "_out"] = out
                except Exception as e:  # noqa: BLE001 (the decode kernel takes at most 16 tokens)
                    row[route] = None
                    print(f"{route} q_len {q_len}: {type(e).__name__}: {str(e)[:120]}")
                finally:
                    short_query.SHORT_QUERY_MAX = opened
            if row.get("decode_out") is not None and row.get("forward_out") is not None:
                a, b = row.pop("decode_out").float(), row.pop("forward_out").float()
                row["rel_diff"] = ((a - b).norm() / b.norm()).item()
            row.pop("decode_out", None), row.pop("forward_out", None)
            for route in ("decode", "forward"):
                if row.get(route):
                    row[route + "_tbps"] = gbytes / row[route]
            print(row, flush=True)
            rows.append(row)


def table(rows, stamp):
    lines = [f"Short queries, Hq {HQ} Hkv {HKV} D {D} bf16, flex_attention door — ms (TB/s of K+V) "
             f"({device_name()}, {stamp})", "",
             "| B | L | q_len | variant | decode kernel | forward kernel | forward / decode |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for route in ("decode", "forward"):
            ms = r.get(route)
            cells.append("—" if not ms else f"{ms:.3f} ({r[route + '_tbps']:.2f})")
        ratio = f"{r['forward'] / r['decode']:.2f}" if r.get("decode") and r.get("forward") else "—"
        lines.append(f"| {r['B']} | {r['L']} | {r['q_len']} | {r['variant']} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["8x8192", "1x131072"], help="BxL")
    ap.add_argument("--q-lens", nargs="*", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for shape in args.shapes:
        B, L = map(int, shape.split("x"))
        run(B, L, args.q_lens, rows)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    report(table(rows, stamp), rows, args.out, stamp)


if __name__ == "__main__":
    main()
