#!/usr/bin/env bash
# One device call: the batch second in every Mosaic grid (forward and dQ: heads, batch,
# query tiles; dK/dV: shares, batch, key tiles) (.) against 3b60fc1's kernels (out/base:
# heads fastest, then the tiles): bench.ab on two batch-4 rows, each version in its own
# process beside cuDNN; then the Mosaic GPU tests. Usage: bash run_batch_second.sh OUT
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=$1
cat VERSION.json; echo
filter() { grep -v "^WARNING:absl\|^\[bench\]\|Autotuning cache miss"; }
PYTHONPATH=. timeout 110 python -m bench.ab out/base . --out "$out/ab_3b60fc1_vs_batch_second.json" \
  --only d128_4k_full d64_4k_full --modes fwd fwdbwd 2>&1 | filter | tee "$out/ab_3b60fc1_vs_batch_second.log" | tail -7
PYTHONPATH=. timeout 160 python -m pytest -q -p no:cacheprovider -n 14 tests/test_mosaic.py -k gpu 2>&1 \
  | tee "$out/gpu_tests_mosaic.log" | tail -3
