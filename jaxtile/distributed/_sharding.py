"""Batch- and head-sharded attention, computed shard by shard with no communication.

Attention is independent across batch elements and heads, so arrays sharded along those
dimensions need no communication. XLA's partitioner sees that through the ``jax.lax``
implementations, but a Pallas kernel is an opaque custom call that it can only run
replicated, after all-gathering q, k and v. `partitioned` wraps an implementation's
forward and backward passes each in ``jax.experimental.custom_partitioning``: the batch
and head sharding of the query is kept, every device runs the implementation on its own
shard, and sequence and head_dim dimensions are replicated (the partitioner gathers them
if they arrive sharded; `jaxtile.ring_attention` is the way to shard sequences).

Query heads stay sharded if the number of head shards divides ``num_heads``. When it
also divides ``num_kv_heads``, each device holds its own kv heads; when it is a multiple
of ``num_kv_heads`` instead (MQA, or GQA with more shards than kv heads), k and v are
replicated over the head shards, each device slices out the kv head of its query heads,
and the backward pass sums dK and dV over the head shards (the one communication this
layout needs). Other head shardings are gathered. Inside ``shard_map`` the wrapper
lowers to the plain implementation, and under ``vmap`` it steps aside for the
implementation's own batching rule. Arrays sharded in their types (a mesh with
``Explicit`` axes) take the same layout through ``shard_map`` instead.

The implementation's forward pass must save per-row statistics shaped ``[batch,
num_heads, ...]`` (the lse, or ``(m, l)``); one that saves anything else is left to XLA's
partitioner.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtile._core import Attention, Backward, Config, Derivative, Forward, Inputs, differentiable, differentiated_as

# What each argument and result of a pass is, spelled by its dimensions: b batch, q query
# rows, t key rows, h query heads, k kv heads, d and e head dims. Softmax statistics are
# "rows" ([batch, num_heads, ...]); the dense mask and the bias are [1|batch, 1|num_heads,
# 1|q, 1|t]; the lengths are [batch, 2] (z: the pair); the bias's gradient is per score;
# the sinks are per query head.
_SEQ_Q, _SEQ_K, _IDS_Q, _IDS_K, _MASK, _ROWS, _LENGTHS = "bqhd", "btkd", "bq", "bt", "mask", "rows", "bz"
_SCORES, _HEADS = "bhqt", "h"
_INPUTS = Inputs(_SEQ_Q, _SEQ_K, _SEQ_K, _IDS_Q, _IDS_K, _MASK, _LENGTHS, _MASK, _HEADS)


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How one call is split over the mesh.

    ``batch`` and ``heads`` are the ``PartitionSpec`` entries of the query's batch and
    head dimensions; ``shared_kv`` says k and v are replicated over the ``heads`` axes
    (each device then slices out the one kv head of its query heads).
    """

    batch: str | tuple[str, ...] | None
    heads: str | tuple[str, ...] | None
    head_shards: int
    shared_kv: bool

    @classmethod
    def create(cls, mesh, q_sharding, num_heads: int, num_kv_heads: int) -> _Layout:
        if not isinstance(q_sharding, NamedSharding):
            return cls(None, None, 1, False)
        spec = (*q_sharding.spec, None, None, None, None)
        batch, heads = spec[0], spec[2]
        shards = math.prod(mesh.shape[name] for name in _axes(heads))
        if num_heads % shards or (num_kv_heads % shards and shards % num_kv_heads):
            heads, shards = None, 1
        return cls(batch, heads, shards, num_kv_heads % shards != 0)

    def spec(self, role: str, shape) -> P:
        """The partition spec of an array of ``role`` and ``shape``."""
        if role == _MASK:
            return P(self.batch if shape[0] > 1 else None, self.heads if shape[1] > 1 else None, None, None)
        if role == _ROWS:
            return P(self.batch, self.heads, *(None,) * (len(shape) - 2))
        kv_heads = None if self.shared_kv else self.heads
        return P(
            *(self.batch if c == "b" else self.heads if c == "h" else kv_heads if c == "k" else None for c in role)
        )

    def kv_head(self, num_kv_heads: int):
        """Where kv heads are shared: the index of the kv head this device's query heads use."""
        return lax.axis_index(self.heads) // (self.head_shards // num_kv_heads)

    def per_device(self, fun, arg_roles, result_roles, num_kv_heads: int):
        """``fun`` as each device runs it: with shared kv heads, it slices out its own
        kv head and sums the kv gradients over the head shards."""
        if not self.shared_kv:
            return fun

        def run(*args):
            head = self.kv_head(num_kv_heads)
            args = jax.tree.map(
                lambda r, x: lax.dynamic_slice_in_dim(x, head, 1, 2) if r == _SEQ_K else x, arg_roles, args
            )
            results = fun(*args)

            def gather(role, x):
                if role != _SEQ_K:
                    return x
                full = jnp.zeros((*x.shape[:2], num_kv_heads, *x.shape[3:]), x.dtype)
                return lax.psum(lax.dynamic_update_slice_in_dim(full, x, head, 2), self.heads)

            return jax.tree.map(gather, result_roles, results)

        return run


