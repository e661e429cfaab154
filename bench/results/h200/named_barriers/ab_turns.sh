#!/usr/bin/env bash
# bench.ab of the forward: d9d3132's kernels (out/base) against the head's, each in its own
# process; then the Mosaic GPU tests at the head.
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=$1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 250 python -m bench.ab out/base . --out "$out/ab.json" --only d128 window d64_4k d64_16k gqa --modes fwd 2>&1 | grep -v "^WARNING:absl\|^\[bench\]" | tee "$out/ab.log" | tail -22
timeout 190 python -m pytest -q -p no:cacheprovider -n 12 tests/test_mosaic.py -k gpu 2>&1 | tee "$out/gpu_tests_mosaic.log" | tail -3
