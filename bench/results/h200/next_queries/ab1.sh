#!/usr/bin/env bash
# Two changes, each A/B'd in its own processes (bench.ab), cuDNN beside each version:
#   1. out/base (d9d3132's jaxtile) against out/h1 (729309a: the persistent forward loads the
#      next tile's queries under the tile's last step), on the persistent rows (the windows),
#      with tokamax (the (256, 256) window's peer);
#   2. out/h1 against . (736029e: also no automatic barriers in the Mosaic kernels), on the
#      windows and the standard rows' forward and forward+backward, without tokamax.
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=$1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
cat VERSION.json; echo
filter() { grep -v "^WARNING:absl\|^\[bench\]\|Autotuning cache miss"; }
python -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
stub=$(mktemp -d)
mkdir -p "$stub/xprof/cli" && touch "$stub/xprof/__init__.py" "$stub/xprof/cli/__init__.py"
echo "get_kernel_stats_tool = None" >"$stub/xprof/cli/tools.py"
PYTHONPATH=.:$stub timeout 250 python -m bench.ab out/base out/h1 --out "$out/ab1_base_vs_729309a.json" \
  --only window_256 window_1023 --modes fwd fwdbwd 2>&1 | filter | tee "$out/ab1_base_vs_729309a.log" | tail -14
timeout 320 python -m bench.ab out/h1 . --out "$out/ab1_729309a_vs_736029e.json" \
  --only window_256 d128_16k_causal d128_4k_full gqa d64_4k_full --modes fwd fwdbwd 2>&1 | filter | tee "$out/ab1_729309a_vs_736029e.log" | tail -26
