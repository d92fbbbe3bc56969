"""A mask's own kernel against one shared "bits" kernel (issue 24: a new mod's first call,
partial tiles): is a mask of packed bits a usable first tier?

Any mask over (q, kv) that ignores b and h can be written as a mask of its packed rows,
``((words[q, kv >> 5] >> (kv & 31)) & 1) == 1`` over a captured int32 array
``words[Q_LEN, KV_LEN / 32]``. Every such mask traces to the same IR, so one compiled
attention kernel serves them all (per block structure): a new mask would cost the block
mask's build and the packing, not an attention kernel's compile. The price is a global load
per element in partial tiles. This script measures both sides, in one process on the GPU,
for bench_fwd's torch-style masks (B4 S4096 H16 D128 bf16, forward):

- ``own``: the door with the mask's function (its kernel compiled on its first call);
- ``bits``: the door with the bits mask of the same elements (the same block lists; its
  kernel compiled once, on the first variant's first call);
- the first call of each (seconds, in this process's order: the bits kernel is compiled
  by the first variant only), the forward's ms, and the outputs' difference.

    python3 benchmarks/bits_mask_tier.py [--variants window1024 dilated1024 neighborhood2d document5]
"""

import argparse
import math
import time

import torch

from common import bench_ms, device_name, rel_diff

B, S, H, D = 4, 4096, 16, 128
IMAGE_WIDTH = 64


def mask_fn(name: str):
    """bench_fwd's torch-style masks (those over q and kv only), and documents whose
    boundaries fall inside tiles."""
    if name == "window1024":
        return lambda b, h, q, kv: (q >= kv) & (q - kv <= 1024)
    if name == "dilated1024":
        return lambda b, h, q, kv: ((q - kv).abs() <= 512) & ((q - kv) % 2 == 0)
    if name == "neighborhood2d":
        w = IMAGE_WIDTH
        return lambda b, h, q, kv: (((q // w) - (kv // w)).abs() <= 8) & (((q % w) - (kv % w)).abs() <= 8)
    if name == "document5":
        doc = torch.arange(S, device="cuda") * 5 // S
        return lambda b, h, q, kv: doc[q] == doc[kv]
    raise ValueError(f"unknown variant {name}")


def packed_rows(dense: torch.Tensor) -> torch.Tensor:
    """[Q, KV] bool -> int32 [Q, KV / 32]: bit j of word w is element (q, 32 w + j)."""
    q_len, kv_len = dense.shape
    words = (dense.reshape(q_len, kv_len // 32, 32).to(torch.int64) << torch.arange(32, device=dense.device)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)   # (two's complement)


def bits_mask(words: torch.Tensor):
    def mask(b, h, q, kv):
        return ((words[q, kv >> 5] >> (kv & 31)) & 1) == 1
    return mask


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="*", default=["window1024", "dilated1024", "neighborhood2d", "document5"])
    args = ap.parse_args()
    import flexattn.torch as fa

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    scale = 1.0 / math.sqrt(D)
    fa.flex_attention(q, k, v, scale=scale)      # warm-up: CuTeDSL, the dense kernel
    torch.cuda.synchronize()
    rows = []
    for name in args.variants:
        fn = mask_fn(name)
        words = packed_rows(fa.create_mask(fn, None, None, S, S, device="cuda")[0, 0])
        own_bm = fa.create_block_mask(fn, None, None, S, S, device="cuda")
        bits_bm = fa.create_block_mask(bits_mask(words), None, None, S, S, device="cuda")
        row = {"variant": name, "density": own_bm.density()}
        outs = {}
        for impl, bm in (("own", own_bm), ("bits", bits_bm)):
            call = lambda bm=bm: fa.flex_attention(q, k, v, block_mask=bm, scale=scale)  # noqa: E731
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs[impl] = call()
            torch.cuda.synchronize()
            row[f"{impl} first s"] = time.perf_counter() - t0
            row[f"{impl} ms"] = bench_ms(call)
        row["diff"] = rel_diff(outs["bits"], outs["own"])
        rows.append(row)
        print(row, flush=True)
    print(f"\nForward, B{B} S{S} H{H} D{D} bf16, {device_name()}: a mask's own kernel against the shared bits kernel\n")
    print("| variant | density | own ms | bits ms | bits / own | own first s | bits first s | rel diff |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['density']:.3f} | {r['own ms']:.3f} | {r['bits ms']:.3f} | "
              f"{r['bits ms'] / r['own ms']:.2f} | {r['own first s']:.2f} | {r['bits first s']:.2f} | {r['diff']:.1e} |")


if __name__ == "__main__":
    main()
