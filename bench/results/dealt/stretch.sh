#!/usr/bin/env bash
# The device script of dealing heaviest first within stretches of one round's heads
# (`_ring.Schedule.dealt` since the commit after d978c17; place order before): the
# persistent programs' GPU tests (20 programs deal causal_queries_first's tiles in an
# order that is not place order); the forward of the rows it makes dealt (head dim 64
# causal 4K, GQA 32:8 and MQA 16:1 causal 8K) or deals otherwise (sinks), and of one it
# leaves as it was (head dim 128 causal 16K), against out/base (`git archive 8e2efc5
# jaxtile`, whose jaxtile is d978c17's), each version in its own process beside cuDNN
# and tokamax; then rounds, place-order dealing, stretches and heaviest first over the
# grid on those rows in one process (variants.py).
#   bash bench/results/dealt/stretch.sh OUT
set -uo pipefail
out=$1
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
python -c "import jaxtile, json; print(jaxtile.__file__, json.load(open('VERSION.json'))['commit'])"
commit=$(python -c "import json; print(json.load(open('VERSION.json'))['commit'][:7])")
rows="d64_4k_causal gqa_32_8_causal_8k mqa_16_1_causal_8k sinks_gqa_64_8_causal_8k d128_16k_causal"
timeout 170 python -m pytest -q -p no:cacheprovider -n 8 tests/test_mosaic.py -k "persistent_programs_are_exact" 2>&1 |
    tee "$out/gpu_tests_persistent_$commit.log" | tail -2
[ "${PIPESTATUS[0]}" = 0 ] || exit 1  # no timings of a kernel that is not exact
# shellcheck disable=SC2086
timeout 200 bash bench/gpu_session.sh ab "$out" out/base . --modes fwd --only $rows 2>&1 | tail -9
# shellcheck disable=SC2086
timeout 200 bash bench/gpu_session.sh script "$out" bench/results/dealt/variants.py $rows 2>&1 | grep -v '^{"git"'
mv "$out/variants.log" "$out/variants_$commit.log"
