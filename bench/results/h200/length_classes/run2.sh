#!/usr/bin/env bash
# One device call: ragged_prefill.py at the base (out/base: f0babdf, the tile bounds of
# lengths from `tile_classes`' reductions) and at the head (from `length_bounds`' closed
# form), each from its own directory and printing the jaxtile it imported, twice
# alternated; then bench.decode at the head. Usage: bash run2.sh OUT
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=$1
root=$PWD
script=$root/bench/results/h200/length_classes/ragged_prefill.py
cat VERSION.json; echo
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
for round in 1 2; do
    for dir in "$root/out/base" "$root"; do
        (cd "$dir" && PYTHONPATH=. timeout 120 python "$script")
    done
done 2>&1 | grep -v "^WARNING" | tee "$out/ragged_prefill.log"
PYTHONPATH=. timeout 90 python -m bench.decode --out "$out/decode.json" 2>&1 | grep -E "^\| b|targets" |
    grep -E "jaxtile|cudnn|targets" | tee "$out/decode.log"
