#!/usr/bin/env bash
# One device call: the dK/dV kernel's grid with the (kv) heads fastest, as the forward's and
# dQ's (.), against cf95bb5's, key tiles fastest (out/base): bench.ab of forward+backward,
# each version in its own process beside cuDNN; then the Mosaic GPU tests.
# Usage: bash run_dkdv_heads_first.sh OUT
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=$1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
cat VERSION.json; echo
filter() { grep -v "^WARNING:absl\|^\[bench\]\|Autotuning cache miss"; }
PYTHONPATH=. timeout 300 python -m bench.ab out/base . --out "$out/ab_cf95bb5_vs_dkdv_heads_first.json" \
  --only d128_4k_full d128_16k_full d128_16k_causal d64_4k_full d64_16k_causal gqa mqa_16_1_causal --modes fwdbwd 2>&1 \
  | filter | tee "$out/ab_cf95bb5_vs_dkdv_heads_first.log" | tail -12
PYTHONPATH=. timeout 240 python -m pytest -q -p no:cacheprovider -n 12 tests/test_mosaic.py -k gpu 2>&1 \
  | tee "$out/gpu_tests_mosaic.log" | tail -3
