#!/usr/bin/env bash
# The head's GPU tests (Mosaic) and the check's window rows (forward and forward+backward,
# tokamax and cuDNN beside) after the last kernel edit (729309a's kernels).
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=$1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
cat VERSION.json; echo
python -c "import jaxtile; print(jaxtile.__file__)"
timeout 230 python -m pytest -q -p no:cacheprovider -n 12 tests/test_mosaic.py -k gpu 2>&1 | tee "$out/gpu_tests_mosaic.log" | tail -3
python -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
stub=$(mktemp -d)
mkdir -p "$stub/xprof/cli" && touch "$stub/xprof/__init__.py" "$stub/xprof/cli/__init__.py"
echo "get_kernel_stats_tool = None" >"$stub/xprof/cli/tools.py"
PYTHONPATH=.:$stub timeout 200 python -m bench.check --only window --modes fwd fwdbwd --out "$out/check_windows.json" 2>&1 \
  | grep -v "^WARNING:absl\|^\[bench\]\|Autotuning cache miss" | tee "$out/check_windows.log" | tail -9
