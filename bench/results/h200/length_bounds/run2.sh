#!/usr/bin/env bash
# One device call: bench.decode at 607153c (out/base, tile bounds of lengths from XLA) and
# at the head (bounds formed in the Triton kernels from the two lengths), each from its
# own directory and printing the jaxtile it imported, twice alternated; then the Triton
# kernels' GPU tests of lengths, pages and decoding at the head. Usage: bash run2.sh OUT
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=$1
root=$PWD
cat VERSION.json; echo
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
for round in 1 2; do
    for dir in "$root/out/base" "$root"; do
        name=$([ "$dir" = "$root" ] && echo head || echo base)
        (cd "$dir" && export PYTHONPATH=. && python -c "import jaxtile, json; print(jaxtile.__file__, json.load(open('VERSION.json'))['commit'])" &&
            timeout 80 python -m bench.decode --out "$out/decode_${name}_$round.json" 2>&1 | grep -E "^\| b|targets" | grep -E "jaxtile|cudnn|targets")
    done
done 2>&1 | tee "$out/ab_decode.log"
PYTHONPATH=. timeout 240 python -m pytest -q -p no:cacheprovider -n 12 tests/test_correctness.py tests/test_gpu.py tests/test_paged.py \
  -k "(pallas or gpu) and (length or paged or decode or ragged)" 2>&1 | tee "$out/gpu_tests_lengths.log" | tail -3
