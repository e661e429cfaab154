"""Forward and backward passes are bitwise reproducible on one device.

The same compiled function called again, and the function compiled afresh, must return
the same bits for out, lse, dq, dk and dv (with cotangents for both outputs). On the CPU
this runs everywhere at small sizes; the ``gpu`` variant runs the real kernels at sizes
where a non-deterministic reduction (atomics, split-K) would show. A decode kernel (a
record with ``max_q_len``) runs as many queries as it takes against a cache long enough
that split-KV decoding cuts it into shares and merges them (`_sized`).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxtile._core import Shape
from jaxtile.triton import _kernel as pk
from jaxtile.triton import decode
from parity.case import Case, make_inputs
from parity.run import jaxtile_function

CPU_CASE = Case(
    "determinism",
    q_len=48,
    kv_len=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    dtype="bfloat16",
    causal=True,
    segments=2,
    lse_grad=True,
    block_q=16,
    block_k=16,
)
GPU_CASE = Case(
    "determinism_gpu",
    batch=(2,),
    q_len=2048,
    num_heads=8,
    num_kv_heads=2,
    head_dim=128,
    dtype="bfloat16",
    causal=True,
    lse_grad=True,
)
CALLS = 3
# The decode-sized variants' keys: on the CPU 25 tiles of 16 keys, in 3 shares; on a
# Hopper GPU 64 of the default 128, in 8.
DECODE_KV = {CPU_CASE.name: 400, GPU_CASE.name: 8192}


def _sized(impl, case: Case) -> Case:
    return case.decode_sized(impl.max_q_len, DECODE_KV[case.name])


def _bits(values) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.block_until_ready(values)]


def _assert_reproducible(case: Case, implementation: str, calls: int):
    arrays = make_inputs(case)
    run, args = jaxtile_function(case, arrays, implementation)
    first = _bits(run(*args))
    fresh, _ = jaxtile_function(case, arrays, implementation)
    repeats = [_bits(run(*args)) for _ in range(calls - 1)] + [_bits(fresh(*args))]
    names = ("out", "lse", "dq", "dk", "dv")
    for call, bits in enumerate(repeats, start=1):
        differ = [name for name, a, b in zip(names, first, bits) if a != b]
        what = "a fresh compilation" if call == len(repeats) else f"call {call + 1}"
        assert not differ, f"{implementation}: {differ} of {what} differ bitwise from the first call"


def test_bitwise_reproducible(impl):
    _assert_reproducible(_sized(impl, CPU_CASE), impl.name, CALLS)


def test_the_decode_variant_splits_the_keys():
    """pallas_decode cuts the CPU variant's keys into 3 shares (`num_splits`, with one
    head per query tile: the most programs, so the fewest shares), merged in the test."""
    case = _sized(decode.IMPLEMENTATION, CPU_CASE)
    dims = Shape(2, case.q_len, case.kv, case.num_heads, case.kv_heads, case.head_dim, case.dim_v, 2)
    assert decode.num_splits(dims, pk.Tiles(case.block_q, case.block_k, 2), pk.sm_count("cpu")) == 3


@pytest.mark.gpu
def test_bitwise_reproducible_on_gpu(impl):
    case = GPU_CASE
    if impl.algorithm == "FlashAttention-1":
        # Key tiles in the outer loop rewrite the whole output at every step (and the
        # Pallas kernel runs one program per batch × head): keep it short.
        case = case.replace(q_len=512)
    _assert_reproducible(_sized(impl, case), impl.name, calls=5)
