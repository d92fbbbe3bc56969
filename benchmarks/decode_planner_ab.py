"""The decode planner against its session-11 rule, shape by shape, in alternating rounds.

Session 12 changed how a step's launch is planned (``core/decode_path``):
* splits are sized by the kv blocks the kernel visits (``live_blocks``: a sliding window
  leaves 65 of 2048 blocks at 128k keys), not by the cache's length;
* splits keep 256+ keys (was 512);
* where the default tuning (64x2x2) needs 4 splits or more and the deep one (64x6x1)
  needs at most half as many, the deep one is taken (was: only 4 -> 2).

``previous`` below is the session-11 rule, kept here as the baseline. Each row times both
launches (kernel alone, read-only L2 flush before each call, as bench_decode's ``/c``)
in ``--rounds`` alternating rounds and reports the median of the round medians.

    python3 benchmarks/decode_planner_ab.py [--rounds 3]
"""

import argparse
import dataclasses

import numpy as np
import torch

from bench_decode import D, HKV, HQ, clean_ms, make_inputs, plan_step, step_bytes, variant_mods
from common import device_name

SHAPES = [  # (B, L, layout, variant)
    (1, 131072, "contiguous", "window4096"), (1, 131072, "paged64", "window4096"),
    (1, 8192, "contiguous", "window4096"), (1, 131072, "contiguous", "none"),
    (1, 131072, "paged64", "none"), (1, 4096, "contiguous", "none"), (1, 8192, "contiguous", "none"),
    (1, 16384, "contiguous", "none"), (2, 32768, "contiguous", "none"), (4, 131072, "contiguous", "none"),
    (8, 8192, "contiguous", "none"), (8, 1024, "contiguous", "none"),
]


def previous(batch, kv_heads, kv_blocks, sms):
    """Session 11's (tuning, splits, cluster): 512+ keys per split over the cache's whole
    length; the deep tuning only where the default needs exactly 4 splits."""
    from flexattn.core.decode_path import DEFAULT_TUNING, ONE_CTA_TUNING

    def splits_for(tuning):
        ctas = batch * kv_heads
        slots = sms * tuning.ctas_per_sm * tuning.waves
        s = max(1, min(slots // ctas, kv_blocks // max(1, 512 // tuning.tile_n)))
        per = -(-kv_blocks // s)
        return -(-kv_blocks // per)

    s = splits_for(DEFAULT_TUNING)
    if s == 2:
        return DEFAULT_TUNING, 2, 2
    if s == 4 and splits_for(ONE_CTA_TUNING) == 2:
        return ONE_CTA_TUNING, 2, 2
    return DEFAULT_TUNING, s, 1


def forced(q, cache, score, mask, launch):
    """A step planned with exactly this (tuning, splits, cluster)."""
    tuning, splits, cluster = launch
    tuning = dataclasses.replace(tuning, cluster_merge=cluster > 1)
    step, _ = plan_step(q, cache, score, mask, tuning, splits)
    assert step.num_splits == splits and step.config.cluster_splits == cluster, (step.config, launch)
    return step


def label(launch):
    tuning, splits, cluster = launch
    return f"{tuning.tile_n}x{tuning.num_stages}x{tuning.ctas_per_sm} {splits}{' pair' if cluster == 2 else ''}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    from flexattn.core.decode_path import DecodeTuning

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"# {device_name()}, {sms} SMs; kernel µs (read-only L2 flush), median of {args.rounds} alternating rounds")
    print("| B | L | layout | variant | session 11 | µs | planner now | µs | TB/s before → now |")
    print("|---|---|---|---|---|---|---|---|---|")
    for B, L, layout, name in SHAPES:
        cache, _, _ = make_inputs(B, L, layout)
        q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
        mask, score = variant_mods(name)
        new_step, _ = plan_step(q, cache, score, mask)
        cfg = new_step.config
        new = (DecodeTuning(cfg.tile_n, cfg.num_stages, cfg.ctas_per_sm), new_step.num_splits, cfg.cluster_splits)
        old = previous(B, HKV, -(-L // 64), sms)
        steps = {"old": forced(q, cache, score, mask, old), "new": new_step}
        times = {k: [] for k in steps}
        for _ in range(args.rounds):
            for k, step in steps.items():
                times[k].append(clean_ms(step.launch, reps=args.reps) * 1e3)
        us = {k: float(np.median(v)) for k, v in times.items()}
        gbytes = step_bytes(B, L, name) / 1e9
        print(f"| {B} | {L} | {layout} | {name} | {label(old)} | {us['old']:.1f} | {label(new)} | {us['new']:.1f} | "
              f"{gbytes / us['old'] * 1e3:.2f} → {gbytes / us['new'] * 1e3:.2f} |", flush=True)


if __name__ == "__main__":
    main()
