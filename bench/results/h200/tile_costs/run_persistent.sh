#!/usr/bin/env bash
# One device call: persistent.py with tokamax installed (bench/gpu_session.sh script).
# Usage: bash bench/results/h200/tile_costs/run_persistent.sh OUT [LABEL...]
out=$1
cat VERSION.json; echo
timeout 280 bash bench/gpu_session.sh script "$out" bench/results/h200/tile_costs/persistent.py "$out/persistent.json" "${@:2}"
