"""The backward loop the two ``jax.lax`` implementations share.

FlashAttention-1's Algorithm 4 and FlashAttention-2's Algorithm 2 visit the tiles in the
same order (key/value tiles outer, the query tiles that see each inner, ``dQ_i`` read and
written back) and form the same products. They differ only in how a step recovers
``P_ij`` and ``D_i`` from what the forward saved, which each module passes in
(`jaxtile.scan.v1`, `jaxtile.scan.v2`). Comments cite Algorithm 2's lines, Algorithm 4's
in parentheses.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp
from jax import lax

from jaxtile import _softmax as sm
from jaxtile._core import Config, Inputs
from jaxtile.scan import _tiles as lt


def backward(inputs: Inputs, config: Config, tiling: lt.Tiling, x: lt.Tiled, do, p_and_delta: Callable):
    """``(dq, dk, dv, dbias)`` (`_core.Backward`) in the dtypes of ``q, k, v`` and the
    bias's float32 gradient; dK and dV summed over the query heads of each group inside
    the einsums.

    ``x``: the tiled inputs (`_tiles.tile`); ``do``: ``dO`` as ``[batch, kv_heads,
    group, q_padded, head_dim_v]``; ``p_and_delta(t, pre, vis, do_i)``: query tile
    ``t``'s ``P_ij`` and ``D_i`` from its scores ``pre`` (masked by ``vis`` where not
    None).
    """
    spec, logits = config.mask, config.logits
    bq, bk = tiling.block_q, tiling.block_k
    bounds = lt.tile_bounds(inputs, spec, tiling, transposed=True)

    def q_step(masked, u, k_j, v_j, t, carry):
        dq, dbias, dk_j, dv_j = carry
        # Line 9 (10): load Q_i, dO_i.
        q_i = lt.rows(x.q, t, bq, 3)
        do_i = lt.rows(do, t, bq, 3)
        # Lines 10-11 (11-13): recompute S_ij, its mask and P_ij; D_i.
        pre = logits.pre(lt.scores(q_i, k_j), lt.bias_tile(x, tiling, t, u))
        vis = lt.visible(spec, x, tiling, t, u) if masked else None
        p, d_i = p_and_delta(t, pre, vis, do_i)
        # Line 12 (16): dV_j += P_ijᵀ dO_i (summed over the group's query heads).
        dv_j += lt.over_queries(p.astype(do.dtype), do_i)
        # Lines 13-14 (17, 20): dP_ij = dO_i V_jᵀ, dS_ij = P_ij ∘ (dP_ij - D_i), with τ
        # (and a soft cap's derivative).
        dp = lt.scores(do_i, v_j)
        dlogit = sm.score_grad(p, dp, d_i[..., None], pre, logits, vis, of_logit=True)
        ds = dlogit * logits.scale
        # Line 15 (21): dQ_i += dS_ij K_j, read and written back.
        dq_i = lt.rows(dq, t, bq, 3) + sm.masked_tile_dot(lt.over_keys, ds, k_j, vis)
        dq = lax.dynamic_update_slice_in_dim(dq, dq_i, t * bq, 3)
        # Line 16 (22): dK_j += dS_ijᵀ Q_i.
        dk_j += sm.masked_tile_dot(lt.over_queries, ds, q_i, vis)
        if dbias is not None:  # the bias's gradient, dS before the scale
            dbias = lt.set_pair_tile(dbias, dlogit, tiling, t, u)
        return dq, dbias, dk_j, dv_j

    def kv_step(grads, u):
        # Lines 6-7 (6-8): load K_j, V_j; initialise dK_j, dV_j.
        k_j = lt.rows(x.k, u, bk, 2)
        v_j = lt.rows(x.v, u, bk, 2)
        carry = (*grads, jnp.zeros_like(k_j, jnp.float32), jnp.zeros_like(v_j, jnp.float32))
        # Line 8 (9): the query tiles that can see this key tile.
        for span in spec.q_spans(u, bq, bk, lt.bounds_of(bounds, u)):
            carry = lax.fori_loop(span.start, span.stop, functools.partial(q_step, span.masked, u, k_j, v_j), carry)
        # Line 18 (24): write dK_j, dV_j (stacked by the scan).
        dq, dbias, dk_j, dv_j = carry
        return (dq, dbias), (dk_j, dv_j)

    # Line 5 (5): dQ = 0 (and dBias = 0, set tile by tile).
    scores = (*x.q.shape[:4], tiling.kv_padded)
    dbias = None if x.bias is None else jnp.zeros_like(x.q, jnp.float32, shape=scores)
    init = (jnp.zeros_like(x.q, jnp.float32), dbias)
    (dq, dbias), (dk, dv) = lax.scan(kv_step, init, jnp.arange(tiling.num_kv_tiles))
    dq = lt.q_heads_last(dq, spec.q_len).astype(inputs.q.dtype)
    dk, dv = lt.kv_heads_last(dk, spec.kv_len, inputs.k.dtype), lt.kv_heads_last(dv, spec.kv_len, inputs.v.dtype)
    return dq, dk, dv, lt.scores_grad(dbias, scores, spec.q_len, spec.kv_len)
