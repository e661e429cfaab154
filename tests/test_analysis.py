"""`jaxtile.analysis` against brute force and against XLA's own memory accounting."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtile
from jaxtile import analysis, registry
from jaxtile.mask import MaskSpec

SPECS = [
    (q_len, kv_len, causal, window, bq, bk)
    for (q_len, kv_len), causal, window, (bq, bk) in itertools.product(
        [(1, 1), (17, 17), (64, 64), (40, 72), (72, 40), (100, 7), (300, 300)],
        [False, True],
        [None, (3, 0), (0, 3), (5, 9), (None, 4), (17, None), (200, 200)],
        [(16, 16), (16, 32), (32, 16)],
    )
]


def _tile_pairs(spec: MaskSpec, block_q: int, block_k: int) -> tuple[int, int]:
    """Brute force: tile pairs holding a visible key, and those of them that also hold a
    hidden or out-of-bounds key for some in-bounds query row."""
    block_q, block_k = min(block_q, spec.q_len), min(block_k, spec.kv_len)
    n_q, n_k = -(-spec.q_len // block_q), -(-spec.kv_len // block_k)
    rows, cols = np.arange(n_q * block_q)[:, None], np.arange(n_k * block_k)[None, :]
    visible = np.asarray(spec.visible(rows, cols))
    hidden = ~visible & (rows < spec.q_len)

    def per_tile(x):
        return x.reshape(n_q, block_q, n_k, block_k).any(axis=(1, 3))

    visited = per_tile(visible)
    return int(visited.sum()), int((visited & per_tile(hidden)).sum())


@pytest.mark.parametrize("q_len,kv_len,causal,window,bq,bk", SPECS)
def test_tile_visits_match_brute_force(q_len, kv_len, causal, window, bq, bk):
    spec = MaskSpec.create(q_len, kv_len, causal=causal, window=window)
    visits = analysis.tile_visits(spec, bq, bk)
    visited, partial = _tile_pairs(spec, bq, bk)
    assert visits.visited == visited
    # Every tile with a hidden key is masked; a few fully visible ones may be too.
    assert partial <= visits.masked <= visits.visited
    assert visits.total == visits.num_q_tiles * visits.num_kv_tiles >= visits.visited


@pytest.mark.parametrize("num_tiles", [1, 2, 7, 32])
def test_causal_efficiency_is_flashtiles(num_tiles):
    """FlashTile's ``get_causal_efficiency``: n(n+1)/2 of n² tiles are computed."""
    seq_len, block = 64 * num_tiles, 64
    visits = analysis.tile_visits(MaskSpec.create(seq_len, seq_len, causal=True), block, block)
    assert visits.visited == num_tiles * (num_tiles + 1) // 2
    assert visits.masked == num_tiles
    assert visits.savings == pytest.approx((num_tiles - 1) / (2 * num_tiles))


def test_segments_and_dense_masks_skip_by_position_only():
    structured = analysis.tile_visits(MaskSpec.create(256, 256, causal=True), 64, 64)
    segmented = analysis.tile_visits(MaskSpec.create(256, 256, causal=True, has_segments=True), 64, 64)
    assert segmented.visited == structured.visited == segmented.masked


# Within this factor of XLA's measured temporaries (CPU), for every row of SHAPES.
MEMORY_FACTOR = 2.0
# (batch, seq_len, num_heads, num_kv_heads, head_dim, head_dim_v, dtype, block_q, block_k)
SHAPES = [
    ((1,), 1024, 2, 2, 16, 16, "float32", None, None),
    ((2,), 1000, 4, 1, 32, 48, "float32", 64, 128),
    ((2,), 2048, 8, 2, 64, 64, "bfloat16", None, None),
    ((1, 2), 512, 4, 4, 128, 128, "float16", 256, 64),
]


# Implementations interpreted off their platform are loops of XLA ops with temporaries
# of their own there: their models are checked only where they run natively (a GPU).
IMPLEMENTATIONS = [
    pytest.param(i, marks=() if "cpu" in i.platforms else pytest.mark.gpu, id=i.name)
    for i in registry.implementations()
]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward_backward"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[1]}x{s[2]}x{s[4]}_{s[6]}")
def test_memory_usage_matches_xla(shape, implementation, backward):
    """The model against XLA's accounting of the compiled program."""
    batch, n, h, hk, d, dv, dtype, bq, bk = shape
    q = jax.ShapeDtypeStruct((*batch, n, h, d), dtype)
    k = jax.ShapeDtypeStruct((*batch, n, hk, d), dtype)
    v = jax.ShapeDtypeStruct((*batch, n, hk, dv), dtype)
    dout = jax.ShapeDtypeStruct((*batch, n, h, dv), dtype)
    # Kernels keep tiles on chip, so their model has no temporaries per tile to size.
    kernel = not implementation.platforms & {"cpu"}
    blocks = dict(block_q=bq, block_k=bk) if not implementation.power_of_two_blocks else {}

    def attend(q, k, v):
        return jaxtile.flash_attention(q, k, v, implementation=implementation.name, **blocks)

    if backward:
        fn, args = (lambda q, k, v, dout: jax.vjp(attend, q, k, v)[1](dout)), (q, k, v, dout)
    else:
        fn, args = attend, (q, k, v)
    measured = jax.jit(fn).lower(*args).compile().memory_analysis()
    model = analysis.memory_usage(q, k, v, implementation=implementation.name, backward=backward, **blocks)

    assert model.inputs == measured.argument_size_in_bytes
    lse = 0 if backward else 4 * np.prod(batch) * h * n  # returned by the model, a temporary here
    # XLA adds a few bytes for the tuple of gradients.
    assert model.outputs - lse == pytest.approx(measured.output_size_in_bytes, rel=1e-3)
    # Compiled together, residuals (and the unused lse) are temporaries to XLA; on a GPU,
    # XLA may place ``out``, dead once D is formed, in dQ's output buffer (the kernels'
    # residuals are that one array and rows), so there only the rows must be measured.
    extras = model.residuals + model.temporaries + lse
    lower = model.temporaries if kernel and backward else extras
    measured_temp = measured.temp_size_in_bytes
    assert lower / MEMORY_FACTOR <= measured_temp <= MEMORY_FACTOR * extras, (
        f"measured / model = {measured_temp / extras:.2f}"
    )
    assert (model.residuals > 0) == backward
    assert model.total == model.inputs + model.outputs + model.residuals + model.temporaries


def test_memory_usage_rejects_unknown_implementations():
    q = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="flash3"):
        analysis.memory_usage(q, q, q, implementation="flash3")
