#!/usr/bin/env bash
# At the commit whose Mosaic kernels multiply by a reciprocal a row where they divided
# element by element (the forward's O_i / l_i, the float16 backward's rescale of dS's
# products). Two stages, each beside a half of the perf check in one device call:
#   tests:    the Mosaic GPU tests and the numerics tests on mosaic_v3 (float16
#             gradients past float16's range among them);
#   timeline: the forward rows of ../timeline/timeline.py (each program's span against
#             tokamax's).
# Usage: bash bench/results/h200/epilogue/run.sh OUT {tests|timeline}
out=$1
cat VERSION.json; echo
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
case "$2" in
tests)
    timeout 240 python -m pytest -q -p no:cacheprovider -n 12 tests/test_mosaic.py -k gpu 2>&1 |
        tee "$out/gpu_tests_mosaic.log" | tail -3
    timeout 120 python -m pytest -q -p no:cacheprovider -n 8 tests/test_numerics.py -k mosaic 2>&1 |
        tee "$out/gpu_tests_numerics.log" | tail -3
    ;;
timeline)
    timeout 200 bash bench/gpu_session.sh script "$out" bench/results/h200/timeline/timeline.py "$out/timeline" fwd |
        grep -v "^  warnings.warn\|UserWarning"
    cp "$out/timeline/timeline.json" "$out/timeline_fwd.json" && rm -rf "$out/timeline"
    ;;
esac
