#!/usr/bin/env bash
# Everything jaxtile checks and measures on an NVIDIA GPU, in stages that each fit one
# device call (10 minutes). Run from the repository root on the GPU machine:
#
#   bash bench/gpu_session.sh check OUT            # the shared correctness tests on the GPU kernels
#   bash bench/gpu_session.sh check_gpu OUT        # tests/test_gpu.py: every GPU kernel compiled for real at the extremes, decode at scale
#   bash bench/gpu_session.sh check_api OUT        # their jax.nn, API, autodiff, paged, determinism and numerics tests
#   bash bench/gpu_session.sh perf OUT [ARGS...]   # python -m bench.check: jaxtile vs cuDNN, the committed floors
#                                                  # (--part 1/2, then 2/2: each half fits one call)
#   bash bench/gpu_session.sh decode OUT [ARGS...] # python -m bench.decode: decode vs the copy bandwidth and cuDNN
#   bash bench/gpu_session.sh ab OUT A B [ARGS...] # python -m bench.ab: two versions (directories), each in its own process with the peers
#   bash bench/gpu_session.sh tune OUT [ARGS...]   # python -m bench.tune: launch parameters of the kernels
#   bash bench/gpu_session.sh script OUT FILE.py   # a record script (bench/results/...) with the peers installed
#   bash bench/gpu_session.sh parity OUT [IMPL...] # parity --full, one process per implementation (and shard)
#   bash bench/gpu_session.sh bench OUT [PRESET [MINUTES [ARGS...]]]  # the matmul ceiling and a benchmark preset
#   bash bench/gpu_session.sh ring OUT             # ring attention on 2 GPUs, then stress and soak
#
# Peers that are not in the GPU image (tokamax) are installed from wheels in .whl/ when
# that folder was carried along (see bench/check.py). tokamax 0.0.17's wheel is for
# Python 3.12 (`pip download --no-deps --python-version 3.12 --only-binary=:all:`) and
# needs what the image lacks beside it: immutabledict at least (2026-12-08). Results land in OUT; copy them to
# bench/results/<gpu>/ and parity/results/.
set -uo pipefail
stage=$1
out=$2
shift 2
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"

peers() {
    # tokamax imports xprof without needing it: an empty stub package is enough.
    if [ -d .whl ] && ! python -c "import tokamax" 2>/dev/null; then
        python -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
        stub=$(mktemp -d)
        mkdir -p "$stub/xprof/cli" && touch "$stub/xprof/__init__.py" "$stub/xprof/cli/__init__.py"
        echo "get_kernel_stats_tool = None" >"$stub/xprof/cli/tools.py"
        export PYTHONPATH="$PYTHONPATH:$stub"
    fi
}

case "$stage" in
check)
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 540 python -m pytest -q -p no:cacheprovider -n 12 \
        tests/test_correctness.py -k "pallas or mosaic" 2>&1 | tee "$out/gpu_tests.log" | tail -8
    ;;
check_gpu)
    # Its own stage since the extremes run all four GPU kernels: with the correctness
    # tests they overran one call (the extremes alone: about 200 of 240 in 230 s, -n 16).
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 540 python -m pytest -q -p no:cacheprovider -n 16 -rs \
        tests/test_gpu.py 2>&1 | tee "$out/gpu_tests_extremes.log" | tail -8
    ;;
check_api)
    # The jax.nn property test compiles every example: 4 per kernel keep the stage in its box.
    JAXTILE_HYPOTHESIS_EXAMPLES=4 XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 540 python -m pytest -q -p no:cacheprovider -n 12 \
        tests/test_jax_nn.py tests/test_autodiff.py tests/test_paged.py tests/test_api.py tests/test_determinism.py tests/test_numerics.py \
        -k "pallas or mosaic or gpu or paged" 2>&1 | tee "$out/gpu_tests_api.log" | tail -8
    ;;
perf)
    peers
    python -m bench.check --out "$out/check.json" "$@" 2>&1 |
        grep --line-buffered -v "^WARNING:absl:Autotuning cache miss" | # tokamax's, three per row
        tee "$out/check.log" | grep --line-buffered -v "^\[bench\]"
    ;;
decode)
    peers
    python -m bench.decode --out "$out/decode.json" "$@" 2>&1 | tee "$out/decode.log" |
        grep --line-buffered -v "^WARNING:absl:Autotuning cache miss" # tokamax's, one per shape
    ;;
ab)
    peers
    a=$1
    b=$2
    shift 2
    python -m bench.ab "$a" "$b" --out "$out/ab.json" "$@" 2>&1 | tee "$out/ab.log" | tail -40
    ;;
script)
    peers
    python "$@" 2>&1 | grep --line-buffered -v "^WARNING:absl:Autotuning cache miss\|^\[bench\]" | tee "$out/$(basename "$1" .py).log"
    ;;
tune)
    python -m bench.tune --out "$out/tune.json" "$@" 2>&1 | tee "$out/tune.log"
    ;;
parity)
    # One process per implementation (compilation, not the GPU, bounds the sweep; more
    # processes than this only contend for the CPU), merged at the end. Every part's JSON
    # is rewritten after each case, so a part cut short by the time box keeps its rows.
    # SHARDS=N splits each implementation's cases over N processes.
    parts=$(mktemp -d)
    shards=${SHARDS:-1}
    for impl in "${@:-pallas_v2}"; do
        for shard in $(seq "$shards"); do
            part="${impl//[:.]/_}_$shard"
            XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 500 python -m parity --full --impl "$impl" \
                --shard "$shard/$shards" --no-second-opinions --json "$parts/$part.json" \
                >"$out/parity_full_$part.log" 2>&1 &
        done
    done
    wait
    tail -qn 1 "$out"/parity_full_*.log
    python -m parity.merge "$out/parity_full.json" "$parts"/*.json
    ;;
bench)
    peers
    python -c "import torch, triton; a, b = (torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16) for _ in range(2)); \
ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode='median'); print(f'bf16 matmul 8192^3: {2 * 8192**3 / ms / 1e9:.0f} TFLOP/s')" \
        | tee "$out/matmul.txt"
    python -m bench --preset "${1:-full}" --save-dir "$out" --max-minutes "${2:-7}" "${@:3}" 2>&1 | tail -40
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
