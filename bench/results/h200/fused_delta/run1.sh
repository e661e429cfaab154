#!/usr/bin/env bash
# One device call: mosaic_v3's GPU tests and its gradients (autodiff, determinism), then
# the standard grid's forward+backward, 7b32fb7 (out/base) against this tree, each in its
# own process beside cuDNN (bench.ab). Usage: bash run1.sh OUT
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
out=$1
cat VERSION.json; echo
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
timeout 200 python -m pytest -q -p no:cacheprovider -n 12 tests/test_mosaic.py -k gpu 2>&1 |
    tee "$out/gpu_tests_mosaic.log" | tail -3
timeout 150 python -m pytest -q -p no:cacheprovider -n 12 tests/test_autodiff.py tests/test_determinism.py \
    tests/test_correctness.py -k mosaic 2>&1 |
    tee "$out/gpu_tests_gradients.log" | tail -3
timeout 230 python -m bench.ab out/base . --only d64_4k_full d64_4k_causal d128_4k d64_16k d128_16k "${@:2}" \
    --modes fwdbwd --out "$out/ab_grid.json" > "$out/ab_grid.log" 2>&1
grep -v "^\[bench\]" "$out/ab_grid.log" | tail -30
