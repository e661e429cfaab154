#!/usr/bin/env bash
# One device call: costs.py with tokamax installed (bench/gpu_session.sh script), then the
# SASS of mosaic_v3's persistent forward at head dim 128, 4K non-causal (../named_free/sass.py).
# Usage: bash bench/results/h200/tile_costs/run.sh OUT
out=$1
cat VERSION.json; echo
timeout 400 bash bench/gpu_session.sh script "$out" bench/results/h200/tile_costs/costs.py "$out/tile_costs.json"
NVDISASM=$(find / -xdev -name nvdisasm -type f 2>/dev/null | head -1) PYTHONPATH=. timeout 60 \
    python bench/results/h200/named_free/sass.py mosaic_v3 4096 full "$out/sass_jaxtile_4096_full_persistent.txt" persistent
