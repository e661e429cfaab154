#!/usr/bin/env bash
# bench.decode at d9d3132 (out/base) and at the head, each from its own directory, twice
# alternated; then the decode and paged GPU tests at the head.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=$1
root=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
for round in 1 2; do
    for dir in "$root/out/base" "$root"; do
        name=$([ "$dir" = "$root" ] && echo head || echo base)
        (cd "$dir" && export PYTHONPATH=. && python -c "import jaxtile, json; print(jaxtile.__file__, json.load(open('VERSION.json'))['commit'])" &&
            timeout 140 bash "$root/bench/gpu_session.sh" decode "$out/${name}_$round" 2>&1 | grep -E "^\| b|targets" | grep -E "ragged|targets")
    done
done
(export PYTHONPATH=.; timeout 150 python -m pytest -q -p no:cacheprovider -n 12 tests/test_paged.py tests/test_gpu.py -k "decode or paged" 2>&1 | tee "$out/gpu_tests_decode.log" | tail -2)
