#!/usr/bin/env bash
# Everything jaxtile checks and measures on an NVIDIA GPU, in stages that each fit one
# device call (10 minutes). Run from the repository root on the GPU machine:
#
#   bash bench/gpu_session.sh check OUT   # the GPU tests of the kernels
#   bash bench/gpu_session.sh parity OUT [IMPL...]  # parity --full, one process per implementation
#   bash bench/gpu_session.sh bench OUT   # the matmul ceiling and the benchmark preset
#   bash bench/gpu_session.sh ring OUT    # ring attention on 2 GPUs, then stress and soak
#
# Results land in OUT; copy them to bench/results/<gpu>/ and parity/results/.
set -uo pipefail
stage=$1
out=$2
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"

case "$stage" in
check)
    timeout 400 python -m pytest -q -p no:cacheprovider -p no:xdist tests/test_correctness.py tests/test_gpu.py \
        tests/test_determinism.py tests/test_numerics.py tests/test_analysis.py -k "pallas or gpu" \
        2>&1 | tee "$out/gpu_tests.log" | tail -5
    ;;
parity)
    # One process per implementation (compilation, not the GPU, bounds the sweep; more
    # processes than this only contend for the CPU), merged at the end. Every part's JSON
    # is rewritten after each case, so a part cut short by the time box keeps its rows.
    shift 2
    parts=$(mktemp -d)
    for impl in "${@:-pallas_v2}" ; do
        XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 500 python -m parity --full --impl "$impl" \
            --no-second-opinions --json "$parts/$impl.json" >"$out/parity_full_$impl.log" 2>&1 &
    done
    wait
    tail -qn 1 "$out"/parity_full_*.log
    python -m parity.merge "$out/parity_full.json" "$parts"/*.json
    ;;
bench)
    timeout 60 python -m pytest -q -p no:cacheprovider -p no:xdist tests/test_correctness.py \
        -k "pallas_v2 and (base or head_dim80_v48 or segments_causal or len300)" 2>&1 | tail -2
    python -c "import torch, triton; a, b = (torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16) for _ in range(2)); \
ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode='median'); print(f'bf16 matmul 8192^3: {2 * 8192**3 / ms / 1e9:.0f} TFLOP/s')" \
        | tee "$out/matmul.txt"
    python -m bench --preset full --save-dir "$out" --max-minutes 7 2>&1 | tail -40
    ;;
ring)
    timeout 200 python examples/ring_benchmark.py "$out/ring.json" 2>&1 | tail -12
    CUDA_VISIBLE_DEVICES=0 timeout 230 python -m bench.stress --out "$out/stress.json" --max-seconds 200 2>&1 | tail -8
    ;;
*)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
