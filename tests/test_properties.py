"""Property-based parity: random problems, every implementation against the float64 reference.

Hypothesis draws a `parity.case.Case`: lengths 1..300 (1..100 for the Pallas kernels,
which run interpreted off-GPU), q_len != kv_len or equal, head dims 8..160 (v's may
differ), any GQA ratio, 0-2 leading batch dims, every dtype, causal, windows (one side
possibly unbounded), 1-5 packed segments, dense masks, soft caps, scales (negative too)
and tile sizes (any positive size for the lax loops; None or powers of two >= 16 for
the Pallas kernels). `parity.run.run_case` compares out, lse, dq, dk and dv with the
tolerances of `parity.compare`.

The gradient comparison is kept meaningful: inputs are standard normal (the softmax is
never one-hot, see ``Case.grads``), and when some query sees exactly one key its exact
``dS`` is 0 (``dq`` entirely 0 when every query does), so such cases also differentiate
the lse (``lse_grad``), which gives every row a gradient of order 1.

The budget is fixed and reproducible: a fixed seed per implementation draws the same
`EXAMPLES` on every run. ``JAXTILE_HYPOTHESIS_EXAMPLES=N`` runs N examples
per implementation instead; ``JAXTILE_HYPOTHESIS_SEED=S`` draws a different reproducible
set (both print the falsifying `Case` on failure: rerun it with ``run_case``).
"""

from __future__ import annotations

import math
import os
import zlib

import jax
import jax.numpy as jnp
from hypothesis import HealthCheck, given, reject, seed, settings
from hypothesis import strategies as st

from jaxtile import registry
from jaxtile.mask import MaskSpec
from parity.case import DTYPES, Case, make_inputs
from parity.run import run_case

# CI budget per implementation: ~1-2 s per example for the lax loops and the reference,
# ~2-3 s for interpreted Pallas kernels; keyed by "runs here interpreted".
EXAMPLES = {False: 20, True: 10}
MAX_LEN = {False: 300, True: 100}
POWER_OF_TWO_BLOCKS = (None, 16, 32, 64, 128)


def _lengths(length: int) -> st.SearchStrategy:
    """Any positive tile for the lax loops, at most ~32 tiles per sequence (each pair of
    tiles is one loop step on the CPU: tinier tiles only slow the test down)."""
    return st.one_of(st.none(), st.integers(max(1, math.ceil(length / 32)), length + 8))


def _window(max_len: int) -> st.SearchStrategy:
    side = st.one_of(st.none(), st.integers(0, max_len))
    return st.one_of(st.none(), st.integers(0, max_len), st.tuples(side, side))


def _scale() -> st.SearchStrategy:
    """Default, zero, or of either sign. (Positive scales so small that ``scale · log2 e``
    is 0 in float32 have a test of their own in ``test_numerics``.)"""
    return st.one_of(st.none(), st.just(0.0), st.floats(1e-3, 0.4), st.floats(-0.4, -1e-3))


@st.composite
def cases(draw, slow: bool, power_of_two_blocks: bool) -> Case:
    max_len = MAX_LEN[slow]
    q_len = draw(st.integers(1, max_len))
    kv_len = draw(st.one_of(st.none(), st.integers(1, max_len)))
    num_kv_heads = draw(st.integers(1, 3))
    head_dim = draw(st.integers(8, 160))
    block_q, block_k = (
        (st.sampled_from(POWER_OF_TWO_BLOCKS),) * 2
        if power_of_two_blocks
        else (_lengths(q_len), _lengths(kv_len or q_len))
    )
    case = Case(
        "hypothesis",
        batch=tuple(draw(st.lists(st.integers(1, 2), max_size=2))),
        q_len=q_len,
        kv_len=kv_len,
        num_heads=num_kv_heads * draw(st.integers(1, 4)),
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        head_dim_v=draw(st.one_of(st.none(), st.integers(8, 160))),
        dtype=draw(st.sampled_from(sorted(DTYPES))),
        causal=draw(st.booleans()),
        window=draw(_window(max_len)),
        segments=draw(st.one_of(st.just(0), st.integers(1, 5))),
        mask=draw(st.sampled_from((None, None, "random", "padding", "empty_rows"))),
        logits_soft_cap=draw(st.one_of(st.none(), st.floats(1.0, 50.0))),
        scale=draw(_scale()),
        lse_grad=draw(st.booleans()),
        block_q=draw(block_q),
        block_k=draw(block_k),
        seed=draw(st.integers(0, 2**31 - 1)),
    )
    if not case.lse_grad and _some_row_sees_one_key(case):
        case = case.replace(lse_grad=True)
    return case


def _some_row_sees_one_key(case: Case) -> bool:
    """Whether some query of the case sees exactly one key (its exact dS is 0)."""
    arrays = make_inputs(case)
    spec = MaskSpec.create(
        case.q_len,
        case.kv,
        causal=case.causal,
        window=case.window,
        has_segments=arrays["q_segment_ids"] is not None,
        has_dense_mask=arrays["mask"] is not None,
    )
    q_ids, kv_ids = arrays["q_segment_ids"], arrays["kv_segment_ids"]
    visible = spec.visible(
        jnp.arange(case.q_len)[:, None],
        jnp.arange(case.kv)[None, :],
        q_segment=None if q_ids is None else q_ids[..., None, :, None],
        kv_segment=None if kv_ids is None else kv_ids[..., None, None, :],
        dense=arrays["mask"],
    )
    return bool((jnp.sum(visible, axis=-1) == 1).any())


def _budget(implementation: str, slow: bool):
    """The fixed CI set of examples (a seed per implementation, so that they cover
    different ground), or ``JAXTILE_HYPOTHESIS_*``'s."""
    examples = int(os.environ.get("JAXTILE_HYPOTHESIS_EXAMPLES", EXAMPLES[slow]))
    chosen = zlib.crc32(implementation.encode()) + int(os.environ.get("JAXTILE_HYPOTHESIS_SEED", 0))
    budget = settings(
        max_examples=examples,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    return lambda test: seed(chosen)(budget(test))


def test_random_problems_match_float64_reference(impl):
    slow = jax.default_backend() not in impl.platforms  # interpreted Pallas: slow

    @_budget(impl.name, slow)
    @given(cases(slow, impl.power_of_two_blocks))
    def check(case: Case):
        try:
            result = run_case(case, impl.name)
        except registry.Unsupported:  # a draw outside what the implementation declares
            reject()
        assert result.ok, f"{case}\n{result.describe()}"

    check()
