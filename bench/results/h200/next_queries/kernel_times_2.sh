#!/usr/bin/env bash
# Kernel times of the persistent window rows, base (d9d3132) and the head (729309a's
# kernels), two more rounds each in its own process; then persistent programs on the long
# rows at the head (persistent_long.py).
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=$1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
cat VERSION.json; echo
python -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
stub=$(mktemp -d)
mkdir -p "$stub/xprof/cli" && touch "$stub/xprof/__init__.py" "$stub/xprof/cli/__init__.py"
echo "get_kernel_stats_tool = None" >"$stub/xprof/cli/tools.py"
script=bench/results/h200/next_queries/kernel_times.py
for round in 2 3; do
  for v in base head; do
    dir=out/$v; [ $v = head ] && dir=.
    PYTHONPATH=$dir:.:$stub timeout 70 python $script "$out/traces" $v-$round 2>&1 | grep -v "^WARNING\|^\[bench\]\|Autotuning" | tee -a "$out/kernel_times.log"
  done
done
rm -rf "$out/traces"
PYTHONPATH=. timeout 330 python bench/results/h200/next_queries/persistent_long.py 2>&1 | grep -v "^WARNING\|^\[bench\]" | tee "$out/persistent_long.log"
