#!/usr/bin/env bash
# The check's standard grid (head dims 64 and 128, 4K and 16K, causal and not), forward and
# forward+backward, cuDNN and tokamax beside, at the head with the dK/dV heads-first grid.
# Usage: bash check_grid.sh OUT
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=$1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
cat VERSION.json; echo
python -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
stub=$(mktemp -d)
mkdir -p "$stub/xprof/cli" && touch "$stub/xprof/__init__.py" "$stub/xprof/cli/__init__.py"
echo "get_kernel_stats_tool = None" >"$stub/xprof/cli/tools.py"
PYTHONPATH=.:$stub timeout 420 python -m bench.check --only d64_4k d64_16k d128_4k d128_16k --modes fwd fwdbwd \
  --out "$out/check_grid.json" 2>&1 | grep -v "^WARNING:absl\|^\[bench\]\|Autotuning cache miss" | tee "$out/check_grid.log" | tail -22
