"""``flash_attention`` on arrays sharded over a device mesh along batch and heads.

Each device must compute its own shard: the compiled program may not gather q, k or v
(no all-gather, collective-permute or all-to-all), forward or backward, under ``jit``
with shardings and inside ``shard_map``. The only communication allowed is the sum of
dK and dV over head shards when several devices share one kv head (MQA, or GQA with more
head shards than kv heads). Results must equal the unsharded computation.

The checks run on 8 CPU host devices in subprocesses (see ``host_devices``), a third of
them in each of three tests. The main layouts run for every implementation whose record
takes the call (Pallas ones in interpret mode); the others, to keep the suite quick, for
the one that runs the call natively here (`_native`: what ``implementation=None`` picks)
and, where they concern what `custom_partitioning` must get right, the interpreted ones.
"""

from __future__ import annotations

import contextlib

import host_devices
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_api import taking_sinks

import jaxtile
from jaxtile import registry
from jaxtile._core import Shape
from parity.compare import TOLERANCES, compare

GATHERS = ("all-gather", "collective-permute", "all-to-all")
BATCH, LEN, HEADS, DIM = 4, 32, 8, 16


def _taking(num_kv_heads: int = HEADS, q_len: int = LEN, features: frozenset[str] = frozenset({"causal"})):
    """The records that take a float32 call of the test shape here."""
    shape = Shape(BATCH, q_len, LEN, HEADS, num_kv_heads, DIM, DIM, 4)
    features |= {"gqa"} if num_kv_heads != HEADS else set()
    platform = jax.default_backend()
    return [i for i in registry.implementations() if i.can_run(shape, "float32", features, platform) is None]


def _available(**call) -> list[str]:
    return [i.name for i in _taking(**call)]


def _native(**call) -> str:
    """The fastest implementation that takes the call natively here."""
    return next(i.name for i in _taking(**call) if jax.default_backend() in i.platforms)


def _interpreted(**call) -> list[str]:
    """Implementations that run here as interpreted Pallas kernels: opaque to XLA's
    partitioner, so they are what `custom_partitioning` must get right."""
    return [i.name for i in _taking(**call) if jax.default_backend() not in i.platforms]


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))


def _arrays(num_kv_heads: int, seed: int = 0, q_len: int = LEN):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((BATCH, q_len, HEADS, DIM))
    k = rng.standard_normal((BATCH, LEN, num_kv_heads, DIM))
    v = rng.standard_normal((BATCH, LEN, num_kv_heads, DIM))
    dout = rng.standard_normal((BATCH, q_len, HEADS, DIM))
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v, dout))


def _forward_backward(implementation: str, **options):
    """``(q, k, v, dout) -> (out, dq, dk, dv)``."""

    def run(q, k, v, dout):
        def attend(q, k, v):
            return jaxtile.flash_attention(q, k, v, implementation=implementation, block_q=16, block_k=16, **options)

        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(dout))

    return run


def _assert_matches(got, expected, what: str):
    for name, x, ref in zip(("out", "dq", "dk", "dv"), got, expected):
        error = compare(np.asarray(x), np.asarray(ref), TOLERANCES["float32"])
        assert error.ok, f"{what}: {name} differs from the unsharded result: {error}"


def _check_jit(implementation: str, num_kv_heads: int, kv_spec: P, q_len: int = LEN, **options):
    """Sharded jit: same values and shardings as unsharded, and no gather of q, k, v."""
    mesh = _mesh()
    q_spec = P("data", None, "model")
    args = _arrays(num_kv_heads, q_len=q_len)
    fn = _forward_backward(implementation, **options)
    expected = jax.jit(fn)(*args)
    specs = (q_spec, kv_spec, kv_spec, q_spec)
    sharded = jax.jit(fn, in_shardings=tuple(NamedSharding(mesh, s) for s in specs))
    what = f"{implementation}, {num_kv_heads} kv heads sharded {kv_spec}, {options}"
    compiled = sharded.lower(*args).compile()
    counts = host_devices.collectives(compiled.as_text())
    assert not any(counts[name] for name in GATHERS), f"{what}: {counts}"
    shared_kv = kv_spec != q_spec
    assert shared_kv or counts["all-reduce"] == 0, f"{what}: {counts}"
    got = compiled(*args)
    # The partitioner may lay out a summed dK, dV as it likes; everything else keeps its sharding.
    out_specs = (q_spec, q_spec) if shared_kv else (q_spec, q_spec, kv_spec, kv_spec)
    for x, spec in zip(got, out_specs):
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), f"{what}: {x.sharding} != {spec}"
    _assert_matches(got, expected, what)


