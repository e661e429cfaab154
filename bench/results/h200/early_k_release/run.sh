#!/usr/bin/env bash
# One device call: ptxas's log of the overlap variants (880fbe2, out/overlap), then the
# forward's K_j slot freed before the turn's wait (.) against cf95bb5 (out/base): bench.ab
# (each version in its own process, cuDNN and tokamax beside), then the kernels' own
# times under the profiler, one round. Usage: bash run.sh OUT
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
here=bench/results/h200/early_k_release
out=$1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
cat VERSION.json; echo
filter() { grep -v "^WARNING:absl\|^\[bench\]\|Autotuning cache miss"; }
for variant in registers smem; do
  d=$(mktemp -d)
  (cd out/overlap && MOSAIC_GPU_DUMP_TO=$d MOSAIC_GPU_DUMP_PTXAS=1 PYTHONPATH=. \
    timeout 100 python bench/results/h200/overlap_c7513/overlap.py dump $variant 2>&1 | tail -1)
  cp $d/*.ptxas "$out/ptxas_overlap_$variant.log"; cat "$out/ptxas_overlap_$variant.log"
done
python -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
stub=$(mktemp -d)
mkdir -p "$stub/xprof/cli" && touch "$stub/xprof/__init__.py" "$stub/xprof/cli/__init__.py"
echo "get_kernel_stats_tool = None" >"$stub/xprof/cli/tools.py"
PYTHONPATH=.:$stub timeout 280 python -m bench.ab out/base . --out "$out/ab_cf95bb5_vs_early_k.json" \
  --only d128_4k_full d128_16k_causal gqa window_256 window_1023 --modes fwd 2>&1 | filter | tee "$out/ab_cf95bb5_vs_early_k.log" | tail -14
rows="d128_4k_full d128_16k_causal window_256_256_16k window_256_256_16k:tokamax"
for round in 1; do
  PYTHONPATH=out/base:.:$stub timeout 80 python $here/kernel_times.py "$out" base $rows 2>&1 | filter | grep "^base"
  PYTHONPATH=.:$stub timeout 80 python $here/kernel_times.py "$out" new $rows 2>&1 | filter | grep "^new"
done | tee "$out/kernel_times.log"
rm -rf "$out"/trace_*