def _roles(tree, roles):
    """``roles`` broadcast to the leaves of ``tree`` (None leaves of ``tree`` drop out)."""
    return jax.tree.map(lambda role, sub: jax.tree.map(lambda _: role, sub), roles, tree)


def _factors(role: str, shape, group: int, index: int) -> str:
    """The Shardy factors of one operand or result, for its sharding rule.

    Query and kv heads are separate factors when their numbers differ (a compound
    ``(k g)`` lets Shardy split mesh axes into sub-axes that no ``PartitionSpec`` can
    express); the partition callback matches them up.
    """
    if role == _MASK:
        names = ("b", "h", "q", "t")
        return " ".join(n if s > 1 else f"one{index}_{i}" for i, (n, s) in enumerate(zip(names, shape)))
    if role == _ROWS:
        return " ".join(["b", "h", *(f"r{index}_{i}" for i in range(len(shape) - 2))])
    return " ".join("h" if c == "k" and group == 1 else c for c in role)


def _per_shard(fun, arg_roles, result_roles, args: tuple, config: Config):
    """``fun(*args, config)`` run per batch/head shard; the roles say what each argument
    and result is (pytrees of role strings, prefixes of ``args`` and of the results)."""
    plain = functools.partial(_call_with, fun, config)
    shapes = jax.eval_shape(plain, *args)
    arg_roles, result_roles = _roles(args, arg_roles), _roles(shapes, result_roles)
    num_heads, num_kv_heads = args[0].q.shape[2], args[0].k.shape[2]
    rows = [x.shape[:2] for r, x in zip(jax.tree.leaves(result_roles), jax.tree.leaves(shapes)) if r == _ROWS]
    if any(shape != (args[0].q.shape[0], num_heads) for shape in rows):
        return plain(*args)  # statistics of another layout: left to XLA's partitioner

    def shardings(layout: _Layout, mesh, roles, tree):
        return jax.tree.map(lambda r, x: NamedSharding(mesh, layout.spec(r, x.shape)), roles, tree)

    def infer(mesh, arg_shapes, result_shapes):
        layout = _Layout.create(mesh, arg_shapes[0].q.sharding, num_heads, num_kv_heads)
        return shardings(layout, mesh, result_roles, result_shapes)

    def partition(mesh, arg_shapes, result_shapes):
        layout = _Layout.create(mesh, arg_shapes[0].q.sharding, num_heads, num_kv_heads)
        return (
            mesh,
            layout.per_device(plain, arg_roles, result_roles, num_kv_heads),
            shardings(layout, mesh, result_roles, result_shapes),
            shardings(layout, mesh, arg_roles, arg_shapes),
        )

    group = num_heads // num_kv_heads
    operands = [(r, x.shape) for r, x in zip(jax.tree.leaves(arg_roles), jax.tree.leaves(args))]
    results = [(r, x.shape) for r, x in zip(jax.tree.leaves(result_roles), jax.tree.leaves(shapes))]
    factors = [_factors(r, s, group, i) for i, (r, s) in enumerate(operands + results)]
    rule = f"{', '.join(factors[: len(operands)])} -> {', '.join(factors[len(operands) :])}"
    # Only batch and heads may be sharded; Shardy wants factors in order of appearance.
    replicated = tuple(dict.fromkeys(f for f in " ".join(factors).split() if f not in ("b", "h", "k")))
    run = custom_partitioning(plain)
    run.def_partition(partition, infer, sharding_rule=rule, need_replication_factors=replicated)
    return _unbatched(run, plain)(*args)


def _call_with(fun, config: Config, *args):
    return fun(*args, config)


