#!/usr/bin/env bash
# The device script of packed documents' uniform steps (`v3.UNIFORM_IDS`): the segment
# ids' GPU tests (the shared correctness base's mosaic cases and mosaic_v3's own, among
# them documents whose masked steps fall inside and across documents), then
# docs_uniform.py's variants in one process.
#   bash bench/results/documents_uniform/run.sh OUT
set -uo pipefail
out=$1
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
python -c "import jaxtile, json; print(jaxtile.__file__, json.load(open('VERSION.json'))['commit'])"
commit=$(python -c "import json; print(json.load(open('VERSION.json'))['commit'][:7])")
timeout 240 python -m pytest -q -p no:cacheprovider -n 8 tests/test_correctness.py tests/test_mosaic.py \
    -k "mosaic and (segment or document)" 2>&1 | tee "$out/gpu_tests_segments_$commit.log" | tail -3
[ "${PIPESTATUS[0]}" = 0 ] || exit 1  # no timings of a kernel that is not exact
timeout 320 python bench/results/documents_uniform/docs_uniform.py 2>&1 | tee "$out/docs_uniform_$commit.log" | grep -v '^{"git"'
