#!/usr/bin/env bash
# The device script of c78b73a (K and V unpadded; the last key tile read past their end):
# the shared correctness tests of mosaic_v3 and its forward's GPU tests, then head dim 128,
# non-causal, 16K (192-key tiles over 16384 keys, which 89fc73d padded to 16512), forward
# and forward+backward, against 89fc73d, each version in its own process beside cuDNN and
# tokamax. out/base: `git archive 89fc73d jaxtile`.
#   bash bench/results/h100/last_key_tile/run.sh OUT
set -uo pipefail
out=$1
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
python -c "import jaxtile, json; print(jaxtile.__file__, json.load(open('VERSION.json'))['commit'])"
timeout 200 python -m pytest -q -p no:cacheprovider -n 12 tests/test_correctness.py -k mosaic 2>&1 |
    tee "$out/gpu_tests_correctness_mosaic.log" | tail -2
timeout 150 python -m pytest -q -p no:cacheprovider -n 8 tests/test_mosaic.py \
    -k "192 or wide or persistent_programs_are_exact or dense_masks_are_exact" 2>&1 |
    tee "$out/gpu_tests_mosaic.log" | tail -2
timeout 200 bash bench/gpu_session.sh ab "$out" out/base . --only d128_16k_full
