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
    """Algorithm 2: key/value tiles outer, query tiles inner, dQ accumulated in place.

    Returns ``(dq, dk, dv)`` in the dtypes of ``q, k, v`` and the bias's float32
    gradient (`_core.Backward`); dK and dV are summed over the query heads of each
    group inside the einsums.
    """
    spec, logits = config.mask, config.logits
    tiling = lt.Tiling.create(config, DEFAULT_BLOCK)
    bq, bk = tiling.block_q, tiling.block_k
    x = lt.tile(inputs, tiling)
    kv_heads = x.k.shape[1]
    bounds = lt.tile_bounds(inputs, spec, tiling, transposed=True)
    # Line 4: D = rowsum(dO ∘ O); the lse cotangent enters the same place.
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    delta = lt.q_seq_last(jnp.swapaxes(delta, 1, 2) - dlse, kv_heads, tiling.q_padded)
    lse2 = lt.q_seq_last(sm.lse_base2(lse), kv_heads, tiling.q_padded, jnp.inf)
    do = lt.q_heads_first(dout, kv_heads, tiling.q_padded)

    def q_step(masked, u, k_j, v_j, t, carry):
        dq, dbias, dk_j, dv_j = carry
        # Line 9: load Q_i, dO_i, dQ_i, L_i, D_i.
        q_i = lt.rows(x.q, t, bq, 3)
        do_i = lt.rows(do, t, bq, 3)
        # Lines 10-11: recompute S_ij and P_ij = exp(S_ij - L_i).
        qk = lt.scores(q_i, k_j)
        pre = logits.pre(qk, lt.bias_tile(x, tiling, t, u))
        vis = lt.visible(spec, x, tiling, t, u) if masked else None
        p = sm.probabilities(pre, lt.rows(lse2, t, bq, 3)[..., None], logits, vis)
        # Line 12: dV_j += P_ijᵀ dO_i (summed over the group's query heads).
        dv_j += lt.over_queries(p.astype(do.dtype), do_i)
        # Lines 13-14: dP_ij = dO_i V_jᵀ, dS_ij = P_ij ∘ (dP_ij - D_i).
        dp = lt.scores(do_i, v_j)
        dlogit = sm.score_grad(p, dp, lt.rows(delta, t, bq, 3)[..., None], pre, logits, vis, of_logit=True)
        ds = dlogit * logits.scale
        # Line 15: dQ_i += dS_ij K_j, read and written back in place.
        dq_i = lt.rows(dq, t, bq, 3) + sm.masked_tile_dot(lt.over_keys, ds, k_j, vis)
        dq = lax.dynamic_update_slice_in_dim(dq, dq_i, t * bq, 3)
        # Line 16: dK_j += dS_ijᵀ Q_i.
        dk_j += sm.masked_tile_dot(lt.over_queries, ds, q_i, vis)
        if dbias is not None:  # the bias's gradient, dS before the scale
            dbias = lt.set_pair_tile(dbias, dlogit, tiling, t, u)
        return dq, dbias, dk_j, dv_j

    def kv_step(grads, u):
        # Lines 6-7: load K_j, V_j; initialise dK_j, dV_j.
        k_j = lt.rows(x.k, u, bk, 2)
        v_j = lt.rows(x.v, u, bk, 2)
        carry = (*grads, jnp.zeros_like(k_j, jnp.float32), jnp.zeros_like(v_j, jnp.float32))
        # Line 8: the query tiles that can see this key tile.
        for span in spec.q_spans(u, bq, bk, lt.bounds_of(bounds, u)):
            carry = lax.fori_loop(span.start, span.stop, functools.partial(q_step, span.masked, u, k_j, v_j), carry)
        # Line 18: write dK_j, dV_j (stacked by the scan).
        dq, dbias, dk_j, dv_j = carry
        return (dq, dbias), (dk_j, dv_j)

    scores = (*x.q.shape[:4], tiling.kv_padded)
    dbias = None if x.bias is None else jnp.zeros_like(x.q, jnp.float32, shape=scores)
    init = (jnp.zeros_like(x.q, jnp.float32), dbias)
    (dq, dbias), (dk, dv) = lax.scan(kv_step, init, jnp.arange(tiling.num_kv_tiles))
    dq = lt.q_heads_last(dq, spec.q_len).astype(inputs.q.dtype)
    dk, dv = lt.kv_heads_last(dk, spec.kv_len, inputs.k.dtype), lt.kv_heads_last(dv, spec.kv_len, inputs.v.dtype)
    return dq, dk, dv, lt.scores_grad(dbias, scores, spec.q_len, spec.kv_len)


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
        default_block=DEFAULT_BLOCK,
        lse_backward=True,
        speed=30,
    )
)
