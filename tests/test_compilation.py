"""Repeated calls with the same shapes and options neither retrace nor recompile.

Traces are counted by a Python side effect in the traced function; compilations by JAX's
public ``jax.monitoring`` events (one ``backend_compile`` event per XLA compilation).
New values, of the inputs and of the runtime mask arrays (segment ids, dense mask), must
reuse the compiled program.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

import jaxtile

SHAPES = dict(q=(2, 40, 4, 16), k=(2, 48, 2, 16), v=(2, 48, 2, 8))
OPTIONS = dict(causal=True, window=(24, 0), block_q=16, block_k=16)


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


def _arrays(seed: int) -> dict:
    """Fresh random q, k, v, dout, segment ids and mask of fixed shapes."""
    rng = np.random.default_rng(seed)
    arrays = {name: jnp.asarray(rng.standard_normal(shape), jnp.float32) for name, shape in SHAPES.items()}
    arrays["dout"] = jnp.asarray(rng.standard_normal((*SHAPES["q"][:3], SHAPES["v"][-1])), jnp.float32)
    cuts = rng.integers(1, 40, size=2)
    arrays["segment_ids"] = (
        jnp.asarray(np.arange(40)[None, :] >= cuts[:, None], jnp.int32),
        jnp.asarray(np.arange(48)[None, :] >= cuts[:, None] + 8, jnp.int32),
    )
    arrays["mask"] = jnp.asarray(rng.random((2, 1, 40, 48)) < 0.8)
    return arrays


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

    with _compilations() as first:
        jax.block_until_ready(step(**_arrays(0)))
    assert first, "the first call compiled nothing: the compilation events are not being seen"
    for seed in (1, 2, 3):
        with _compilations() as again:
            jax.block_until_ready(step(**_arrays(seed)))
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

    call(_arrays(0))
    with _compilations() as again:
        call(_arrays(1))
    assert not again, f"{len(again)} compilations on the second eager call"
