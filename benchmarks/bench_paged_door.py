"""torch's PagedAttention decoding step through each library's door, one process, one GPU.

A torch user decodes from a paged cache with ``torch.nn.attention.experimental.
_paged_attention.PagedAttention``: one physical cache [1, Hkv, pages x page, D] that every
sequence's pages live in, a q_len-1 query [B, Hq, 1, D], and a block mask over logical
positions converted to physical pages (``convert_logical_block_mask``: its lists name each
sequence's pages, its mask_mod maps physical keys back through the page map). Pages of
128 here, handed out to the sequences in turn (interleaved, as a serving loop fills them).

  flexattn      flexattn.torch.flex_attention(q, k_cache, v_cache, block_mask=converted,
                enable_gqa=True), exactly the torch call: the key / value batch of 1
                broadcasts, and the short-query route walks each sequence's listed pages
                with the decode kernel (core/short_query.py: list_walk_route)
  flexattn-fwd  the same call with that walk turned off: the forward kernel reads the lists
  flexattn-compiled  a serving step compiled with our imports (fullgraph, inductor) that
                converts the logical block mask inside the graph: the graph walks the
                converted lists on the device (flexattn/torch/graph_walk.py)
  flexattn-decode  flexattn.torch.decode over a PagedKVCache of the same pages (views of the
                physical cache, torch's page table, no mask): our paged step's own speed
  flex          torch's flex_attention compiled, same arguments (flex decoding)
  flex-step     torch's flex_attention in the same compiled serving step as flexattn-compiled
                (the conversion in the graph)
  sdpa          SDPA over the logical cache [B, Hkv, L, D] (contiguous, enable_gqa): the
                speed of the same bytes without pages

``--blocks gptfast``: gpt-fast's batched step instead (``gpt_fast_step``: views of a batched
contiguous cache, a causal block mask of batch 1 cut to the current row; the door's walk
folds the batch into the heads), and ``flexattn-decode`` = ``fa.decode`` over a ``KVCache``
of the same views.

TB/s count the K+V bytes a step needs: 2 · B · Hkv · L · D · 2 bytes (median of triton's
do_bench, L2 flushed). The last column is each output's relative difference from SDPA's.

    python3 benchmarks/bench_paged_door.py [--shapes 8x8192 8x32768 1x131072] [--out paged.json]
    python3 benchmarks/bench_paged_door.py --shapes 8x8192 8x32768 --blocks gptfast
    python3 benchmarks/bench_paged_door.py --shapes 8x8192 --blocks partial --prefill 4x8192 2x32768
"""

import argparse
import datetime

import torch

from common import bench_ms, cprofile_calls, cprofile_lines, device_name, rel_diff, report

HQ, HKV, D, PAGE = 32, 8, 128, 128


