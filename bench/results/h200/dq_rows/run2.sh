#!/usr/bin/env bash
# The second device call: the gradient, autodiff and determinism tests of mosaic_v3; the
# A/B of run.sh in the other order (this tree first, out/base second); the perf check's
# second half (bench.check --part 2/2, with tokamax), each cut short by its time box.
# Usage: bash run2.sh OUT
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
out=$1
cat VERSION.json out/base/VERSION.json; echo
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
timeout 100 python -m pytest -q -p no:cacheprovider -n 12 tests/test_autodiff.py tests/test_determinism.py \
    tests/test_correctness.py -k mosaic 2>&1 | tee "$out/gpu_tests_gradients.log" | tail -2
timeout 170 python -m bench.ab . out/base --only d64_4k_full d64_4k_causal d64_16k documents_8x2k_d64 \
    --modes fwdbwd --out "$out/ab_2.json" 2>&1 | grep -v "^WARNING:absl\|^\[bench\]" > "$out/ab_2.log"
grep -v "^\[bench\]" "$out/ab_2.log" | tail -8
timeout ${PERF_TIMEOUT:-280} bash bench/gpu_session.sh perf "$out/perf" --part 2/2 | tail -24
