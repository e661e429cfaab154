#!/usr/bin/env bash
# The dense mask's breakdown, then the decode benchmark once, in one device call:
#   bash bench/results/h100/dense_breakdown/run.sh OUT
set -uo pipefail
out=$1
here=$(dirname "$0")
mkdir -p "$out/dense" "$out/decode"
python -c "import jaxtile; print(jaxtile.__file__)" | tee "$out/jaxtile_file.txt"
OUT="$out/dense" bash bench/gpu_session.sh script "$out/dense" "$here/dense_breakdown.py"
echo "dense done at ${SECONDS}s"
bash bench/gpu_session.sh decode "$out/decode" | tail -32
echo "decode done at ${SECONDS}s"
