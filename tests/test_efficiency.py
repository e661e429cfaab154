"""The tiled implementations are efficient, not only correct: O(N) memory, and the tiles
that causal or windowed masks hide are really skipped.

Memory is XLA's own accounting of the compiled program
(``jax.jit(f).lower(...).compile().memory_analysis()``), compiled but never run. Tile
visits are counted at run time: the per-tile softmax function each loop body calls once
(`jaxtile._softmax`) is wrapped so that every execution reports itself through
``jax.debug.callback``, and the counts are compared with `jaxtile.analysis.tile_visits`.
"""

from __future__ import annotations

import collections
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtile
from jaxtile import _softmax, analysis
from jaxtile.mask import MaskSpec

LAX_TILED = ("scan_v1", "scan_v2")


# ---------------------------------------------------------------------------------------
# Memory is O(N)


@functools.cache
def _temp_bytes(implementation: str, seq_len: int, backward: bool) -> int:
    """Temporary memory of the compiled forward (or forward + backward) pass."""
    q = jax.ShapeDtypeStruct((1, seq_len, 2, 16), jnp.float32)

    def attend(q, k, v):
        return jaxtile.flash_attention(q, k, v, implementation=implementation)

    if backward:
        fn = lambda q, k, v, dout: jax.vjp(attend, q, k, v)[1](dout)  # noqa: E731
        args = (q, q, q, q)
    else:
        fn, args = attend, (q, q, q)
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward_backward"])
@pytest.mark.parametrize("implementation", LAX_TILED)
def test_memory_grows_linearly(implementation, backward):
    short, long = (_temp_bytes(implementation, n, backward) for n in (4096, 8192))
    ref_short, ref_long = (_temp_bytes("reference", n, backward) for n in (4096, 8192))
    assert ref_long / ref_short > 3.9, "the reference should grow quadratically"
    assert long / short <= 2.2, f"{implementation}: temporaries grew {long / short:.2f}x when N doubled"
    assert long < 0.05 * ref_long, f"{implementation}: {long} bytes at N=8192 vs the reference's {ref_long}"


# ---------------------------------------------------------------------------------------
# Masked tiles are skipped

# The per-tile function each implementation's loop body calls exactly once per visit.
FORWARD_STEP = {"scan_v1": "tile_softmax", "scan_v2": "online_softmax"}
BACKWARD_STEP = "probabilities"


@pytest.fixture
def visits(monkeypatch):
    """Counts executions of the per-tile softmax functions, by name and by whether the
    visit applied the element-wise mask: ``visits[(name, masked)]``."""
    counts = collections.Counter()

    def counted(name, fn):
        signature = inspect.signature(fn)

        def wrapper(*args, **kwargs):
            masked = signature.bind(*args, **kwargs).arguments.get("visible") is not None
            jax.debug.callback(functools.partial(counts.update, [(name, masked)]))
            return fn(*args, **kwargs)

        return wrapper

    for name in {*FORWARD_STEP.values(), BACKWARD_STEP}:
        monkeypatch.setattr(_softmax, name, counted(name, getattr(_softmax, name)))
    jax.clear_caches()  # trace the wrapped functions, not cached programs
    yield counts
    monkeypatch.undo()
    jax.clear_caches()  # and leave no wrapped program behind


def _run_counted(counts, implementation, seq_len, block, **mask):
    """Runs forward and backward once; returns (forward visits, masked), (backward ...)."""
    rng = np.random.default_rng(0)
    q, k, v, dout = (jnp.asarray(rng.standard_normal((1, seq_len, 2, 8)), jnp.float32) for _ in range(4))

    def attend(q, k, v):
        return jaxtile.flash_attention(q, k, v, implementation=implementation, block_q=block, block_k=block, **mask)

    @jax.jit
    def forward_backward(q, k, v, dout):
        _, vjp = jax.vjp(attend, q, k, v)
        return vjp(dout)

    counts.clear()
    jax.block_until_ready(forward_backward(q, k, v, dout))
    jax.effects_barrier()
    forward, backward = FORWARD_STEP[implementation], BACKWARD_STEP
    total = {name: counts[(name, True)] + counts[(name, False)] for name in (forward, backward)}
    return (total[forward], counts[(forward, True)]), (total[backward], counts[(backward, True)])


SEQ, BLOCK = 1024, 64
N_TILES = SEQ // BLOCK


@pytest.mark.parametrize("implementation", LAX_TILED)
def test_causal_visits_about_half_the_tiles(visits, implementation):
    full_fwd, full_bwd = _run_counted(visits, implementation, SEQ, BLOCK)
    causal_fwd, causal_bwd = _run_counted(visits, implementation, SEQ, BLOCK, causal=True)
    assert full_fwd == full_bwd == (N_TILES**2, 0)
    # The lower triangle including the diagonal; only the diagonal needs the mask.
    assert causal_fwd == causal_bwd == (N_TILES * (N_TILES + 1) // 2, N_TILES)
    assert causal_fwd[0] / full_fwd[0] == pytest.approx(0.5, abs=1 / N_TILES)
    expected = analysis.tile_visits(MaskSpec.create(SEQ, SEQ, causal=True), BLOCK, BLOCK)
    assert (expected.visited, expected.masked) == causal_fwd


def _window_tiles(seq_len: int, block: int, left: int, right: int) -> int:
    """Tile pairs holding a visible key, counted from positions (independent of MaskSpec)."""
    first_row = np.arange(0, seq_len, block)
    last_row = np.minimum(first_row + block, seq_len) - 1
    first_tile = np.maximum(first_row - left, 0) // block
    last_tile = np.minimum(last_row + right, seq_len - 1) // block
    return int(np.sum(last_tile - first_tile + 1))


@pytest.mark.parametrize("implementation", LAX_TILED)
@pytest.mark.parametrize("window", [(96, 96), (128, 128), (255, 0)], ids=str)
def test_window_visits_w_over_tile_plus_two(visits, implementation, window):
    left, right = window
    width = left + right
    fwd, bwd = _run_counted(visits, implementation, SEQ, BLOCK, window=window)
    assert fwd[0] == bwd[0] == _window_tiles(SEQ, BLOCK, left, right)
    per_q_tile = fwd[0] / N_TILES
    assert width / BLOCK <= per_q_tile <= width / BLOCK + 2
    expected = analysis.tile_visits(MaskSpec.create(SEQ, SEQ, window=window), BLOCK, BLOCK)
    assert (expected.visited, expected.masked) == fwd == bwd
