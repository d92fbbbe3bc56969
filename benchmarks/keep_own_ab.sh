#!/usr/bin/env bash
# Session 66: the polled merger keeping its own partial on chip (DecodeConfig.merger_keeps_own)
# against storing and polling it back (FLEXATTN_DECODE_KEEP_OWN=0), decode_floor.py's rows in
# alternating processes, then the timeline with stream marks. Device tool, carry [".gpu"]:
#   bash benchmarks/keep_own_ab.sh [rounds]
cd "$(dirname "$0")"
for i in $(seq "${1:-3}"); do
  for keep in 0 1; do
    FLEXATTN_DECODE_KEEP_OWN=$keep timeout 90 python3 decode_floor.py --rows 1x131072:window4096 8x8192:window4096 \
      2>&1 | grep -E "^\| [0-9]" | sed "s/^/keep_own=$keep /"
  done
done
for keep in 0 1; do
  FLEXATTN_DECODE_KEEP_OWN=$keep timeout 90 python3 decode_timeline.py --shapes 1x131072 --variants window4096 \
    --layouts contiguous --merges polled --reps 9 --marks 2>&1 | grep -E "^\| 1|mark to mark" | sed "s/^/keep_own=$keep /"
done
