"""Repeated calls with the same shapes and options neither retrace nor recompile.

Traces are counted by a Python side effect in the traced function; compilations by JAX's
public ``jax.monitoring`` events (one ``backend_compile`` event per XLA compilation).
New values, of the inputs and of the runtime mask arrays (segment ids, dense mask), must
reuse the compiled program. A decode kernel (a record with ``max_q_len``) takes as many
queries as it can against a longer cache (`_shapes`), whose keys split-KV decoding shares out.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

import jaxtile
from jaxtile._core import Shape
from jaxtile.triton import _kernel as pk
from jaxtile.triton import decode

SHAPES = dict(q=(2, 40, 4, 16), k=(2, 48, 2, 16), v=(2, 48, 2, 8))
OPTIONS = dict(causal=True, window=(24, 0), block_q=16, block_k=16)
DECODE_KV = 320  # 20 key tiles, of which the window's last 3 are seen, in 2 shares


def _shapes(impl) -> dict:
    """`SHAPES`, or for an implementation that takes fewer queries as many as it takes
    against `DECODE_KV` keys."""
    if impl.max_q_len is None or SHAPES["q"][1] <= impl.max_q_len:
        return SHAPES
    return dict(q=(2, impl.max_q_len, 4, 16), k=(2, DECODE_KV, 2, 16), v=(2, DECODE_KV, 2, 8))


@contextlib.contextmanager
def _compilations():
    """Yields a list that collects the backend compilations that happen inside."""
    events: list[str] = []

    def listener(event: str, duration: float, **kwargs):
        if event.endswith("backend_compile_duration"):
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def _arrays(seed: int, shapes: dict = SHAPES) -> dict:
    """Fresh random q, k, v, dout, segment ids and mask of fixed shapes."""
    rng = np.random.default_rng(seed)
    arrays = {name: jnp.asarray(rng.standard_normal(shape), jnp.float32) for name, shape in shapes.items()}
    arrays["dout"] = jnp.asarray(rng.standard_normal((*shapes["q"][:3], shapes["v"][-1])), jnp.float32)
    q_len, kv_len = shapes["q"][1], shapes["k"][1]
    cuts = rng.integers(1, q_len, size=2)
    arrays["segment_ids"] = (
        jnp.asarray(np.arange(q_len)[None, :] >= cuts[:, None], jnp.int32),
        jnp.asarray(np.arange(kv_len)[None, :] >= cuts[:, None] + kv_len - q_len, jnp.int32),
    )
    arrays["mask"] = jnp.asarray(rng.random((2, 1, q_len, kv_len)) < 0.8)
    return arrays


def test_the_decode_shapes_split_the_keys():
    """pallas_decode cuts the decode shapes' keys into 2 shares (`num_splits`, with one
    head per query tile: the most programs, so the fewest shares)."""
    dims = Shape.of(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in _shapes(decode.IMPLEMENTATION).values()))
    tiles = pk.Tiles(OPTIONS["block_q"], OPTIONS["block_k"], 2)
    assert decode.num_splits(dims, tiles, pk.sm_count("cpu")) == 2


def test_jit_traces_and_compiles_once(impl):
    traces = []

    @jax.jit
    def step(q, k, v, dout, segment_ids, mask):
        traces.append(None)

        def attend(q, k, v):
            return jaxtile.flash_attention(
                q, k, v, segment_ids=segment_ids, mask=mask, implementation=impl.name, **OPTIONS
            )

        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(dout))

    shapes = _shapes(impl)
    with _compilations() as first:
        jax.block_until_ready(step(**_arrays(0, shapes)))
    assert first, "the first call compiled nothing: the compilation events are not being seen"
    for seed in (1, 2, 3):
        with _compilations() as again:
            jax.block_until_ready(step(**_arrays(seed, shapes)))
        assert not again, f"call with new values (seed {seed}) recompiled: {again}"
    assert len(traces) == 1, f"traced {len(traces)} times"


def test_eager_calls_do_not_recompile(impl):
    """Outside ``jit`` too: the second call with new values compiles nothing."""

    def call(arrays):
        def loss(q, k, v):
            out = jaxtile.flash_attention(
                q, k, v, segment_ids=arrays["segment_ids"], implementation=impl.name, **OPTIONS
            )
            return jnp.vdot(out, arrays["dout"])

        return jax.block_until_ready(jax.grad(loss, argnums=(0, 1, 2))(arrays["q"], arrays["k"], arrays["v"]))

    shapes = _shapes(impl)
    call(_arrays(0, shapes))
    with _compilations() as again:
        call(_arrays(1, shapes))
    assert not again, f"{len(again)} compilations on the second eager call"
