"""``implementation="scan_v1"``: FlashAttention-1 as ``jax.lax`` loops over tiles.

Dao et al. (2022), "FlashAttention: Fast and Memory-Efficient Exact Attention with
IO-Awareness", Algorithm 1 (forward; masking as in Algorithm 2) and Algorithm 4
(backward); comments cite their line numbers. Side by side with `jaxtile.scan.v2`:

* Forward loop order: key/value tiles outer (line 5), query tiles inner (line 7), over
  the query tiles `MaskSpec.q_spans` allows. The running output ``O``, max ``m`` and sum
  ``l`` are full ``O(N)`` arrays carried through both loops; each inner step reads its
  rows and writes them back (lines 8, 12-13), which is the paper's HBM traffic. FA2
  keeps one query tile's statistics on chip for its whole inner loop instead.
* Normalisation at every step (line 12): ``O_i`` is always a normalised output, where
  FA2 rescales an unnormalised accumulator and divides once at the end.
* The residual statistics are ``m`` and ``l`` (FA2 keeps only ``lse = m + log l``), and
  the backward pass forms ``P_ij = diag(l_i)^-1 exp(S_ij - m_i)`` (line 13).
* Backward: the same loop order as FA2's (key/value outer, query inner, ``dQ_i`` read
  and written back), but ``D_i = rowsum(dO_i ∘ O_i)`` is recomputed in the inner loop
  (line 19) rather than once beforehand.

Scores are base 2 with the scale folded in (`jaxtile._softmax`), so ``m`` is the running
max of ``s · log2(e)`` and ``l`` the sum of ``2^(s2 - m)``. Every batch element and head
of a tile is processed at once (``[batch, kv_heads, group, rows, dim]`` tiles): the query
heads of a group share their key/value tile, and dK/dV are summed over the group inside
the einsums. Memory is O(N).
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
    """Algorithm 1. Returns ``out [b, q, h, dv]``, ``lse [b, h, q]`` and the statistics
    ``(m, l)``, each ``[b, h, q]`` float32 (base 2), for the backward pass."""
    spec, logits = config.mask, config.logits
    tiling = lt.Tiling.create(config, DEFAULT_BLOCK)
    bq, bk = tiling.block_q, tiling.block_k
    # Lines 3-4: Q, O, l, m are divided into row tiles by `lt.rows`; K, V likewise.
    x = lt.tile(inputs, tiling)
    batch, kv_heads, group, q_padded, _ = x.q.shape
    bounds = lt.tile_bounds(inputs, spec, tiling, transposed=True)
    rows = (batch, kv_heads, group, q_padded)

    def q_step(masked, u, k_j, v_j, t, carry):
        o, m, l = carry
        # Line 8: load Q_i, O_i, l_i, m_i.
        q_i = lt.rows(x.q, t, bq, 3)
        o_i, m_i, l_i = lt.rows(o, t, bq, 3), lt.rows(m, t, bq, 3), lt.rows(l, t, bq, 3)
        # Line 9: S_ij = Q_i K_jᵀ (as ``pre``; the scale is folded into the exponentials).
        qk = lt.scores(q_i, k_j)
        pre = logits.pre(qk, lt.bias_tile(x, tiling, t, u))
        vis = lt.visible(spec, x, tiling, t, u) if masked else None
        # Line 10: m~_ij = rowmax(S_ij), P~_ij = exp(S_ij - m~_ij), l~_ij = rowsum(P~_ij).
        p, m_ij, l_ij = sm.tile_softmax(pre, logits, vis)
        pv = sm.masked_tile_dot(lt.over_keys, p.astype(v_j.dtype), v_j, vis)
        # Lines 11-12: m_new, l_new; O_i <- diag(l_new)^-1 (diag(l_i) e^(m_i - m_new) O_i + e^(m~_ij - m_new) P~_ij V_j).
        o_i, m_i, l_i = sm.rescaled_update(o_i, m_i, l_i, pv, m_ij, l_ij)
        # Lines 12-13: write O_i, l_i, m_i back.
        o = lax.dynamic_update_slice_in_dim(o, o_i, t * bq, 3)
        m = lax.dynamic_update_slice_in_dim(m, m_i, t * bq, 3)
        l = lax.dynamic_update_slice_in_dim(l, l_i, t * bq, 3)
        return o, m, l

    def kv_step(carry, u):
        # Lines 5-6: for each key/value tile, load K_j, V_j.
        k_j = lt.rows(x.k, u, bk, 2)
        v_j = lt.rows(x.v, u, bk, 2)
        # Line 7: the query tiles that can see this key tile.
        for span in spec.q_spans(u, bq, bk, lt.bounds_of(bounds, u)):
            carry = lax.fori_loop(span.start, span.stop, functools.partial(q_step, span.masked, u, k_j, v_j), carry)
        return carry, None

    # Line 2: O = 0, l = 0, m = -inf.
    init = (
        jnp.zeros_like(x.q, jnp.float32, shape=(*rows, x.v.shape[-1])),
        jnp.full_like(x.q, -jnp.inf, jnp.float32, shape=rows),
        jnp.zeros_like(x.q, jnp.float32, shape=rows),
    )
    (o, m, l), _ = lax.scan(kv_step, init, jnp.arange(tiling.num_kv_tiles))
    out = lt.q_heads_last(o, spec.q_len).astype(inputs.q.dtype)
    m, l = (s.reshape(batch, kv_heads * group, q_padded)[..., : spec.q_len] for s in (m, l))
    return out, sm.log_sum_exp(m, l), (m, l)


def _backward(inputs: Inputs, out, stats, dout, dlse, config: Config):
    """Algorithm 4: key/value tiles outer, query tiles inner, dQ read and written back
    (`_backward.backward`). ``stats`` is the forward's ``(m, l)``."""
    tiling = lt.Tiling.create(config, DEFAULT_BLOCK)
    bq = tiling.block_q
    # Lines 3-4: Q, O, dO, l, m are divided into row tiles; K, V into column tiles.
    x = lt.tile(inputs, tiling)
    kv_heads = x.k.shape[1]
    m, inv_l = sm.stats_base2(*stats)
    m = lt.q_seq_last(m, kv_heads, tiling.q_padded, jnp.inf)
    inv_l = lt.q_seq_last(inv_l, kv_heads, tiling.q_padded)
    dlse = lt.q_seq_last(dlse, kv_heads, tiling.q_padded)
    o = lt.q_heads_first(out, kv_heads, tiling.q_padded)

    def p_and_delta(t, pre, vis, do_i):
        # Line 13: P_ij = diag(l_i)^-1 exp(S_ij - m_i).
        m_i, inv_l_i = lt.rows(m, t, bq, 3), lt.rows(inv_l, t, bq, 3)
        p = sm.probabilities(pre, m_i[..., None], config.logits, vis, inv_l=inv_l_i[..., None])
        # Line 19: D_i = rowsum(dO_i ∘ O_i); the lse cotangent enters the same place.
        o_i = lt.rows(o, t, bq, 3)
        d_i = jnp.sum(do_i.astype(jnp.float32) * o_i.astype(jnp.float32), axis=-1) - lt.rows(dlse, t, bq, 3)
        return p, d_i

    return backward(inputs, config, tiling, x, lt.q_heads_first(dout, kv_heads, tiling.q_padded), p_and_delta)


def _memory(shape: Shape, block_q: int | None, block_k: int | None, backward: bool) -> tuple[int, int]:
    tiling = lt.Tiling.of(shape.q_len, shape.kv_len, block_q, block_k, DEFAULT_BLOCK)
    return lt.memory(shape, tiling, fa1=True, backward=backward)


IMPLEMENTATION = registry.register(
    registry.Implementation(
        name="scan_v1",
        summary="FlashAttention-1 loop order (key tiles outer), `jax.lax` loops",
        family="lax",
        algorithm="FlashAttention-1",
        forward=_forward,
        backward=_backward,
        memory=_memory,
        jax_differentiable=True,
        speed=20,
    )
)
