#!/usr/bin/env bash
# One device call: the forward's and the dQ kernel's grids with the query tiles fastest (.)
# against cf95bb5's, heads fastest (out/base): bench.ab, each version in its own process
# beside cuDNN; then the Mosaic GPU tests of the new grid. Usage: bash run_q_tiles_first.sh OUT (run at 4883d55)
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=$1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
cat VERSION.json; echo
filter() { grep -v "^WARNING:absl\|^\[bench\]\|Autotuning cache miss"; }
PYTHONPATH=. timeout 330 python -m bench.ab out/base . --out "$out/ab_cf95bb5_vs_q_tiles_first.json" \
  --only d128_4k_full d128_16k_full d128_16k_causal d64_4k_full d64_16k_causal gqa --modes fwd fwdbwd 2>&1 \
  | filter | tee "$out/ab_cf95bb5_vs_q_tiles_first.log" | tail -16
PYTHONPATH=. timeout 240 python -m pytest -q -p no:cacheprovider -n 12 tests/test_mosaic.py -k gpu 2>&1 \
  | tee "$out/gpu_tests_mosaic.log" | tail -3
