#!/usr/bin/env bash
# One device call: PTX, SASS and ptxas's log of the head dim 128 forward for each variant,
# exactness, then forward times beside cuDNN. Usage: bash run.sh OUT
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
here=bench/results/h200/overlap_c7513
out=$1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
cat VERSION.json; echo
for variant in none registers smem; do
  mkdir -p "$out/dump_$variant"
  MOSAIC_GPU_DUMP_TO="$out/dump_$variant" MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1 \
    timeout 120 python "$here/overlap.py" dump "$variant" 2>&1 | tail -3
  ls "$out/dump_$variant" | head; grep -h "C7513\|registers\|spill" "$out"/dump_"$variant"/* 2>/dev/null | sort | uniq -c | head
done
timeout 150 python "$here/overlap.py" check 2>&1 | grep -v "^WARNING" | tee "$out/check.log"
timeout 280 python "$here/overlap.py" time d128_4k_full d128_16k_full d128_16k_causal d64_4k_full d64_16k_causal \
  gqa_32_8_causal_8k window_256_256_16k window_1023_causal_16k 2>&1 | grep -v "^WARNING" | tee "$out/time.log"
