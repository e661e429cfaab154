#!/usr/bin/env bash
# The sinks taken by pallas_v2's forward kernel, checked in one device call: the GPU tests
# with sinks on the Triton and Mosaic kernels (float32 among them), then their cost on
# pallas_v2 taken apart (`bench/results/h200/sinks/sinks_breakdown.py`). From the repository root:
#   bash bench/results/h100/triton_sinks/run.sh OUT
set -uo pipefail
out=$1
mkdir -p "$out/breakdown"
python -c "import jaxtile; print(jaxtile.__file__)" | tee "$out/jaxtile_file.txt"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 300 python -m pytest -q -p no:cacheprovider -n 12 -rs \
    tests/test_correctness.py tests/test_api.py tests/test_autodiff.py tests/test_jax_nn.py tests/test_example.py \
    -k "sinks and (pallas or mosaic or gpt or jax_nn)" 2>&1 | tee "$out/gpu_tests_sinks.log" | tail -8
echo "tests done at ${SECONDS}s"
OUT="$out/breakdown" bash bench/gpu_session.sh script "$out/breakdown" bench/results/h200/sinks/sinks_breakdown.py pallas_v2 |
    tail -7
echo "breakdown done at ${SECONDS}s"
