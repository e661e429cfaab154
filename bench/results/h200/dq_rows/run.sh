#!/usr/bin/env bash
# One device call: forward+backward of the head dim 64 rows, out/base against this tree,
# each in its own process beside cuDNN (bench.ab); mosaic_v3's GPU tests; ptxas's report
# on this tree's kernels (registers and spills).
# Usage: bash run.sh OUT
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
out=$1
cat VERSION.json out/base/VERSION.json; echo
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
timeout 200 python -m bench.ab out/base . --only d64_4k_full d64_4k_causal d64_16k documents_8x2k_d64 \
    --modes fwdbwd --out "$out/ab.json" 2>&1 | grep -v "^WARNING:absl\|^\[bench\]" > "$out/ab.log"
grep -v "^\[bench\]" "$out/ab.log" | tail -9
timeout 190 python -m pytest -q -p no:cacheprovider -n 12 tests/test_mosaic.py -k gpu 2>&1 |
    tee "$out/gpu_tests_mosaic.log" | tail -3
MOSAIC_GPU_DUMP_PTXAS=1 timeout 60 python bench/results/h200/dkdv_overlap/ptxas.py 2>&1 |
    grep -E "jaxtile/__init__|C7513|Used [0-9]+ registers|spill|^== " > "$out/ptxas.log"
grep -c spill "$out/ptxas.log"; grep -B1 -A1 "spill" "$out/ptxas.log" | grep -v "0 bytes spill" | head -20
