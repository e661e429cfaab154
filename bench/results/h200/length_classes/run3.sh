#!/usr/bin/env bash
# One device call: the two rows of run2.sh where the head read slower than the base
# (within the runs' spread), again with four passes per process, base and head twice
# alternated, each from its own directory. Usage: bash run3.sh OUT
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=$1
root=$PWD
script=$root/bench/results/h200/length_classes/ragged_prefill.py
cat VERSION.json; echo
for round in 1 2; do
    for dir in "$root/out/base" "$root"; do
        (cd "$dir" && PYTHONPATH=. timeout 110 python "$script" 4 ragged_4x4k_d128:fwd ragged_8x2k_d128_noncausal:fwd ragged_8x2k_d128:fwd)
    done
done 2>&1 | grep -v "^WARNING" | tee "$out/ragged_prefill_fwd.log"
