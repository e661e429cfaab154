#!/usr/bin/env bash
# The device script of persistent programs dealt their tiles on the host
# (`_ring.Schedule.dealt`, where that saves at least `v3._DEALING` key tiles): the
# persistent programs' GPU tests (among them causal_256_tiles on 3 programs, which are
# dealt their tiles); the forward of the rows the change makes dealt (16K causal, sinks)
# and of three it leaves in rounds against 35634f4, each version in its own process
# beside cuDNN and tokamax (out/base: `git archive 35634f4 jaxtile`); the perf check's
# causal forward rows; then, where the second argument is "variants", dealt against
# rounds on those rows in one process beside cuDNN (variants.py).
#   bash bench/results/dealt/run.sh OUT [variants]
set -uo pipefail
out=$1
parts=${2:-}
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
python -c "import jaxtile, json; print(jaxtile.__file__, json.load(open('VERSION.json'))['commit'])"
commit=$(python -c "import json; print(json.load(open('VERSION.json'))['commit'][:7])")
python -c "import tokamax" 2>/dev/null || python -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
timeout 150 python -m pytest -q -p no:cacheprovider -n 8 tests/test_mosaic.py -k "persistent_programs_are_exact" 2>&1 |
    tee "$out/gpu_tests_persistent_$commit.log" | tail -2
[ "${PIPESTATUS[0]}" = 0 ] || exit 1  # no timings of a kernel that is not exact
timeout 200 bash bench/gpu_session.sh ab "$out" out/base . --modes fwd --only d128_16k_causal d64_16k_causal \
    gqa_32_8_causal_8k sinks_gqa_64_8_causal_8k d128_1k_causal d64_1k_causal 2>&1 | tail -25
timeout 240 bash bench/gpu_session.sh perf "$out" --only causal --modes fwd 2>&1 | tail -25
[ "$parts" = variants ] || exit 0
timeout 220 python bench/results/dealt/variants.py 2>&1 | tee "$out/variants_$commit.log" | grep -v '^{"git"'
