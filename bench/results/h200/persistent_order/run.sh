#!/usr/bin/env bash
# One device call to validate `v3._queries_first` (persistent programs taking whole heads'
# query tiles a round, over more than 2048 keys with no left bound and no lengths): the
# Mosaic GPU tests, then the rows whose schedule changed against the commit before,
# each version in its own process beside cuDNN and tokamax: the perf check's rows
# (bench.ab, forward: the backward is unchanged), then `shapes.py`'s. Before the call,
# put the base's jaxtile and its VERSION.json in out/base and carry it:
#   rm -rf out/base && mkdir -p out/base && git archive BASE jaxtile | tar -x -C out/base
# Then the perf check in halves (bash bench/gpu_session.sh perf OUT --part 1/2, 2/2).
# Usage: bash bench/results/h200/persistent_order/run.sh OUT
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
out=$1
root=$PWD
cat VERSION.json out/base/VERSION.json; echo
timeout 240 python -m pytest -q -p no:cacheprovider -n 12 tests/test_mosaic.py -k gpu 2>&1 | tail -4 |
    tee "$out/gpu_tests_mosaic.log"
timeout 240 bash bench/gpu_session.sh ab "$out" out/base . --modes fwd --only d64_4k_full d64_4k_causal \
    d64_16k d128_4k d128_16k gqa_32_8_causal mqa_16_1_causal sinks | grep -v "^WARNING:absl:Autotuning cache miss"
# shapes.py from each version's directory: out/base gets this tree's bench (not its
# results) and the tokamax wheels beside its jaxtile.
tar -C "$root" --exclude=bench/results -cf - bench | tar -C out/base -xf -
ln -sfn "$root/.whl" out/base/.whl
(cd out/base && timeout 90 bash "$root/bench/gpu_session.sh" script "$out/base" "$root/bench/results/h200/persistent_order/shapes.py")
timeout 90 bash bench/gpu_session.sh script "$out/branch" bench/results/h200/persistent_order/shapes.py