def paged_caches(batch: int, length: int):
    """torch's PagedAttention with ``length`` positions per sequence (pages handed to the
    sequences in turn), its physical caches filled from random logical ones:
    (paged, k_cache, v_cache, logical k, logical v)."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention

    pages = batch * length // PAGE
    paged = PagedAttention(pages, PAGE, batch, device="cuda")
    for chunk in range(length // PAGE):       # the sequences take pages in turn
        for b in range(batch):
            paged.reserve(torch.tensor(b, device="cuda"), torch.tensor((chunk + 1) * PAGE, device="cuda"))
    k_cache, v_cache = (torch.zeros(1, HKV, pages * PAGE, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(batch, HKV, length, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    paged.assign(torch.arange(batch, device="cuda"), torch.arange(length, device="cuda")[None].expand(batch, length),
                 k, v, k_cache, v_cache)
    return paged, k_cache, v_cache, k, v


def paged_step(batch: int, length: int, full_blocks: bool):
    """(q, physical k / v caches, converted block mask, logical k / v, page table) of one
    step. ``full_blocks``: the logical mask built over a block of query rows and cut to one
    (as gpt-fast slices its mask per step: blocks below each length listed full); else
    built for the one query (torch lists every block partial)."""
    from torch.nn.attention.flex_attention import create_block_mask

    paged, k_cache, v_cache, k, v = paged_caches(batch, length)
    lengths = torch.full((batch,), length, device="cuda")
    logical = create_block_mask(lambda b, h, qi, ki: ki < lengths[b], batch, None, PAGE if full_blocks else 1, length,
                                device="cuda", BLOCK_SIZE=PAGE)
    logical.seq_lengths = (1, length)
    q = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    return q, k_cache, v_cache, paged.convert_logical_block_mask(logical), k, v, paged.page_table, (paged, logical)


def paged_prefill(batch: int, length: int, chunk: int):
    """A prefill chunk: each sequence's last ``chunk`` queries (at length - chunk + i),
    causal, against its ``length`` keys through torch's PagedAttention: (q, physical k / v
    caches, converted block mask, logical k / v, the logical block mask, the chunk's
    boolean mask [chunk, length] for SDPA)."""
    from torch.nn.attention.flex_attention import create_block_mask

    paged, k_cache, v_cache, k, v = paged_caches(batch, length)
    start = length - chunk
    logical = create_block_mask(lambda b, h, qi, ki: ki <= qi + start, batch, None, chunk, length, device="cuda",
                                BLOCK_SIZE=PAGE)
    q = torch.randn(batch, HQ, chunk, D, device="cuda", dtype=torch.bfloat16)
    dense = torch.arange(length, device="cuda")[None, :] <= torch.arange(chunk, device="cuda")[:, None] + start
    return q, k_cache, v_cache, paged.convert_logical_block_mask(logical), k, v, logical, dense


def prefill_table(shapes, chunk: int, compiled_flex) -> str:
    """The prefill rows: TFLOP/s (µs) of the door (the forward kernel over the broadcast
    physical cache and the converted lists, its mask reading the page map once per tile
    and row), torch's
    compiled flex on the same arguments, the same door over the logical contiguous caches
    with the logical block mask (``flexattn-logical``: the cost of the pages), and SDPA with
    the chunk's boolean mask over the logical caches."""
    import flexattn.torch as fa
    from flexattn.blockmask.layout import as_block_mask

    names = ["flexattn", "flexattn-logical", "sdpa", "flex"]
    md = (f"Prefill chunks of {chunk} queries (causal at the sequence's end), TFLOP/s (µs)\n\n"
          "| B x L | " + " | ".join(names) + " | flexattn / flex | flexattn / flexattn-logical | rel diff vs sdpa |\n"
          "|---|" + "---|" * (len(names) + 3) + "\n")
    for spec in shapes:
        batch, length = (int(x) for x in spec.split("x"))
        q, k_cache, v_cache, physical, k, v, logical, dense = paged_prefill(batch, length, chunk)
        start = length - chunk
        flops = 4 * batch * HQ * D * sum(start + i + 1 for i in range(chunk))
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
        ours = as_block_mask(logical)
        impls = {
            "flexattn": lambda: fa.flex_attention(q, k_cache, v_cache, block_mask=physical, enable_gqa=True),
            "flexattn-logical": lambda: fa.flex_attention(q, k, v, block_mask=ours, enable_gqa=True),
            "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True),
            "flex": lambda: compiled_flex(q, k_cache, v_cache, block_mask=physical, enable_gqa=True),
        }
        cells, tflops, diffs = [], {}, []
        for name in names:
            try:
                diff = rel_diff(impls[name](), sdpa)
                ms = bench_ms(impls[name])
            except Exception as e:   # a column that cannot run this shape: say so, go on
                print(f"prefill {spec} {name}: {type(e).__name__}: {e}")
                cells.append("—")
                continue
            tflops[name] = flops / ms / 1e9
            cells.append(f"{tflops[name]:.1f} ({ms * 1e3:.1f})")
            if name != "sdpa":
                diffs.append(f"{name} {diff:.1e}")

        def ratio(a, b):
            return f"{tflops[a] / tflops[b]:.2f}" if a in tflops and b in tflops else "—"
        md += (f"| {spec} | " + " | ".join(cells) + f" | {ratio('flexattn', 'flex')} | "
               f"{ratio('flexattn', 'flexattn-logical')} | {', '.join(diffs)} |\n")
    return md


