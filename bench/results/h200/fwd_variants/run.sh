#!/usr/bin/env bash
# One device call: the perf check's rows not run at 1429d8a (the bias row, the dense
# masks), then variants.py beside cuDNN and tokamax.
# Usage: bash bench/results/h200/fwd_variants/run.sh OUT
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
out=$1
cat VERSION.json; echo
timeout 200 bash bench/gpu_session.sh perf "$out" --only bias dense
timeout 330 bash bench/gpu_session.sh script "$out" bench/results/h200/fwd_variants/variants.py
