#!/usr/bin/env bash
# One device call: the SASS of jaxtile's forward (5e60ea8, the kernels of 1429d8a) and of
# tokamax's at head dim 128, 4K non-causal and 16K causal (sass.py).
# Usage: bash bench/results/h200/named_free/sass.sh OUT
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
out=$1
d=bench/results/h200/named_free
cat VERSION.json; echo
NVDISASM=$(find / -xdev -name nvdisasm -type f 2>/dev/null | head -1)
export NVDISASM
echo "nvdisasm: $NVDISASM"
for shape in "4096 full" "16384 causal"; do
    set -- $shape
    timeout 60 python $d/sass.py mosaic_v3 $1 $2 "$out/sass_jaxtile_$1_$2.txt"
    timeout 90 bash bench/gpu_session.sh script "$out" $d/sass.py tokamax $1 $2 "$out/sass_tokamax_$1_$2.txt"
done
ls -la "$out"
