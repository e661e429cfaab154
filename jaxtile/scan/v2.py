"""``implementation="scan_v2"``: FlashAttention-2 as ``jax.lax`` loops over tiles.

Dao (2023), "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning", Algorithms 1 (forward) and 2 (backward). Query tiles form the outer loop
and key/value tiles the inner one, over only the tiles the mask description allows.
Every batch element and head of a tile is processed at once (``[batch, kv_heads, group,
rows, dim]`` tiles), and grouped-query heads share their key/value tile without ever
repeating it. Memory is O(N): the largest temporaries are one ``[block_q, block_k]``
score tile per head and the O(N) outputs.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from jaxtile import _softmax as sm
from jaxtile import registry
from jaxtile._core import Config, Inputs, Shape
from jaxtile.scan import _tiles as lt
from jaxtile.scan._backward import backward

DEFAULT_BLOCK = 128


def _forward(inputs: Inputs, config: Config):
    """Algorithm 1. Returns ``out [b, q, h, dv]``, ``lse [b, h, q]`` and lse again as
    the statistic the backward pass needs."""
    spec, logits = config.mask, config.logits
    tiling = lt.Tiling.create(config, DEFAULT_BLOCK)
    x = lt.tile(inputs, tiling)
    batch, kv_heads, group, _, _ = x.q.shape
    head_dim_v = x.v.shape[-1]
    bounds = lt.tile_bounds(inputs, spec, tiling, transposed=False)

    def kv_step(masked, t, q_i, u, carry):
        # Lines 6-10: S_ij = Q_i K_jᵀ, online softmax, O_i = diag(α) O_i + P_ij V_j.
        acc, m_i, l_i = carry
        k_j = lt.rows(x.k, u, tiling.block_k, 2)
        v_j = lt.rows(x.v, u, tiling.block_k, 2)
        qk = lt.scores(q_i, k_j)
        pre = logits.pre(qk, lt.bias_tile(x, tiling, t, u))
        vis = lt.visible(spec, x, tiling, t, u) if masked else None
        p, alpha, m_i, l_i = sm.online_softmax(pre, m_i, l_i, logits, vis)
        pv = sm.masked_tile_dot(lt.over_keys, p.astype(v_j.dtype), v_j, vis)
        return acc * alpha[..., None] + pv, m_i, l_i

    def q_step(_, t):
        # Lines 3-5: for each query tile, load Q_i; initialise O_i, l_i, m_i.
        q_i = lt.rows(x.q, t, tiling.block_q, 3)
        rows = (batch, kv_heads, group, tiling.block_q)
        carry = (
            jnp.zeros_like(q_i, jnp.float32, shape=(*rows, head_dim_v)),
            jnp.full_like(q_i, -jnp.inf, jnp.float32, shape=rows),
            jnp.zeros_like(q_i, jnp.float32, shape=rows),
        )
        # Line 6: the key tiles this query tile can see.
        for span in spec.kv_spans(t, tiling.block_q, tiling.block_k, lt.bounds_of(bounds, t)):
            body = functools.partial(kv_step, span.masked, t, q_i)
            carry = lax.fori_loop(span.start, span.stop, body, carry)
        # Lines 12-13: normalise once, at the end; lse = m + log l.
        out, lse = sm.finalize(*carry)
        return None, (out.astype(inputs.q.dtype), lse)

    _, (out, lse) = lax.scan(q_step, None, jnp.arange(tiling.num_q_tiles))
    # [q_tiles, b, h, g, block_q, ...] -> [b, h, g, q_padded, ...]
    out = jnp.moveaxis(out, 0, 3).reshape(batch, kv_heads, group, tiling.q_padded, head_dim_v)
    lse = jnp.moveaxis(lse, 0, 3).reshape(batch, kv_heads * group, tiling.q_padded)[..., : spec.q_len]
    return lt.q_heads_last(out, spec.q_len), lse, lse


def _backward(inputs: Inputs, out, lse, dout, dlse, config: Config):
    """Algorithm 2: key/value tiles outer, query tiles inner, dQ accumulated in place
    (`_backward.backward`)."""
    tiling = lt.Tiling.create(config, DEFAULT_BLOCK)
    bq = tiling.block_q
    x = lt.tile(inputs, tiling)
    kv_heads = x.k.shape[1]
    # Line 4: D = rowsum(dO ∘ O); the lse cotangent enters the same place.
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    delta = lt.q_seq_last(jnp.swapaxes(delta, 1, 2) - dlse, kv_heads, tiling.q_padded)
    lse2 = lt.q_seq_last(sm.lse_base2(lse), kv_heads, tiling.q_padded, jnp.inf)

    def p_and_delta(t, pre, vis, do_i):
        # Line 11: P_ij = exp(S_ij - L_i); line 9: load D_i.
        p = sm.probabilities(pre, lt.rows(lse2, t, bq, 3)[..., None], config.logits, vis)
        return p, lt.rows(delta, t, bq, 3)

    return backward(inputs, config, tiling, x, lt.q_heads_first(dout, kv_heads, tiling.q_padded), p_and_delta)


def _memory(shape: Shape, block_q: int | None, block_k: int | None, backward: bool) -> tuple[int, int]:
    tiling = lt.Tiling.of(shape.q_len, shape.kv_len, block_q, block_k, DEFAULT_BLOCK)
    return lt.memory(shape, tiling, fa1=False, backward=backward)


IMPLEMENTATION = registry.register(
    registry.Implementation(
        name="scan_v2",
        summary="FlashAttention-2 loop order (query tiles outer), `jax.lax` loops",
        family="lax",
        algorithm="FlashAttention-2",
        forward=_forward,
        backward=_backward,
        memory=_memory,
        jax_differentiable=True,
        lse_backward=True,
        speed=30,
    )
)
