#!/usr/bin/env bash
# The decode benchmark twice with interleaved rounds (bench._worker.time_rounds), then
# tests/test_gpu.py in what is left of one device call. From the repository root:
#   bash bench/results/h100/interleaved/run.sh OUT
set -uo pipefail
out=$1
python -c "import jaxtile; print(jaxtile.__file__)" | tee "$out/jaxtile_file.txt"
for run in a b; do
    bash bench/gpu_session.sh decode "$out/decode_$run" | tail -30
    echo "decode $run done at ${SECONDS}s"
done
left=$((570 - SECONDS))
echo "test_gpu.py with ${left}s left"
timeout "$left" bash bench/gpu_session.sh check_gpu "$out/check_gpu"
