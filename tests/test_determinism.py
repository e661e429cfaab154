"""Forward and backward passes are bitwise reproducible on one device.

The same compiled function called again, and the function compiled afresh, must return
the same bits for out, lse, dq, dk and dv (with cotangents for both outputs). On the CPU
this runs everywhere at small sizes; the ``gpu`` variant runs the real kernels at sizes
where a non-deterministic reduction (atomics, split-K) would show.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

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
    _assert_reproducible(CPU_CASE, impl.name, CALLS)


@pytest.mark.gpu
def test_bitwise_reproducible_on_gpu(impl):
    # pallas_v1 runs one program per (batch, head) by design: keep it short.
    case = GPU_CASE.replace(q_len=512) if impl.name == "pallas_v1" else GPU_CASE
    _assert_reproducible(case, impl.name, calls=5)
