"""``jaxtile.ring_attention``: sequences sharded over a mesh axis, inside ``shard_map``.

Output, lse and gradients must equal single-device ``flash_attention`` on the whole
sequences; the compiled program may only pass shards around the ring (collective-permute,
never an all-gather), and causal attention must skip the blocks it cannot see. The
checks run on 8 CPU host devices in a subprocess (see ``host_devices``).
"""

from __future__ import annotations

import host_devices
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxtile
from jaxtile import registry
from parity.compare import TOLERANCES, compare

QUANTITIES = ("out", "lse", "dq", "dk", "dv")


def _arrays(batch, length, num_heads, num_kv_heads, head_dim, seed=0):
    rng = np.random.default_rng(seed)
    shapes = {
        "q": (batch, length, num_heads, head_dim),
        "k": (batch, length, num_kv_heads, head_dim),
        "v": (batch, length, num_kv_heads, head_dim),
        "dout": (batch, length, num_heads, head_dim),
        "dlse": (batch, num_heads, length),
    }
    return {name: jnp.asarray(rng.standard_normal(shape), jnp.float32) for name, shape in shapes.items()}


def _run(attend, arrays, segment_ids):
    """``(out, lse, dq, dk, dv)`` of ``attend(q, k, v, segment_ids)`` with random cotangents."""
    (out, lse), vjp = jax.vjp(lambda q, k, v: attend(q, k, v, segment_ids), arrays["q"], arrays["k"], arrays["v"])
    return (out, lse, *vjp((arrays["dout"], arrays["dlse"])))


def _check_ring(mesh: Mesh, implementation: str, *, causal: bool, num_kv_heads: int, segments: bool, block: int):
    """Ring attention over the mesh's "seq" axis (batch over "data" if there is one)."""
    data = "data" if "data" in mesh.axis_names else None
    seq_spec, lse_spec = P(data, "seq"), P(data, None, "seq")
    arrays = _arrays(2, 16 * mesh.shape["seq"], 4, num_kv_heads, 16)
    segment_ids = None
    if segments:
        ids = np.cumsum(np.random.default_rng(1).random((2, arrays["q"].shape[1])) < 0.05, axis=1)
        segment_ids = jnp.asarray(ids, jnp.int32)
    options = dict(causal=causal, implementation=implementation, block_q=block, block_k=block, return_lse=True)

    def ring(q, k, v, segment_ids):
        return jaxtile.ring_attention(q, k, v, axis_name="seq", segment_ids=segment_ids, **options)

    def whole(q, k, v, segment_ids):
        # The same implementation where its record takes whole sequences (a decode kernel
        # takes only a shard's few queries); the default one otherwise.
        takes = registry.get(implementation).max_q_len is None
        return jaxtile.flash_attention(
            q, k, v, segment_ids=segment_ids, **options | {"implementation": implementation if takes else None}
        )

    in_specs = (dict.fromkeys(arrays, seq_spec) | {"dlse": lse_spec}, P() if segment_ids is None else seq_spec)
    sharded = jax.jit(
        jax.shard_map(
            _run_with(ring),
            mesh=mesh,
            in_specs=in_specs,
            out_specs=(seq_spec, lse_spec, seq_spec, seq_spec, seq_spec),
            # Pallas interpret mode drops varying mesh axes in its loop (JAX limitation).
            check_vma=jax.default_backend() in registry.get(implementation).platforms,
        )
    )
    what = f"{implementation}, {dict(mesh.shape)}, {causal=}, {num_kv_heads=}, {segments=}"
    counts = host_devices.collectives(sharded.lower(arrays, segment_ids).compile().as_text())
    assert counts["all-gather"] == counts["all-to-all"] == 0 and counts["collective-permute"] > 0, f"{what}: {counts}"
    got = sharded(arrays, segment_ids)
    expected = jax.jit(_run_with(whole))(arrays, segment_ids)
    for name, x, ref in zip(QUANTITIES, got, expected):
        error = compare(np.asarray(x), np.asarray(ref), TOLERANCES["float32"])
        assert error.ok, f"{what}: {name} differs from single-device flash_attention: {error}"


def _run_with(attend):
    return lambda arrays, segment_ids: _run(attend, arrays, segment_ids)


def _ring_implementations() -> list[str]:
    """Every registered implementation whose backward pass the global lse can drive, among
    those that run here."""
    return [i.name for i in registry.implementations() if i.lse_backward and i.unable(jax.default_backend()) is None]


def check_causal_ring_of_eight_gqa():
    mesh = Mesh(np.array(jax.devices()), ("seq",))
    _check_ring(mesh, "scan_v2", causal=True, num_kv_heads=2, segments=False, block=8)


