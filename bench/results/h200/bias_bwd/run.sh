#!/usr/bin/env bash
# One device call: mosaic_v3's GPU tests and its gradient tests at this tree, ptxas's
# report on the bias kernels, then the bias row (forward and forward+backward), out/base
# against this tree, each in its own process beside cuDNN and tokamax (bench.ab).
# Usage: bash bench/results/h200/bias_bwd/run.sh OUT
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
out=$1
here=bench/results/h200/bias_bwd
cat VERSION.json out/base/VERSION.json; echo
timeout 220 python -m pytest -q -p no:cacheprovider -n 12 tests/test_mosaic.py -k gpu 2>&1 |
    tee "$out/gpu_tests_mosaic.log" | tail -3
timeout 120 python -m pytest -q -p no:cacheprovider -n 12 tests/test_autodiff.py tests/test_determinism.py \
    tests/test_correctness.py -k mosaic 2>&1 | tee "$out/gpu_tests_gradients.log" | tail -3
MOSAIC_GPU_DUMP_PTXAS=1 timeout 90 python $here/ptxas.py >"$out/ptxas.log" 2>&1
grep -E "^==|Compiling entry|registers|spill|C7513" "$out/ptxas.log" | grep -v "^ptxas info    : Function properties" | tail -30
AB_TIMEOUT=${AB_TIMEOUT:-200} timeout ${AB_TIMEOUT:-200} bash bench/gpu_session.sh ab "$out" out/base . --only bias --modes fwd fwdbwd 2>&1 |
    grep -v "^WARNING:absl\|^\[bench\]" | tail -16