def gpt_fast_step(batch: int, length: int):
    """gpt-fast's decoding step: q [B, Hq, 1, D] at position length - 1 against views of a
    preallocated batched cache [B, Hkv, 2 x length, D], a causal block mask of batch 1 cut to
    the current row with its mask_mod moved to the position (ours and torch's, built alike)."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    import flexattn.torch as fa

    cache_k, cache_v = (torch.randn(batch, HKV, 2 * length, D, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
    k, v = cache_k[:, :, :length], cache_v[:, :, :length]
    offset = torch.tensor(length - 1, device="cuda")
    masks = []
    for build in (fa.create_block_mask, torch_create_block_mask):
        row = build(lambda b, h, qi, ki: qi >= ki, 1, 1, length, length, device="cuda")[:, :, (length - 1) // PAGE]
        row.mask_mod = lambda b, h, qi, ki: qi + offset >= ki
        row.seq_lengths = (1, length)
        masks.append(row)
    q = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    return q, k, v, masks[0], masks[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["8x8192", "8x32768", "1x131072"])
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--blocks", nargs="+", default=["partial", "full"],
                    help="how the logical mask lists its blocks (see paged_step); gptfast: gpt-fast's batched "
                         "step instead (gpt_fast_step)")
    ap.add_argument("--prefill", nargs="*", metavar="BxL",
                    help="also a prefill chunk through the door at these shapes (default 4x8192), see prefill_table")
    ap.add_argument("--chunk", type=int, default=512, help="the prefill chunk's queries")
    ap.add_argument("--profile", action="store_true",
                    help="also a cProfile of 200 flexattn-compiled steps per shape (top entries by cumulative time)")
    ap.add_argument("--out")
    args = ap.parse_args()

    import flexattn.torch as fa
    import flexattn.torch.attention as fa_attention
    import flexattn.torch.devices as fa_devices
    from flexattn.core import short_query
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    compiled_flex = torch.compile(torch_flex)
    real_walk = short_query.list_walk_route, short_query.prepared_list_walk
    rows = []
    for spec, blocks in [(s, b) for s in args.shapes for b in args.blocks]:
        batch, length = (int(x) for x in spec.split("x"))
        if blocks == "gptfast":
            q, k, v, block_mask, torch_mask = gpt_fast_step(batch, length)
            k_cache, v_cache = k, v
            cache = fa.KVCache(k, v, torch.full((batch,), length, dtype=torch.int32))
        else:
            q, k_cache, v_cache, block_mask, k, v, page_table, (paged, logical) = paged_step(batch, length,
                                                                                              blocks == "full")
            torch_mask = block_mask
            pages = [fa_devices._page_view(x, PAGE) for x in (k_cache, v_cache)]
            cache = fa.PagedKVCache(*pages, page_table[:, :length // PAGE].to(torch.int32).contiguous(),
                                    torch.full((batch,), length, dtype=torch.int32))
        nbytes = 2 * batch * HKV * length * D * 2
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        impls = {
            "flexattn": lambda: fa.flex_attention(q, k_cache, v_cache, block_mask=block_mask, enable_gqa=True),
            "flexattn-fwd": lambda: fa.flex_attention(q, k_cache, v_cache, block_mask=block_mask, enable_gqa=True),
            "flexattn-decode": lambda: fa.decode(q, cache),
            "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        }
        if blocks != "gptfast":
            # a serving step compiled with our imports, converting its block mask in the graph
            # (the graph walks the converted lists on the device: flexattn/torch/graph_walk.py)
            def serving_step(q, k_cache, v_cache, paged=paged, logical=logical):
                return fa.flex_attention(q, k_cache, v_cache, block_mask=paged.convert_logical_block_mask(logical),
                                         enable_gqa=True)
            compiled_step = torch.compile(serving_step, fullgraph=True)
            impls["flexattn-compiled"] = lambda: compiled_step(q, k_cache, v_cache)
            if not args.no_flex:
                def torch_step(q, k_cache, v_cache, paged=paged, logical=logical):
                    return torch_flex(q, k_cache, v_cache, block_mask=paged.convert_logical_block_mask(logical),
                                      enable_gqa=True)
                compiled_torch_step = torch.compile(torch_step, fullgraph=True)
                impls["flex-step"] = lambda: compiled_torch_step(q, k_cache, v_cache)
        if not args.no_flex:
            impls["flex"] = lambda: compiled_flex(q, k_cache, v_cache, block_mask=torch_mask, enable_gqa=True)
        row = {"shape": spec, "blocks": blocks, "tbps": {}, "us": {}, "diff": {}}
        for name, fn in impls.items():
            fa_attention._PREPARED.clear()     # the door's prepared calls: made afresh under each column's route
            if name == "flexattn-fwd":
                short_query.list_walk_route = short_query.prepared_list_walk = lambda *a, **kw: None
            try:
                row["diff"][name] = rel_diff(fn(), sdpa)
                ms = bench_ms(fn)
            except Exception as e:   # a column that cannot run this shape: say so, go on
                print(f"{spec} {name}: {type(e).__name__}: {e}")
                continue
            finally:
                short_query.list_walk_route, short_query.prepared_list_walk = real_walk
            row["us"][name], row["tbps"][name] = ms * 1e3, nbytes / ms / 1e9
        if args.profile and "flexattn-compiled" in impls:
            prof, _ = cprofile_calls(impls["flexattn-compiled"], 200)
            torch.cuda.synchronize()
            print(f"==== {spec} {blocks}: flexattn-compiled, cProfile of 200 steps")
            print("\n".join(cprofile_lines(prof, ("cumulative",), 30)))
        rows.append(row)

    names = ["flexattn", "flexattn-fwd", "flexattn-compiled", "flexattn-decode", "sdpa"] + \
        ([] if args.no_flex else ["flex", "flex-step"])
    md = (f"{device_name()}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC: torch PagedAttention"
          f" step, Hq {HQ} Hkv {HKV} D {D} bf16, pages of {PAGE}; TB/s (µs)\n\n"
          "| B x L | blocks | " + " | ".join(names) + " | flexattn / flex | flexattn / sdpa | rel diff vs sdpa |\n"
          "|---|---|" + "---|" * (len(names) + 3) + "\n")
    for r in rows:
        t = r["tbps"]
        cells = [f"{t[n]:.2f} ({r['us'][n]:.1f})" if n in t else "—" for n in names]
        vs_flex = f"{t['flexattn'] / t['flex']:.2f}" if "flex" in t and "flexattn" in t else "—"
        diffs = ", ".join(f"{n} {r['diff'][n]:.1e}" for n in names if n != "sdpa" and n in r["diff"])
        vs_sdpa = f"{t['flexattn'] / t['sdpa']:.2f}" if "flexattn" in t and "sdpa" in t else "—"
        md += f"| {r['shape']} | {r['blocks']} | " + " | ".join(cells) + f" | {vs_flex} | {vs_sdpa} | {diffs} |\n"
    if args.prefill is not None:
        md += "\n" + prefill_table(args.prefill or ["4x8192"], args.chunk, compiled_flex)
    report(md, rows, args.out, f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}")


if __name__ == "__main__":
    main()
