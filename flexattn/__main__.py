"""``python -m flexattn``: a one-minute tour on the CPU.

Builds a composed mask, shows its block sparsity, runs attention with a chained score mod
on the reference path and checks it against a naive softmax written out by hand.
Exit status 1 if they disagree. ``--plot FILE.png`` also draws the mask (matplotlib).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import flexattn
from flexattn import mods


def naive_attention(q, k, v, allowed, bias, cap, scale):
    """Softmax attention spelled out: scores, ALiBi bias, softcap, mask, softmax, weighted sum."""
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = cap * np.tanh((s + bias) / cap)
    s = np.where(allowed, s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    return (p / p.sum(-1, keepdims=True)) @ v


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flexattn", description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024, help="sequence length (default 1024)")
    parser.add_argument("--plot", metavar="FILE", help="save a picture of the mask and its blocks")
    args = parser.parse_args(argv)
    S, H, D = args.seq, 4, 64
    rng = np.random.default_rng(0)

    lengths = [S // 2, S // 4, S - S // 2 - S // 4]  # three packed documents
    mask = mods.causal() & mods.sliding_window(S // 4) & mods.document_from_lengths(lengths)
    score = mods.alibi(num_heads=H) >> mods.softcap(20.0)
    print(f"mask : {mask}\nscore: {score}\n")

    t0 = time.perf_counter()
    block_mask = flexattn.create_block_mask(mask, None, None, S, S, BLOCK_SIZE=128)
    t1 = time.perf_counter()
    print(block_mask)
    print(f"built in {1e3 * (t1 - t0):.1f} ms; {block_mask.sparsity():.1f}% of tiles skipped;"
          f" {100 * block_mask.density():.2f}% of (q, kv) pairs attended\n")

    q, k, v = (rng.standard_normal((1, H, S, D)) for _ in range(3))
    t0 = time.perf_counter()
    out = flexattn.flex_attention(q, k, v, score_mod=score, block_mask=block_mask)
    t1 = time.perf_counter()

    qi, ki = np.arange(S)[:, None], np.arange(S)[None, :]
    doc = np.repeat(np.arange(3), lengths)
    allowed = (qi >= ki) & (qi - ki <= S // 4) & (doc[qi] == doc[ki])
    bias = mods.alibi_slopes(H)[:, None, None] * (ki - qi)
    want = naive_attention(q, k, v, allowed, bias, 20.0, 1 / np.sqrt(D))
    err = float(np.abs(out - want).max())
    ok = err < 1e-9
    print(f"flex_attention (reference path) in {t1 - t0:.2f} s; max |out - naive softmax| = {err:.2e}"
          f" -> {'OK' if ok else 'MISMATCH'}")

    if args.plot:
        _plot(mask, block_mask, S, args.plot)
    return 0 if ok else 1


def _plot(mask, block_mask, S, path):
    try:
        from .plotting import plot_mask_and_blocks

        fig = plot_mask_and_blocks(mask, S, S, block_mask=block_mask)
    except ImportError as e:  # matplotlib is optional
        print(e, file=sys.stderr)
        return
    fig.savefig(path, dpi=80)
    print(f"saved {path}")


if __name__ == "__main__":
    sys.exit(main())
