#!/usr/bin/env bash
# One device call: what calls with lengths run around their kernel (profile_prelude.py),
# then the batch-second grids (9d0fe4f's jaxtile, out/bs) against the head's (out/base)
# on the check's rows with a batch over 1, each version in its own process beside cuDNN.
# Usage: bash run1.sh OUT
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=$1
here=bench/results/h200/length_bounds
cat VERSION.json; echo
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
PYTHONPATH=. timeout 200 python $here/profile_prelude.py "$out" 2>&1 | grep -v "^WARNING" | tee "$out/profile_prelude.log"
PYTHONPATH=. timeout 330 python -m bench.ab out/base out/bs --out "$out/ab_batch_second.json" \
  --only d64_4k_full d64_4k_causal d128_4k gqa_32 mqa_16_1_causal --modes fwd fwdbwd 2>&1 \
  | grep -v "^WARNING:absl\|^\[bench\]" | tee "$out/ab_batch_second.log" | tail -16