def check_full_ring_with_segments_and_batch_sharding():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "seq"))
    _check_ring(mesh, "scan_v2", causal=False, num_kv_heads=4, segments=True, block=16)
    _check_ring(mesh, "scan_v2", causal=True, num_kv_heads=1, segments=True, block=16)


def check_every_ring_implementation():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "seq"))
    for implementation in _ring_implementations():
        _check_ring(mesh, implementation, causal=True, num_kv_heads=2, segments=False, block=16)


def check_ring_with_sinks():
    # The sinks join each row once, after the ring: out, lse and all four gradients
    # equal single-device flash_attention's (the sinks' gradient summed over shards).
    mesh = Mesh(np.array(jax.devices()), ("seq",))
    arrays = _arrays(2, 16 * 8, 4, 2, 16, seed=3)
    sinks = jnp.asarray(np.random.default_rng(4).standard_normal(4), jnp.float32)
    options = dict(causal=True, implementation="scan_v2", block_q=8, block_k=8, return_lse=True)

    def run(attend, q, k, v, sinks, dout):
        (out, lse), vjp = jax.vjp(attend, q, k, v, sinks)
        return (out, lse, *vjp((dout, jnp.zeros_like(lse))))

    def ring(q, k, v, sinks, dout):
        out, lse, dq, dk, dv, dsinks = run(
            lambda *p: jaxtile.ring_attention(*p[:3], axis_name="seq", sinks=p[3], **options), q, k, v, sinks, dout
        )
        return out, lse, dq, dk, dv, jax.lax.psum(dsinks, "seq")

    seq, lse_spec = P(None, "seq"), P(None, None, "seq")
    sharded = jax.jit(
        jax.shard_map(
            ring,
            mesh=mesh,
            in_specs=(seq, seq, seq, P(), seq),
            out_specs=(seq, lse_spec, seq, seq, seq, P()),
            check_vma=False,
        )
    )
    args = (arrays["q"], arrays["k"], arrays["v"], sinks, arrays["dout"])
    got = sharded(*args)
    expected = run(lambda *p: jaxtile.flash_attention(*p[:3], sinks=p[3], **options), *args)
    for name, x, ref in zip((*QUANTITIES, "dsinks"), got, expected):
        error = compare(np.asarray(x), np.asarray(ref), TOLERANCES["float32"])
        assert error.ok, f"ring with sinks: {name} differs from single-device flash_attention: {error}"


def _eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                    yield from _eqns(getattr(sub, "jaxpr", sub))


def check_causal_ring_skips_invisible_shards():
    # Forward and backward each switch between the diagonal block, a visible shard and a
    # skipped one; the skipped branch does no matrix product.
    mesh = Mesh(np.array(jax.devices()), ("seq",))
    x = jnp.ones((1, 64, 2, 8), jnp.float32)

    def loss(q):
        return jnp.sum(jaxtile.ring_attention(q, q, q, axis_name="seq", causal=True, implementation="scan_v2"))

    grad = jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"))
    switches = [eqn for eqn in _eqns(jax.make_jaxpr(grad)(x).jaxpr) if eqn.primitive.name == "cond"]
    switches = [eqn.params["branches"] for eqn in switches if len(eqn.params["branches"]) == 3]
    assert len(switches) == 2, f"expected a forward and a backward switch, got {len(switches)}"
    for branches in switches:
        products = [sum(e.primitive.name == "dot_general" for e in _eqns(b.jaxpr)) for b in branches]
        assert products[0] > 0 and products[1] > 0 and products[2] == 0, products


def test_on_eight_host_devices():
    host_devices.assert_checks_pass(__file__)


def test_unsupported_implementation_is_refused():
    q = jnp.ones((1, 8, 2, 8), jnp.float32)
    with pytest.raises(NotImplementedError, match="'reference'"):
        jax.shard_map(
            lambda q: jaxtile.ring_attention(q, q, q, axis_name="seq", implementation="reference"),
            mesh=Mesh(np.array(jax.devices()[:1]), ("seq",)),
            in_specs=P(None, "seq"),
            out_specs=P(None, "seq"),
        )(q)


def test_causal_needs_equal_shards():
    q, k = jnp.ones((1, 8, 2, 8), jnp.float32), jnp.ones((1, 16, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match="q_len=8, kv_len=16"):
        jax.shard_map(
            lambda q, k: jaxtile.ring_attention(q, k, k, axis_name="seq", causal=True),
            mesh=Mesh(np.array(jax.devices()[:1]), ("seq",)),
            in_specs=(P(None, "seq"), P(None, "seq")),
            out_specs=P(None, "seq"),
        )(q, k)
