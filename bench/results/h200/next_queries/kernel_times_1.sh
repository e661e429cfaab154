#!/usr/bin/env bash
# Kernel times (profiler) of the persistent window rows, four versions in two rounds, each
# version in its own process; then the Mosaic GPU tests at the head (736029e).
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=$1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
cat VERSION.json; echo
python -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
stub=$(mktemp -d)
mkdir -p "$stub/xprof/cli" && touch "$stub/xprof/__init__.py" "$stub/xprof/cli/__init__.py"
echo "get_kernel_stats_tool = None" >"$stub/xprof/cli/tools.py"
script=bench/results/h200/next_queries/kernel_times.py
for round in 1 2; do
  for v in base h1 h2only head; do
    dir=out/$v; [ $v = head ] && dir=.
    PYTHONPATH=$dir:.:$stub timeout 70 python $script "$out/traces" $v 2>&1 | grep -v "^WARNING\|^\[bench\]\|Autotuning" | tee -a "$out/kernel_times.log"
  done
done
rm -rf "$out/traces"
PYTHONPATH=. timeout 220 python -m pytest -q -p no:cacheprovider -n 12 tests/test_mosaic.py -k gpu 2>&1 | tee "$out/gpu_tests_mosaic_736029e.log" | tail -3
