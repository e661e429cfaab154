#!/usr/bin/env bash
# One device call: fused.py (exactness, then forward+backward beside cuDNN and tokamax).
# Usage: bash bench/results/h200/fused_dq/run.sh OUT
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
out=$1
cat VERSION.json; echo
timeout 420 bash bench/gpu_session.sh script "$out" bench/results/h200/fused_dq/fused.py
