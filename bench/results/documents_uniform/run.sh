#!/usr/bin/env bash
# The device script of packed documents' segment id test. At fbe2dc5 (`same_ids`, since
# reverted): the segment ids' GPU tests, then docs_uniform.py. At main's kernels: the
# packed documents' GPU tests, then docs_persistent.py.
#   bash bench/results/documents_uniform/run.sh OUT [uniform|persistent]
set -uo pipefail
out=$1
part=${2:-persistent}
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
python -c "import jaxtile, json; print(jaxtile.__file__, json.load(open('VERSION.json'))['commit'])"
commit=$(python -c "import json; print(json.load(open('VERSION.json'))['commit'][:7])")
if [ "$part" = uniform ]; then
    tests=(tests/test_correctness.py tests/test_mosaic.py -k "mosaic and (segment or document)")
else
    tests=(tests/test_mosaic.py -k "packed_documents or persistent_programs_are_exact")
fi
timeout 240 python -m pytest -q -p no:cacheprovider -n 8 "${tests[@]}" 2>&1 | tee "$out/gpu_tests_${part}_$commit.log" | tail -3
[ "${PIPESTATUS[0]}" = 0 ] || exit 1  # no timings of a kernel that is not exact
timeout 320 python "bench/results/documents_uniform/docs_$part.py" 2>&1 | tee "$out/docs_${part}_$commit.log" | grep -v '^{"git"'
