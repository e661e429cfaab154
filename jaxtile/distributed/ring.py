"""Ring attention: exact attention over sequences sharded across devices.

Liu, Zaharia and Abbeel (2023), "Ring Attention with Blockwise Transformers for
Near-Infinite Context". Inside ``shard_map``, device ``i`` of a mesh axis of size ``P``
holds shard ``i`` of the queries, keys and values (positions ``[i·n, (i+1)·n)``). It
keeps its queries; key/value shards travel around the ring with ``lax.ppermute``, so at
step ``s`` device ``i`` holds kv shard ``j = (i - s) mod P``. Each block is one call of a
jaxtile implementation, returning its output and lse; blocks merge through their
log-sum-exp, as the tiles of FlashAttention's online softmax do.

With ``causal``, the block of the device's own shard (step 0) is causal, the shards
before it (``j < i``) are fully visible, and those after it are skipped by ``lax.switch``
at no cost. The backward pass is a ``custom_vjp`` that goes around the ring again: key
and value shards rotate together with their dK and dV accumulators, which arrive back at
their owner after ``P`` steps. Each block's gradients come from the implementation's own
FlashAttention-2 backward given the *global* output and lse (``P = exp(S - lse)`` and
``D = rowsum(dO ∘ O)`` are then the global ones). No device ever holds more than one
shard of the sequence. The causal work is not load-balanced across devices.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable

import jax
import jax.numpy as jnp
from jax import lax

from jaxtile import _inputs, api, registry
from jaxtile import _softmax as sm
from jaxtile._core import Config, Inputs


@dataclasses.dataclass(frozen=True)
class _Ring:
    """Static description of one ring: the implementation, the block configurations
    (``diagonal`` for the device's own kv shard, ``remote`` for a fully visible one),
    the mesh axis and its size."""

    implementation: registry.Implementation
    diagonal: Config
    remote: Config
    axis_name: Hashable
    size: int
    causal: bool

    def switch(self, step, block, kv, acc):
        """Runs ``block(config, kv, acc) -> acc`` for the kv shard held at ``step``:
        with ``causal``, the diagonal config at step 0, the remote one for shards before
        this device's, and nothing for shards after it."""
        if not self.causal:
            return block(self.remote, kv, acc)
        index = lax.axis_index(self.axis_name)
        kind = jnp.where(step == 0, 0, jnp.where(index >= step, 1, 2))
        branches = (functools.partial(block, self.diagonal), functools.partial(block, self.remote), _skip)
        return lax.switch(kind, branches, kv, acc)

    def rotate(self, x):
        """Sends every device's ``x`` to the next device of the ring."""
        perm = [(d, (d + 1) % self.size) for d in range(self.size)]
        return jax.tree.map(lambda a: lax.ppermute(a, self.axis_name, perm), x)


# What ring attention needs of an implementation, and how to say so.
_LSE_BACKWARD = (
    lambda implementation: implementation.lse_backward,
    "ring_attention needs a backward pass driven by the global lse (Implementation.lse_backward)",
)


def _skip(kv, acc):
    return acc


def _block(inputs: Inputs, kv) -> Inputs:
    k, v, kv_segment_ids = kv
    return Inputs(inputs.q, k, v, inputs.q_segment_ids, kv_segment_ids, None)


def _forward(inputs: Inputs, ring: _Ring):
    b, n, h, _ = inputs.q.shape
    # *_like: carries vary over the mesh axes the inputs vary over (shard_map's check_vma).
    acc = (
        jnp.zeros_like(inputs.q, jnp.float32, shape=(b, n, h, inputs.v.shape[-1])),
        jnp.full_like(inputs.q, -jnp.inf, jnp.float32, shape=(b, h, n)),
    )

    def attend(config, kv, acc):
        out, lse, _ = ring.implementation.forward(_block(inputs, kv), config)
        return sm.merge(jnp.stack([acc[0], out.astype(jnp.float32)]), jnp.stack([acc[1], lse]))

    def step(s, carry):
        kv, acc = carry
        ahead = ring.rotate(kv)
        return ahead, ring.switch(s, attend, kv, acc)

    kv = (inputs.k, inputs.v, inputs.kv_segment_ids)
    _, (out, lse) = lax.fori_loop(0, ring.size, step, (kv, acc))
    return out.astype(inputs.q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _ring(inputs: Inputs, ring: _Ring):
    return _forward(inputs, ring)


def _ring_fwd(inputs: Inputs, ring: _Ring):
    out, lse = _forward(inputs, ring)
    return (out, lse), (inputs, out, lse)


def _ring_bwd(ring: _Ring, residuals, cotangents):
    inputs, out, lse = residuals
    dout, dlse = cotangents

    def grads(config, kv, acc):
        g_q, g_k, g_v, _ = ring.implementation.backward(_block(inputs, kv), out, lse, dout, dlse, config)
        dq, (dk, dv) = acc
        return dq + g_q, (dk + g_k, dv + g_v)

    def step(s, carry):
        kv, acc = carry
        ahead = ring.rotate(kv)
        dq, dkv = ring.switch(s, grads, kv, acc)
        # dK, dV travel with their shard and are back with its owner after `size` steps.
        return ahead, (dq, ring.rotate(dkv))

    f32 = functools.partial(jnp.zeros_like, dtype=jnp.float32)
    acc = (f32(inputs.q), (f32(inputs.k), f32(inputs.v)))
    kv = (inputs.k, inputs.v, inputs.kv_segment_ids)
    _, (dq, (dk, dv)) = lax.fori_loop(0, ring.size, step, (kv, acc))
    return (Inputs(dq.astype(inputs.q.dtype), dk.astype(inputs.k.dtype), dv.astype(inputs.v.dtype)),)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    axis_name: Hashable,
    causal: bool = False,
    segment_ids: jax.Array | tuple[jax.Array, jax.Array] | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    scale: float | None = None,
    implementation: str | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    tuning=None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Exact attention over sequences sharded along the mesh axis ``axis_name``.

    Call it inside ``shard_map`` with the sequence dimension of query, key, value (and
    segment ids) sharded contiguously over ``axis_name``: device ``i`` holds positions
    ``[i·n, (i+1)·n)``. Shapes are the local shards, as in `jaxtile.flash_attention`.

    Args:
      query: ``[batch..., n_q, num_heads, head_dim]``, this device's query shard.
      key: ``[batch..., n_kv, num_kv_heads, head_dim]``, this device's key shard.
      value: ``[batch..., n_kv, num_kv_heads, head_dim_v]``.
      axis_name: the mesh axis the sequence is sharded over.
      causal: causal attention over the global positions; needs ``n_q == n_kv``.
      segment_ids: local shards of the segment ids, ``[batch..., n]`` (when
        ``n_q == n_kv``) or a ``(q_ids, kv_ids)`` pair; the kv ids travel with k and v.
      logits_soft_cap, sinks, scale, block_q, block_k, tuning: as in
        `jaxtile.flash_attention` (the sinks join each row once, after the ring).
      implementation: an implementation whose backward pass the global lse can drive
        (whose record sets `Implementation.lse_backward`), or None for the fastest of
        those on the platform.
      return_lse: also return the lse over the whole sequence.

    Returns:
      ``out [batch..., n_q, num_heads, head_dim_v]`` for this device's queries (and with
      ``return_lse`` their ``lse [batch..., num_heads, n_q]``), equal to
      ``flash_attention`` on the gathered sequences, shard by shard.
    """
    implementation, inputs, diagonal, batch = api.prepare(
        query,
        key,
        value,
        implementation=implementation,
        return_lse=return_lse,
        causal=causal,
        window=None,
        segment_ids=segment_ids,
        mask=None,
        logits_soft_cap=logits_soft_cap,
        scale=scale,
        block_q=block_q,
        block_k=block_k,
        tuning=tuning,
        require=_LSE_BACKWARD,
    )
    q_len, kv_len = diagonal.mask.q_len, diagonal.mask.kv_len
    if causal and q_len != kv_len:
        raise ValueError(f"causal ring attention needs query and key shards of equal length; got {q_len=}, {kv_len=}")
    remote = dataclasses.replace(diagonal, mask=dataclasses.replace(diagonal.mask, right=None))
    ring = _Ring(implementation, diagonal, remote, axis_name, lax.axis_size(axis_name), causal)
    sinks = _inputs.check_sinks(sinks, inputs.q.shape[2])
    out, lse = _ring(inputs, ring)
    if sinks is not None:
        out, lse = sm.with_sinks(out, lse, sinks)
    out = out.reshape(*batch, *out.shape[1:])
    if not return_lse:
        return out
    return out, lse.reshape(*batch, *lse.shape[1:])
