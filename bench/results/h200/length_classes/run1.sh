#!/usr/bin/env bash
# One device call at the head: mosaic_v3's GPU tests, every kernel's GPU tests of lengths,
# pages and decoding, then what runs around a call with lengths (profile_prelude.py of
# ../length_bounds). Usage: bash run1.sh OUT
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
out=$1
cat VERSION.json; echo
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
timeout 200 python -m pytest -q -p no:cacheprovider -n 12 tests/test_mosaic.py -k gpu 2>&1 |
    tee "$out/gpu_tests_mosaic.log" | tail -3
timeout 280 python -m pytest -q -p no:cacheprovider -n 12 tests/test_correctness.py tests/test_gpu.py tests/test_paged.py \
    tests/test_jax_nn.py tests/test_api.py -k "(pallas or mosaic or gpu) and (length or paged or decode or ragged)" 2>&1 |
    tee "$out/gpu_tests_lengths.log" | tail -3
timeout 100 python bench/results/h200/length_bounds/profile_prelude.py "$out" > "$out/profile_prelude.log" 2>&1
grep -E "^==|jaxtile from" "$out/profile_prelude.log" | head -3
