#!/usr/bin/env bash
# One device call at the commit that counts the forward's shared memory as Mosaic GPU
# does (a bias at head dim 128 takes 128-key tiles by default): mosaic_v3's GPU tests,
# then the whole perf check (bench.check with cuDNN and tokamax in the same process).
# Usage: bash bench/results/h200/bias_keys128/run2.sh OUT
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
out=$1
cat VERSION.json; echo
timeout 200 python -m pytest -q -p no:cacheprovider -n 12 tests/test_mosaic.py -k gpu 2>&1 |
    tee "$out/gpu_tests_mosaic.log" | tail -3
timeout 340 bash bench/gpu_session.sh perf "$out" 2>&1 | tail -46
