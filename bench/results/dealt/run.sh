#!/usr/bin/env bash
# The device script of persistent programs dealt their tiles on the host
# (`_ring.Schedule.dealt`): dealt against rounds on the perf check's causal rows, in one
# process beside cuDNN and tokamax (variants.py), then the persistent programs' GPU tests
# (among them causal_256_tiles on 3 programs, which are dealt their tiles).
#   bash bench/results/dealt/run.sh OUT
set -uo pipefail
out=$1
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
python -c "import jaxtile, json; print(jaxtile.__file__, json.load(open('VERSION.json'))['commit'])"
commit=$(python -c "import json; print(json.load(open('VERSION.json'))['commit'][:7])")
python -c "import tokamax" 2>/dev/null || python -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
timeout 330 python bench/results/dealt/variants.py 2>&1 | tee "$out/variants_$commit.log" | grep -v '^{"git"'
timeout 200 python -m pytest -q -p no:cacheprovider -n 8 tests/test_mosaic.py -k "persistent_programs_are_exact" 2>&1 |
    tee "$out/gpu_tests_persistent_$commit.log" | tail -2
