#!/usr/bin/env bash
# Kernel times of the other persistent calls (short_rows.py): d9d3132 (out/base) and the
# head (729309a's kernels), alternated, two rounds, each version in its own process.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=$1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
cat VERSION.json; echo
script=bench/results/h200/next_queries/short_rows.py
for round in 1 2; do
  for v in base head; do
    dir=out/$v; [ $v = head ] && dir=.
    PYTHONPATH=$dir:. timeout 100 python $script "$out/traces" $v-$round 2>&1 | grep -v "^WARNING\|^\[bench\]" | tee -a "$out/short_rows.log"
  done
done
rm -rf "$out/traces"
