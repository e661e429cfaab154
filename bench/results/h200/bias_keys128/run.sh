#!/usr/bin/env bash
# One device call: mosaic_v3's GPU tests at this tree (the forward's lse written from
# registers), then keys128.py beside cuDNN and tokamax.
# Usage: bash bench/results/h200/bias_keys128/run.sh OUT
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
out=$1
cat VERSION.json; echo
timeout 220 python -m pytest -q -p no:cacheprovider -n 12 tests/test_mosaic.py -k gpu 2>&1 |
    tee "$out/gpu_tests_mosaic.log" | tail -3
timeout 240 bash bench/gpu_session.sh script "$out" bench/results/h200/bias_keys128/keys128.py
