#!/usr/bin/env bash
# The backward's ping-pong turns: the Mosaic GPU tests at the head, then bench.ab of
# fwd+bwd, d9d3132's kernels (out/base) against the head's, each in its own process;
# then the head with turns in dK/dV only (out/dkdv), by bench.check in its own directory.
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=$1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
cat VERSION.json; echo
timeout 200 python -m pytest -q -p no:cacheprovider -n 12 tests/test_mosaic.py -k gpu 2>&1 | tee "$out/gpu_tests_mosaic.log" | tail -3
timeout 260 python -m bench.ab out/base . --out "$out/ab.json" --only d128 d64_4k gqa --modes fwdbwd 2>&1 | grep -v "^WARNING:absl\|^\[bench\]" | tee "$out/ab.log" | tail -22
(cd out/dkdv && PYTHONPATH=. timeout 120 python -c "import jaxtile; print(jaxtile.__file__)" && PYTHONPATH=. timeout 120 python -m bench.check --only d128_16k d64_4k_full gqa --modes fwdbwd 2>&1 | grep -v "^WARNING:absl\|^\[bench\]" | tail -8) | tee "$out/dkdv.log"
