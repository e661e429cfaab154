#!/usr/bin/env bash
# One device call: parity --full for mosaic_v3 (three shards), then timeline.py with
# tokamax installed (bench/gpu_session.sh script).
# Usage: bash bench/results/h200/timeline/run.sh OUT
out=$1
cat VERSION.json; echo
SHARDS=3 timeout 330 bash bench/gpu_session.sh parity "$out" mosaic_v3
timeout 240 bash bench/gpu_session.sh script "$out" bench/results/h200/timeline/timeline.py "$out/timeline"
