#!/usr/bin/env bash
# One device call: costs.py with tokamax installed (bench/gpu_session.sh script).
# Usage: bash bench/results/h200/tile_costs/run.sh OUT
out=$1
cat VERSION.json; echo
timeout 500 bash bench/gpu_session.sh script "$out" bench/results/h200/tile_costs/costs.py "$out/tile_costs.json"
