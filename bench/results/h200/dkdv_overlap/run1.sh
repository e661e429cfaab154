#!/usr/bin/env bash
# One device call: ptxas's report on the kernels of out/base and of this tree (ptxas.py),
# mosaic_v3's GPU tests, then the standard grid's forward+backward, out/base against
# this tree, each in its own process beside cuDNN (bench.ab).
# Usage: [MODES="fwd fwdbwd"] bash run1.sh OUT [extra bench.ab cases]
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
out=$1
script=$PWD/$(dirname "$0")/ptxas.py
cat VERSION.json; echo
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
for dir in out/base .; do
    (cd "$dir" && MOSAIC_GPU_DUMP_PTXAS=1 timeout 60 python "$script" 2>&1) |
        grep -E "jaxtile/__init__|C7513|Used [0-9]+ registers|spill|^== " | tee -a "$out/ptxas.log"
done
timeout 170 python -m pytest -q -p no:cacheprovider -n 12 tests/test_mosaic.py -k gpu 2>&1 |
    tee "$out/gpu_tests_mosaic.log" | tail -3
timeout 240 python -m bench.ab out/base . --only d64_4k_full d64_4k_causal d128_4k d64_16k d128_16k "${@:2}" \
    --modes ${MODES:-fwdbwd} --out "$out/ab_grid.json" > "$out/ab_grid.log" 2>&1
grep -v "^\[bench\]" "$out/ab_grid.log" | tail -22
