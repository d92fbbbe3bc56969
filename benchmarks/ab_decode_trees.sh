#!/usr/bin/env bash
# decode_floor.py's rows (ours beside torch's plain read of the same bytes) for two source
# trees in alternating processes, each tree with its own kernel cache: a kernel change
# A/B'd where an environment switch would add a config field. BASE holds the other tree's
# flexattn/ (e.g. `git archive HEAD flexattn | tar -x -C .ab_base`, carried). Device tool,
# after `source .gpu/activate.sh`:
#   bash benchmarks/ab_decode_trees.sh BASE ROUNDS ROW [ROW...]
base=$(cd "$1" && pwd); rounds=$2; shift 2
cd "$(dirname "$0")"
for i in $(seq "$rounds"); do
  for tree in new base; do
    root=$([ "$tree" = base ] && echo "$base" || (cd .. && pwd))
    FLEXATTN_CACHE_DIR=/tmp/flexattn-ab-$tree PYTHONPATH="$root:$PYTHONPATH" timeout 90 \
      python3 decode_floor.py --rows "$@" 2>&1 | grep -E "^\| [0-9]" | sed "s/^/$tree /"
  done
done
