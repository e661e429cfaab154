#!/usr/bin/env bash
# One device call: timeline.py with tokamax installed (bench/gpu_session.sh script), then
# parity --full for mosaic_v3 in four shards.
# Usage: bash bench/results/h200/timeline/run.sh OUT
out=$1
shift
cat VERSION.json; echo
timeout 380 bash bench/gpu_session.sh script "$out" bench/results/h200/timeline/timeline.py "$out/timeline" "$@"
SHARDS=4 timeout 190 bash bench/gpu_session.sh parity "$out" mosaic_v3
