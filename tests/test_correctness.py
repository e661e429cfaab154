"""The shared correctness suite: every implementation against the float64 torch reference.

Outputs, lse and all three gradients (under a random output cotangent) are compared
with the tolerances of ``parity.compare``. The grid is declared once, below; each
implementation runs all of it (float32), plus the cases marked for 16-bit dtypes, and
a slice of it under each global setting JAX users and test suites turn on.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from jax_settings import SETTINGS

from jaxtile._core import Shape
from parity.case import DTYPES, Case
from parity.run import run_case

B = 16  # the tile most cases use; lengths below are chosen around it

GRID = (
    Case("base", q_len=64, block_q=B, block_k=B),
    Case("causal", q_len=64, causal=True, block_q=B, block_k=32),
    Case("window_left_small", q_len=100, window=(5, 0), block_q=B, block_k=B),
    Case("window_right_small", q_len=100, window=(0, 5), block_q=B, block_k=B),
    Case("window_both", q_len=100, window=(20, 20), block_q=B, block_k=32),
    Case("window_wider_than_seq", q_len=100, window=(500, 500), block_q=32, block_k=B),
    Case("window_causal", q_len=100, causal=True, window=(24, 0), block_q=B, block_k=B),
    Case("window_one_sided_unbounded", q_len=90, window=(None, 7), block_q=B, block_k=B),
    Case("gqa2", num_heads=4, num_kv_heads=2, q_len=48, block_q=B, block_k=B),
    Case("gqa4_causal", num_heads=8, num_kv_heads=2, q_len=48, causal=True, block_q=B, block_k=B),
    Case("mqa", num_heads=4, num_kv_heads=1, q_len=48, causal=True, block_q=B, block_k=B),
    # Queries shorter than the tile: the kernels pack the query heads of a group into it.
    Case("gqa4_packed_ragged", num_heads=8, num_kv_heads=2, q_len=30, kv_len=50, causal=True, block_q=128, block_k=B),
    Case("mqa16_decode", num_heads=16, num_kv_heads=1, q_len=3, kv_len=70, causal=True, block_q=64, block_k=B),
    Case("gqa6_packed_pairs", num_heads=12, num_kv_heads=2, q_len=20, kv_len=40, window=(9, 4), block_q=64, block_k=B),
    Case("gqa8_segments", num_heads=8, num_kv_heads=1, q_len=14, segments=3, causal=True, block_q=64, block_k=B),
    Case("gqa4_padding", num_heads=8, num_kv_heads=2, q_len=12, kv_len=45, mask="padding", block_q=64, block_k=B),
    Case("gqa3_unpacked", num_heads=6, num_kv_heads=2, q_len=33, kv_len=47, causal=True, block_q=64, block_k=B),
    Case("gqa2_mask_per_head", num_heads=4, num_kv_heads=2, q_len=40, mask="random", block_q=32, block_k=B),
    Case("segments", q_len=100, segments=4, block_q=B, block_k=32),
    Case("segments_causal", q_len=100, segments=3, causal=True, block_q=32, block_k=B),
    Case("segments_cross", q_len=40, kv_len=72, segments=3, block_q=B, block_k=B),
    Case("mask_random", q_len=50, kv_len=70, mask="random", block_q=B, block_k=B),
    Case("mask_padding", q_len=64, mask="padding", causal=True, block_q=B, block_k=B),
    Case("empty_rows", q_len=50, mask="empty_rows", block_q=B, block_k=B),
    Case("soft_cap", q_len=64, logits_soft_cap=5.0, input_scale=4.0, block_q=B, block_k=B),
    Case("q_longer_causal", q_len=80, kv_len=30, causal=True, block_q=B, block_k=B),
    Case("kv_longer_causal", q_len=30, kv_len=80, causal=True, block_q=B, block_k=B),
    Case("kv_longer_window", q_len=30, kv_len=100, window=(10, 3), block_q=B, block_k=B),
    Case("decode_one_token", q_len=1, kv_len=77, causal=True, block_q=B, block_k=B),
    Case(
        "lengths_decode_gqa",
        batch=(3,),
        num_heads=8,
        num_kv_heads=2,
        q_len=1,
        kv_len=77,
        lengths="kv",
        block_q=B,
        block_k=B,
    ),
    Case("lengths_ragged_causal", batch=(3,), q_len=20, kv_len=70, causal=True, lengths="ragged", block_q=B, block_k=B),
    Case(
        "lengths_ragged_window", batch=(3,), q_len=16, kv_len=90, window=(10, 2), lengths="ragged", block_q=B, block_k=B
    ),
    Case(
        "lengths_chunk_gqa4",
        batch=(2, 2),
        num_heads=8,
        num_kv_heads=2,
        q_len=5,
        kv_len=64,
        causal=True,
        lengths="ragged",
        block_q=64,
        block_k=B,
    ),
    # A cache shorter than one key tile, with lengths (no interior tile exists).
    Case("lengths_cache_shorter_than_tile", batch=(2,), q_len=3, kv_len=5, lengths="kv", block_q=B, block_k=B),
    # One key per query: the exact dq, dk are 0 unless the lse is differentiated too.
    # Short queries against longer caches (split-KV decoding shares the key tiles out).
    Case("decode_split_mqa", batch=(1,), num_heads=4, num_kv_heads=1, q_len=1, kv_len=700, block_q=B, block_k=B),
    Case(
        "decode_split_lengths",
        batch=(3,),
        num_heads=8,
        num_kv_heads=2,
        q_len=2,
        kv_len=500,
        causal=True,
        lengths="ragged",
        block_q=B,
        block_k=B,
    ),
    Case("decode_window", q_len=4, kv_len=200, causal=True, window=(30, 0), block_q=B, block_k=B),
    Case("decode_segments", q_len=8, kv_len=64, segments=3, block_q=B, block_k=B),
    Case("decode_dense_mask", q_len=6, kv_len=90, mask="random", block_q=B, block_k=B),
    Case("decode_soft_cap", q_len=3, kv_len=100, logits_soft_cap=5.0, input_scale=4.0, block_q=B, block_k=B),
    Case("decode_head_dim80_v48", q_len=5, kv_len=60, head_dim=80, head_dim_v=48, block_q=B, block_k=B),
    Case("decode_gqa3", num_heads=6, num_kv_heads=2, q_len=7, kv_len=50, causal=True, block_q=B, block_k=B),
    Case("decode_lse_cotangent", q_len=4, kv_len=64, causal=True, lse_grad=True, block_q=B, block_k=B),
    # Learnable sinks: one more logit per head in every row's softmax, with no value.
    Case("sinks_gqa_causal", num_heads=8, num_kv_heads=2, q_len=40, causal=True, sinks=True, block_q=B, block_k=B),
    Case("sinks_empty_rows", q_len=50, mask="empty_rows", sinks=True, lse_grad=True, block_q=B, block_k=B),
    Case("sinks_window_soft_cap", q_len=70, window=(9, 3), logits_soft_cap=5.0, sinks=True, block_q=B, block_k=B),
    Case(
        "sinks_decode_lengths",
        batch=(3,),
        num_heads=8,
        num_kv_heads=2,
        q_len=2,
        kv_len=300,
        causal=True,
        lengths="ragged",
        sinks=True,
        block_q=B,
        block_k=B,
    ),
    # An additive bias, and its gradient.
    Case(
        "bias_gqa_causal",
        num_heads=8,
        num_kv_heads=2,
        q_len=40,
        kv_len=56,
        causal=True,
        bias="full",
        block_q=B,
        block_k=B,
    ),
    Case(
        "bias_shared_window_soft_cap", q_len=70, window=(9, 3), logits_soft_cap=5.0, bias="shared", block_q=B, block_k=B
    ),
    Case(
        "bias_lengths_segments",
        batch=(3,),
        q_len=20,
        kv_len=50,
        segments=2,
        lengths="ragged",
        sinks=True,
        bias="full",
        block_q=B,
        block_k=B,
    ),
    Case("len1", q_len=1, lse_grad=True, block_q=B, block_k=B),
    Case("len17", q_len=17, causal=True, block_q=16, block_k=16),
    Case("len100", q_len=100, block_q=32, block_k=32),
    Case("len127", q_len=127, causal=True, block_q=64, block_k=64),
    Case("len300", q_len=300, causal=True, batch=(1,), num_heads=2, block_q=64, block_k=32),
    Case("head_dim16", head_dim=16, q_len=40, block_q=B, block_k=B),
    Case("head_dim40", head_dim=40, q_len=40, causal=True, block_q=B, block_k=B),
    Case("head_dim80_v48", head_dim=80, head_dim_v=48, q_len=40, block_q=B, block_k=B),
    Case("head_dim64", head_dim=64, q_len=40, block_q=B, block_k=B),
    Case("head_dim128", head_dim=128, num_heads=2, q_len=40, block_q=B, block_k=B),
    Case("large_logits", q_len=64, input_scale=20.0, block_q=B, block_k=B),
    Case("no_batch_dims", batch=(), q_len=40, causal=True, block_q=B, block_k=B),
    Case("two_batch_dims", batch=(2, 3), num_heads=2, q_len=40, block_q=B, block_k=B),
    Case("lse_cotangent", q_len=50, causal=True, lse_grad=True, block_q=B, block_k=B),
    Case("custom_scale", q_len=40, scale=0.3, block_q=B, block_k=B),
    Case("default_blocks", q_len=200, causal=True),
)

HALF_PRECISION = (
    "causal",
    "window_both",
    "gqa4_causal",
    "segments_causal",
    "empty_rows",
    "soft_cap",
    "len127",
    "head_dim80_v48",
    "large_logits",
    "gqa4_packed_ragged",
    "lengths_ragged_causal",
    "decode_split_lengths",
    "sinks_gqa_causal",
    "bias_gqa_causal",
)
HALF = ("bfloat16", "float16")
CASES = (
    GRID
    + tuple(
        case.replace(name=f"{case.name}_{dtype}", dtype=dtype)
        for case in GRID
        if case.name in HALF_PRECISION
        for dtype in HALF
    )
    # Logits of ~1e4: outputs and lse must match, gradients must stay finite (the
    # softmax is one-hot; see ``Case.grads`` for why they cannot be compared).
    + tuple(
        Case(f"huge_logits_{dtype}", q_len=64, input_scale=100.0, dtype=dtype, grads=False)
        for dtype in ("float32", *HALF)
    )
)


SETTINGS_SLICE = (
    "gqa4_packed_ragged",
    "segments_causal",
    "mask_random",
    "lengths_ragged_causal",
    "decode_split_lengths",
    "sinks_gqa_causal_bfloat16",
    "bias_gqa_causal",
    "sinks_decode_lengths",
)
SLICE = {c.name: c for c in CASES if c.name in SETTINGS_SLICE}


def _takes(impl, case: Case) -> bool:
    """Whether ``impl``'s record takes ``case``'s shapes and dtype (every record takes
    every feature the slice uses)."""
    dims = (math.prod(case.batch), case.q_len, case.kv, case.num_heads, case.kv_heads, case.head_dim, case.dim_v)
    shape = Shape(*dims, np.dtype(DTYPES[case.dtype]).itemsize)
    return impl.can_run(shape, case.dtype, frozenset(), jax.default_backend()) is None


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_float64_reference(impl, case):
    result = run_case(case, impl.name)
    assert result.ok, result.describe()


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("case", SLICE.values(), ids=lambda c: c.name)
def test_matches_float64_reference_under_setting(impl, case, setting):
    # An implementation interpreted here (minutes per case) runs a rotation of the slice's
    # cases that its record takes: a third of them under each setting (half of two, all
    # of one), so that every case runs under some setting and every setting runs some
    # case; natively, all of it.
    if jax.default_backend() not in impl.platforms:
        taken = [name for name in SETTINGS_SLICE if _takes(impl, SLICE[name])]
        if case.name in taken and (taken.index(case.name) + list(SETTINGS).index(setting)) % min(3, len(taken)):
            pytest.skip("interpreted: this case runs under other settings (see the rotation)")
    with SETTINGS[setting]():
        result = run_case(case, impl.name)
    assert result.ok, result.describe()
