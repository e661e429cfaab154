#!/usr/bin/env bash
# At the commit whose Mosaic kernels multiply by a reciprocal a row where they divided
# element by element (the forward's O_i / l_i, the float16 backward's rescale of dS's
# products): the GPU tests that reach those kernels, in one device call, before the perf
# check (bench/gpu_session.sh perf OUT --part 1/2, then 2/2):
#   the Mosaic GPU tests; the numerics tests on mosaic_v3 (float16 gradients past
#   float16's range among them); every GPU kernel compiled for real at the extremes
#   (tests/test_gpu.py) and bitwise determinism on the GPU (the decode variant too).
# Usage: bash bench/results/h200/epilogue/run.sh OUT
out=$1
cat VERSION.json; echo
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
tests() {  # NAME SECONDS PYTEST-ARGS...
    name=$1 seconds=$2
    shift 2
    timeout "$seconds" python -m pytest -q -p no:cacheprovider -n 12 "$@" 2>&1 | tee "$out/gpu_tests_$name.log" | tail -3
}
tests mosaic 200 tests/test_mosaic.py -k gpu
tests numerics 90 tests/test_numerics.py -k mosaic
tests extremes 170 tests/test_gpu.py -k "extremes or decode_at_scale"
tests determinism 90 tests/test_determinism.py -k gpu
