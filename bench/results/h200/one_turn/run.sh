#!/usr/bin/env bash
# One device call: mosaic_v3's GPU tests at this tree, then the forward, out/base against
# this tree, each in its own process beside cuDNN and tokamax (bench.ab).
# Usage: bash run.sh OUT [bench.ab cases]
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
out=$1
cat VERSION.json out/base/VERSION.json; echo
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
stub=$(mktemp -d)
mkdir -p "$stub/xprof/cli" && touch "$stub/xprof/__init__.py" "$stub/xprof/cli/__init__.py"
echo "get_kernel_stats_tool = None" >"$stub/xprof/cli/tools.py"
timeout 200 python -m pytest -q -p no:cacheprovider -n 12 tests/test_mosaic.py -k gpu 2>&1 |
    tee "$out/gpu_tests_mosaic.log" | tail -3
PYTHONPATH=.:$stub timeout ${AB_TIMEOUT:-330} python -m bench.ab out/base . --only "${@:2}" --modes fwd \
    --out "$out/ab.json" 2>&1 | grep -v "^WARNING:absl\|^\[bench\]" > "$out/ab.log"
grep -v "^\[bench\]" "$out/ab.log" | tail -24
