"""gpt-fast's flex decoding step, written once and run through each library's imports, compiled.

gpt-fast (pytorch-labs) decodes with FlexAttention like this, and compiles the step with
``torch.compile(mode="reduce-overhead", fullgraph=True)``:

    block_mask = create_block_mask(causal, 1, 1, max_len, max_len, device="cuda")   # once
    def decode_one_token(q, input_pos, block_mask):
        mask = block_mask[:, :, input_pos // block_mask.BLOCK_SIZE[0]]
        mask.mask_mod = at_position(block_mask.mask_mod, input_pos[0])
        mask.seq_lengths = (1, max_len)
        return flex_attention(q, k_cache, v_cache, block_mask=mask, enable_gqa=True)

Columns (µs per step, do_bench with L2 flushed; TB/s of the K+V bytes the whole cache
holds, which both libraries read: the step attends positions <= input_pos of a cache of
max_len keys):

  flexattn/<mode>   the step with ``flexattn.torch``'s create_block_mask and flex_attention
  torch/<mode>      the same step with torch's
  flexattn/eager    ours, not compiled (the door, with the slice each call)
  sdpa              SDPA over the cache's prefix up to input_pos (the bytes the mask keeps)

<mode>: ``default`` (inductor) and ``reduce-overhead`` (inductor + CUDA graphs). The step
itself: ``tests/compat_cases.gpt_fast_decode_step``.

    python3 benchmarks/bench_gpt_fast.py [--shapes 8x8192 1x32768] [--skip flexattn/eager] [--out gptfast.json]
"""

import argparse
import datetime
import os
import sys

import torch

from common import bench_ms, device_name, rel_diff, report

# gpt-fast's step is written once, in the torch-compatibility cases the tests compile too.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from compat_cases import gpt_fast_decode_step as decode_step  # noqa: E402

HQ, HKV, D = 32, 8, 128


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["8x8192", "1x32768"], help="B x max_len")
    ap.add_argument("--modes", nargs="+", default=["default", "reduce-overhead"])
    ap.add_argument("--skip", nargs="*", default=[], help="columns to leave out (e.g. flexattn/eager)")
    ap.add_argument("--out")
    args = ap.parse_args()

    import torch.nn.attention.flex_attention as torch_flex
    import flexattn.torch as fa

    def causal(b, h, q, kv):
        return q >= kv

    rows = []
    for spec in args.shapes:
        batch, max_len = (int(x) for x in spec.split("x"))
        k_cache, v_cache = (torch.randn(batch, HKV, max_len, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        pos = max_len - 1 - 37
        q = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
        input_pos = torch.tensor([pos], device="cuda")
        prefix = slice(0, pos + 1)
        want = torch.nn.functional.scaled_dot_product_attention(q, k_cache[:, :, prefix], v_cache[:, :, prefix],
                                                                enable_gqa=True)
        impls = {"sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k_cache[:, :, prefix], v_cache[:, :, prefix], enable_gqa=True)}
        ours_mask = fa.create_block_mask(causal, 1, 1, max_len, max_len, device="cuda")
        torch_mask = torch_flex.create_block_mask(causal, 1, 1, max_len, max_len, device="cuda")
        for mode in args.modes:
            for name, lib, mask in (("flexattn", fa, ours_mask), ("torch", torch_flex, torch_mask)):
                torch._dynamo.reset()
                step = torch.compile(decode_step(lib, k_cache, v_cache, max_len), fullgraph=True,
                                     mode=None if mode == "default" else mode)
                impls[f"{name}/{mode}"] = (lambda step=step, mask=mask: step(q, input_pos, mask))
        # (last: compiled steps of both libraries read slower after a long eager loop in the
        # process, session 50)
        eager = decode_step(fa, k_cache, v_cache, max_len)
        impls["flexattn/eager"] = lambda: eager(q, input_pos, ours_mask)
        impls = {name: fn for name, fn in impls.items() if name not in args.skip}
        row = {"shape": spec, "us": {}, "tbps": {}, "diff": {}}
        nbytes = 2 * batch * HKV * (pos + 1) * D * 2
        for name, fn in impls.items():
            try:
                for _ in range(3):   # compile, warm up (CUDA graphs record on the third call)
                    out = fn()
                row["diff"][name] = rel_diff(out, want)
                ms = bench_ms(fn)
            except Exception as e:   # a column that cannot run: say why, go on
                print(f"{spec} {name}: {type(e).__name__}: {str(e)[:300]}")
                continue
            row["us"][name], row["tbps"][name] = ms * 1e3, nbytes / ms / 1e9
        rows.append(row)

    names = sorted({n for r in rows for n in r["us"]}, key=lambda n: (n != "sdpa", n))
    md = (f"{device_name()}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC: gpt-fast's flex"
          f" decoding step, Hq {HQ} Hkv {HKV} D {D} bf16; µs per step (TB/s of the attended K+V)\n\n"
          "| B x max_len | " + " | ".join(names) + " | rel diff vs sdpa |\n|---|" + "---|" * (len(names) + 1) + "\n")
    for r in rows:
        cells = [f"{r['us'][n]:.1f} ({r['tbps'][n]:.2f})" if n in r["us"] else "—" for n in names]
        diffs = ", ".join(f"{n} {r['diff'][n]:.1e}" for n in names if n != "sdpa" and n in r["diff"])
        md += f"| {r['shape']} | " + " | ".join(cells) + f" | {diffs} |\n"
    report(md, rows, args.out, f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}")


if __name__ == "__main__":
    main()
