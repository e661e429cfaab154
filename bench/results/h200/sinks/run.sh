#!/usr/bin/env bash
# The sinks taken by mosaic_v3's forward, checked in one device call: their cost taken
# apart, the check's sinks row, the tests with sinks on the GPU kernels, parity --full of
# mosaic_v3, then the decode benchmark once in what is left. From the repository root:
#   bash bench/results/h200/sinks/run.sh OUT
set -uo pipefail
out=$1
here=$(dirname "$0")
mkdir -p "$out/breakdown"
python -c "import jaxtile; print(jaxtile.__file__)" | tee "$out/jaxtile_file.txt"
OUT="$out/breakdown" bash bench/gpu_session.sh script "$out/breakdown" "$here/sinks_breakdown.py" | tail -7
echo "breakdown done at ${SECONDS}s"
bash bench/gpu_session.sh perf "$out/check" --only sinks | tail -4
echo "check done at ${SECONDS}s"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 python -m pytest -q -p no:cacheprovider -n 12 -rs \
    tests/test_correctness.py tests/test_api.py tests/test_autodiff.py tests/test_jax_nn.py tests/test_example.py \
    -k "sinks and (mosaic or gpt or jax_nn)" 2>&1 | tee "$out/gpu_tests_sinks.log" | tail -8
echo "tests done at ${SECONDS}s"
SHARDS=4 bash bench/gpu_session.sh parity "$out/parity" mosaic_v3 | tail -4
echo "parity done at ${SECONDS}s"
left=$((540 - SECONDS))
[ "$left" -gt 90 ] && timeout "$left" bash bench/gpu_session.sh decode "$out/decode" | tail -3
echo "decode done at ${SECONDS}s"