def check_jit_batch_and_heads_every_implementation():
    for implementation in _available():
        _check_jit(implementation, HEADS, P("data", None, "model"), causal=True)


def check_jit_grouped_kv_heads_split_over_devices():
    # 4 kv heads over 4 head shards: every device holds the kv head of its 2 query heads.
    call = dict(num_kv_heads=4, features=frozenset({"window"}))
    for implementation in (_native(**call), *_interpreted(**call)):
        _check_jit(implementation, 4, P("data", None, "model"), window=(5, 3))


def check_jit_decode_every_implementation():
    # A few new queries against the whole cache, GQA: what decode kernels run.
    for implementation in _available(num_kv_heads=4, q_len=4):
        _check_jit(implementation, 4, P("data", None, "model"), q_len=4, causal=True)


def check_jit_kv_heads_shared_by_head_shards():
    # MQA, and 2 kv heads over 4 head shards: k, v replicated over "model"; each device
    # uses one kv head, and dK, dV are summed over the head shards.
    _check_jit(_native(num_kv_heads=2), 2, P("data"), causal=True)
    for implementation in _interpreted(num_kv_heads=1):
        _check_jit(implementation, 1, P("data"), causal=True)


def check_jit_with_gspmd_partitioner():
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        _check_jit(_native(), HEADS, P("data", None, "model"), causal=True)
        _check_jit(_native(num_kv_heads=1), 1, P("data"), causal=True)
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)


def _check_jit_per_head(implementation: str, argument: str, value, seed: int = 0):
    """``flash_attention(..., causal=True, **{argument: value})`` with ``value`` sharded
    like the heads (its first dimension): no gather of q, k or v, and the outputs and
    gradients (``value``'s among them, summed over the batch shards: the one all-reduce)
    of the unsharded call."""
    mesh = _mesh()
    q, k, v, dout = _arrays(HEADS, seed=seed)

    def run(q, k, v, value, dout):
        def attend(q, k, v, value):
            options = {argument: value}
            return jaxtile.flash_attention(q, k, v, causal=True, implementation=implementation, **options)

        out, vjp = jax.vjp(attend, q, k, v, value)
        return (out, *vjp(dout))

    expected = jax.jit(run)(q, k, v, value, dout)
    qs, hs = NamedSharding(mesh, P("data", None, "model")), NamedSharding(mesh, P("model"))
    compiled = jax.jit(run, in_shardings=(qs, qs, qs, hs, qs)).lower(q, k, v, value, dout).compile()
    counts = host_devices.collectives(compiled.as_text())
    assert not any(counts[name] for name in GATHERS), f"{implementation} with {argument}: {counts}"
    got = compiled(q, k, v, value, dout)
    for name, x, ref in zip(("out", "dq", "dk", "dv", f"d{argument}"), got, expected):
        error = compare(np.asarray(x), np.asarray(ref), TOLERANCES["float32"])
        assert error.ok, f"{implementation} with {argument}: {name} differs from the unsharded result: {error}"


def check_jit_bias_per_head_sharded_with_the_heads():
    # A bias [heads, q, k]: its gradient is formed per batch element and head on each device.
    bias = jnp.asarray(np.random.default_rng(5).standard_normal((HEADS, LEN, LEN)), jnp.float32)
    for implementation in _available(features=frozenset({"causal", "bias"})):
        _check_jit_per_head(implementation, "bias", bias)


