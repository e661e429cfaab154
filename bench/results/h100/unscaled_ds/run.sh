#!/usr/bin/env bash
# dS taken to the logit in the Mosaic backward (dQ_i, dK_j scaled once when written):
# an A/B of forward+backward against the previous kernels (each version in its own
# process beside cuDNN and tokamax), then the Mosaic GPU tests and the numerics tests.
#   bash bench/results/h100/unscaled_ds/run.sh OUT   (ab_base/: the base's jaxtile/)
set -uo pipefail
out=$1
mkdir -p "$out"
python -c "import jaxtile; print(jaxtile.__file__)" | tee "$out/jaxtile_file.txt"
bash bench/gpu_session.sh ab "$out/ab" ab_base . --modes fwdbwd \
    --only d64_4k_full d64_16k_causal d128_4k_full d128_16k_full gqa_32_8 mqa_16_1_causal
echo "ab done at ${SECONDS}s"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 250 python -m pytest -q -p no:cacheprovider -n 12 tests/test_mosaic.py -k gpu \
    2>&1 | tee "$out/gpu_tests_mosaic.log" | tail -4
echo "mosaic tests done at ${SECONDS}s"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $((585 - SECONDS)) python -m pytest -q -p no:cacheprovider -n 8 -rs \
    tests/test_numerics.py -k mosaic 2>&1 | tee "$out/gpu_tests_numerics.log" | tail -25
echo "numerics done at ${SECONDS}s"
