#!/usr/bin/env bash
# One device call: the forward with K and V freed on named barriers (.) against the
# commit before it (out/base), each in its own process beside cuDNN and tokamax; the
# Mosaic GPU tests of the change; the SASS of the three forwards at head dim 128.
# Usage: bash bench/results/h200/named_free/run.sh OUT
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
out=$1
d=bench/results/h200/named_free
cat VERSION.json out/base/VERSION.json; echo
timeout 290 bash bench/gpu_session.sh ab "$out" out/base . --only d128_ d64_4k_full d64_4k_causal gqa_32 window --modes fwd
timeout 40 python $d/sass.py mosaic_v3 4096 full "$out/sass_named.txt"
(cd out/base && PYTHONPATH=. timeout 40 python ../../$d/sass.py mosaic_v3 4096 full "$out/sass_base.txt")
timeout 60 bash bench/gpu_session.sh script "$out" $d/sass.py tokamax 4096 full "$out/sass_tokamax.txt"
timeout 170 python -m pytest -q -p no:cacheprovider -n 12 tests/test_mosaic.py -k gpu 2>&1 | tail -5 | tee "$out/gpu_tests_mosaic.log"
ls -la "$out"