def check_jit_sinks_taken_by_the_forward_sharded_with_the_heads():
    # Sinks [heads] given to forward passes that take them (`takes_sinks`): each device
    # takes its own, and `_core.differentiable` forms their gradient.
    sinks = jnp.linspace(-1.0, 1.0, HEADS)
    for name in (_native(), *_interpreted()):
        if registry.get(name).lse_backward:
            with taking_sinks(registry.get(name)) as record:
                _check_jit_per_head(record.name, "sinks", sinks, seed=6)


def _check_vma(implementation: str) -> bool:
    """Pallas interpret mode runs kernels in a while loop whose carries drop the inputs'
    varying mesh axes (a JAX interpreter limitation; compiled kernels keep them)."""
    return jax.default_backend() in registry.get(implementation).platforms


def check_shard_map():
    mesh = _mesh()
    spec = P("data", None, "model")
    args = _arrays(HEADS, seed=1)
    for implementation in (_native(), *_interpreted()):
        fn = _forward_backward(implementation, causal=True)
        mapped = jax.jit(
            jax.shard_map(
                fn, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 4, check_vma=_check_vma(implementation)
            )
        )
        compiled = mapped.lower(*args).compile()
        counts = host_devices.collectives(compiled.as_text())
        assert not any(counts.values()), f"{implementation} in shard_map: {counts}"
        _assert_matches(compiled(*args), jax.jit(fn)(*args), f"{implementation} in shard_map")


def check_sequence_sharding_is_gathered_correctly():
    # Sequences are not split by flash_attention (ring_attention does that); a sequence-
    # sharded input is gathered and the result is still exact.
    mesh = _mesh()
    spec = NamedSharding(mesh, P("data", "model"))
    args = _arrays(2, seed=2)
    fn = _forward_backward(_native(num_kv_heads=2), causal=True)
    _assert_matches(jax.jit(fn, in_shardings=(spec,) * 4)(*args), jax.jit(fn)(*args), "sequence-sharded")


def check_explicit_sharding_in_types():
    # A mesh with Explicit axes (jax.make_mesh's default in newer JAX): arrays carry their
    # sharding in their types, and each layout above must work, gather-free, from them too.
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    q_spec = P("data", None, "model")
    for num_kv_heads, kv_spec in ((HEADS, q_spec), (4, q_spec), (1, P("data"))):
        args = _arrays(num_kv_heads, seed=3)
        call = dict(num_kv_heads=num_kv_heads)
        taking = _available() if num_kv_heads == HEADS else (_native(**call), *_interpreted(**call))
        for implementation in taking:
            fn = _forward_backward(implementation, causal=True)
            what = f"{implementation}, {num_kv_heads} kv heads sharded {kv_spec} in types"
            specs = (q_spec, kv_spec, kv_spec, q_spec)
            sharded = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
            # Inside a mesh context for the first layout, outside it (types alone) for the others.
            with jax.set_mesh(mesh) if num_kv_heads == HEADS else contextlib.nullcontext():
                compiled = jax.jit(fn).lower(*sharded).compile()
                got = compiled(*sharded)
            counts = host_devices.collectives(compiled.as_text())
            assert not any(counts[name] for name in GATHERS), f"{what}: {counts}"
            assert got[0].sharding.spec == P("data", None, "model", None), f"{what}: {got[0].sharding}"
            _assert_matches(got, jax.jit(fn)(*args), what)
    # Only k and v sharded in their types, q an ordinary array: q's (lack of) sharding decides.
    args = _arrays(HEADS, seed=4)
    native = _native()
    fn = _forward_backward(native, causal=True)
    kv = [jax.device_put(x, NamedSharding(mesh, P("data", None, "model"))) for x in args[1:3]]
    got = jax.jit(fn)(args[0], *kv, args[3])
    _assert_matches(got, jax.jit(fn)(*args), f"{native}, only k and v sharded in types")


@pytest.mark.parametrize("part", range(3))
def test_on_eight_host_devices(part):
    host_devices.assert_checks_pass(__file__, part=(part, 3))