def _unbatched(partitioned_fun, plain_fun):
    """``partitioned_fun``, except under ``vmap``, where ``plain_fun`` is batched instead
    (``custom_partitioning`` has no batching rule)."""
    fun = custom_vmap(partitioned_fun)

    @fun.def_vmap
    def rule(axis_size, in_batched, *args):
        in_axes = jax.tree.map(lambda batched: 0 if batched else None, tuple(in_batched))
        out = jax.vmap(plain_fun, in_axes=in_axes)(*args)
        return out, jax.tree.map(lambda _: True, out)

    return fun


def partitioned(forward: Forward, backward: Backward, derivative: Callable[[Callable], Derivative]) -> Attention:
    """An implementation's passes as one differentiable attention run per batch/head
    shard: ``(inputs, config) -> (out, lse)``.

    ``forward`` and ``backward`` each run inside ``custom_partitioning`` (the forward's
    statistics must be per-row, ``[batch, num_heads, ...]``, else they are left to XLA's
    partitioner), and `_core.differentiable` joins them; inputs sharded in their types
    take `_explicit_shards` instead. ``derivative(pass)`` is what differentiating a pass
    runs (`_core.differentiated_as`): unpartitioned, since ``custom_partitioning`` has
    no differentiation rule, and left to XLA's partitioner.
    """

    def forward_shards(inputs: Inputs, config: Config):
        return _per_shard(forward, (_INPUTS,), (_SEQ_Q, _ROWS, _ROWS), (inputs,), config)

    def backward_shards(inputs: Inputs, out, stats, dout, dlse, config: Config):
        roles = ((_INPUTS, _SEQ_Q, _ROWS, _SEQ_Q, _ROWS), (_SEQ_Q, _SEQ_K, _SEQ_K, _SCORES))
        return _per_shard(backward, *roles, (inputs, out, stats, dout, dlse), config)

    forward_d, backward_d = derivative(forward), derivative(backward)
    auto = differentiable(differentiated_as(forward_shards, forward_d), differentiated_as(backward_shards, backward_d))
    plain = differentiable(differentiated_as(forward, forward_d), differentiated_as(backward, backward_d))

    def attend(inputs: Inputs, config: Config):
        if (sharding := _explicit_sharding(inputs)) is None:
            return auto(inputs, config)
        return _explicit_shards(plain, sharding.mesh, inputs, config)

    return attend


def _explicit_sharding(inputs: Inputs) -> NamedSharding | None:
    """The sharding of the first input sharded in its type (a mesh with ``Explicit``
    axes), or None if there is none."""
    for x in jax.tree.leaves(inputs):
        sharding = getattr(jax.typeof(x), "sharding", None)
        if isinstance(sharding, NamedSharding) and any(entry is not None for entry in sharding.spec):
            return sharding
    return None


def _explicit_shards(attention: Attention, mesh, inputs: Inputs, config: Config):
    """``attention`` per batch/head shard of ``mesh`` inside ``shard_map``, for inputs
    sharded in their types (where ``custom_partitioning`` and Pallas refs do not apply):
    the same layout as the partitioned path, inputs resharded to it first (sequences
    gathered), and with shared kv heads each device slicing out its own (``shard_map``
    sums their gradients)."""
    num_heads, num_kv_heads = inputs.q.shape[2], inputs.k.shape[2]
    q_spec = jax.typeof(inputs.q).sharding.spec  # P() if q itself is not sharded
    layout = _Layout.create(mesh, NamedSharding(mesh, q_spec), num_heads, num_kv_heads)
    roles = _roles(inputs, _INPUTS)
    specs = jax.tree.map(lambda role, x: layout.spec(role, x.shape), roles, inputs)
    inputs = jax.tree.map(lambda x, spec: jax.sharding.reshard(x, NamedSharding(mesh, spec)), inputs, specs)

    def local(inputs: Inputs):
        if layout.shared_kv:
            head = layout.kv_head(num_kv_heads)
            k, v = (lax.dynamic_slice_in_dim(x, head, 1, 2) for x in (inputs.k, inputs.v))
            inputs = inputs._replace(k=k, v=v)
        return attention(inputs, config)

    out_specs = (layout.spec(_SEQ_Q, inputs.q.shape), layout.spec(_ROWS, (0, 0, 0)))
    # Off-GPU, Pallas kernels are interpreted in a loop that drops varying mesh axes.
    check_vma = config.platform == "gpu"
    return jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=out_specs, check_vma=check_vma)(inputs)
