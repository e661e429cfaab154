#!/usr/bin/env bash
# The forward's windows again, three versions in pairs (bench.ab: each in its own
# process, cuDNN and tokamax beside it): out/base (d9d3132's jaxtile), out/h2only (base
# without Pallas's automatic barriers), . (736029e: that and the next tile's queries
# loaded under the last step, 729309a). d128_4k_full (not persistent) as a control.
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=$1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
cat VERSION.json; echo
filter() { grep -v "^WARNING:absl\|^\[bench\]\|Autotuning cache miss"; }
python -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
stub=$(mktemp -d)
mkdir -p "$stub/xprof/cli" && touch "$stub/xprof/__init__.py" "$stub/xprof/cli/__init__.py"
echo "get_kernel_stats_tool = None" >"$stub/xprof/cli/tools.py"
export PYTHONPATH=.:$stub
for pair in "out/base out/h2only" "out/h2only ." "out/base ."; do
  name=$(echo "$pair" | tr ' /' '_-')
  timeout 170 python -m bench.ab $pair --out "$out/ab_$name.json" --only window d128_4k_full --modes fwd 2>&1 \
    | filter | tee "$out/ab_$name.log" | tail -8
done
