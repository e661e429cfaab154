#!/usr/bin/env bash
# One device call: the Mosaic kernels ending on a read-only wait for their TMA stores (.)
# against the commit before (out/base), forward and forward+backward, each version in its
# own process beside cuDNN and tokamax; which wait the forward's PTX now has; the Mosaic
# GPU tests of the change.
# Usage: bash bench/results/h200/store_wait/run.sh OUT
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
out=$1
cat VERSION.json out/base/VERSION.json; echo
timeout 300 bash bench/gpu_session.sh ab "$out" out/base . --only d128_ d64_4k_full d64_4k_causal gqa_32 window_1023 \
    --modes fwd fwdbwd | grep -v "^WARNING:absl:Autotuning cache miss"
timeout 40 python bench/results/h200/named_free/sass.py mosaic_v3 4096 full "$out/ptx_forward.txt"
grep -n "cp.async.bulk.wait_group" "$out/ptx_forward.txt" | tee "$out/store_waits.txt"
rm "$out/ptx_forward.txt"
timeout 230 python -m pytest -q -p no:cacheprovider -n 12 tests/test_mosaic.py -k gpu 2>&1 | tail -4 | tee "$out/gpu_tests_mosaic.log"
