"""``implementation="reference"``: materialised ``softmax(QKᵀ)V`` in float32.

The in-JAX oracle. It builds the full ``[batch, heads, q_len, kv_len]`` score matrix,
so it needs O(N²) memory; gradients come from JAX's own autodiff. It shares the mask
description with the tiled implementations, and `masked_dot` for ``P V`` (so that a NaN in
``v`` reaches only the rows that see its key), none of their softmax arithmetic.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtile import _softmax as sm
from jaxtile import registry
from jaxtile._core import Config, Inputs, Shape, group_heads


def _forward(inputs: Inputs, config: Config) -> tuple[jax.Array, jax.Array, None]:
    """Returns ``(out [batch, q_len, heads, head_dim_v], lse [batch, heads, q_len], None)``:
    no statistics, since JAX differentiates this function itself."""
    q, k, v = (x.astype(jnp.float32) for x in inputs[:3])
    batch, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    q = q.reshape(batch, q_len, num_kv_heads, group, head_dim)

    spec = config.mask
    visible = spec.visible(
        jnp.arange(spec.q_len)[:, None],
        jnp.arange(spec.kv_len)[None, :],
        q_segment=None if inputs.q_segment_ids is None else inputs.q_segment_ids[:, None, None, :, None],
        kv_segment=None if inputs.kv_segment_ids is None else inputs.kv_segment_ids[:, None, None, None, :],
        dense=None if inputs.mask is None else group_heads(inputs.mask, num_kv_heads),
        lengths=None
        if inputs.lengths is None
        else (inputs.lengths[:, 0, None, None, None, None], inputs.lengths[:, 1, None, None, None, None]),
    )
    visible = jnp.broadcast_to(visible, (batch, num_kv_heads, group, q_len, spec.kv_len))
    # Keys no query sees (padding, an unfilled cache) must not reach any row via 0 · NaN.
    seen = jnp.swapaxes(jnp.any(visible, axis=(2, 3)), 1, 2)[..., None]  # [b, kv_len, h, 1]
    k, v = jnp.where(seen, k, 0.0), jnp.where(seen, v, 0.0)

    logits = config.logits
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, precision="highest") * logits.scale
    if inputs.bias is not None:
        s = s + group_heads(inputs.bias, num_kv_heads).astype(jnp.float32)
    if logits.soft_cap is not None:
        s = logits.soft_cap * jnp.tanh(s / logits.soft_cap)
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m))
    l = jnp.sum(p, axis=-1, keepdims=True)
    empty = l == 0.0
    out = _weighted_values(p / jnp.where(empty, 1.0, l), v, visible)
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))[..., 0]
    out = out.reshape(batch, q_len, num_heads, v.shape[-1]).astype(inputs.q.dtype)
    return out, lse.reshape(batch, num_heads, q_len), None


def _memory(shape: Shape, block_q, block_k, backward: bool) -> tuple[int, int]:
    """Residuals and temporaries, in float32 score matrices. Forward: the scores S and
    the probabilities P. Backward: autodiff keeps P unnormalised and normalised, and
    forms dP and dS."""
    scores = shape.batch * shape.num_heads * shape.q_len * shape.kv_len * 4
    return (2 * scores, 2 * scores) if backward else (0, 2 * scores)


_pv = functools.partial(jnp.einsum, "bhgqk,bkhd->bqhgd", precision="highest")


@jax.custom_jvp
def _weighted_values(p, v, visible):
    """``P V``: ``p [b, h, g, q, k]``, ``v [b, k, h, d]`` -> ``[b, q, h, g, d]``, masked
    entries of ``p`` absent (`sm.masked_dot`); differentiated as the plain product."""
    return sm.masked_dot(_pv, p, v, visible)


@_weighted_values.defjvp
def _weighted_values_jvp(primals, tangents):
    p, v, visible = primals
    dp, dv, _ = tangents
    return _weighted_values(p, v, visible), _pv(dp, v) + _pv(p, dv)


IMPLEMENTATION = registry.register(
    registry.Implementation(
        name="reference",
        summary="materialised softmax(QKᵀ)V, float32, JAX autodiff",
        family="xla",
        algorithm="materialised",
        forward=_forward,
        backward=None,
        memory=_memory,
        jax_differentiable=True,
        tiled=False,
    )
)
