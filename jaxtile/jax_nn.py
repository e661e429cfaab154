"""``jaxtile.dot_product_attention``: ``jax.nn.dot_product_attention``'s signature and
semantics, computed by jaxtile's implementations.

What differs from `jaxtile.flash_attention` is only how arguments are spelled and where
positions start: query row ``i`` has position ``i`` (top-left alignment, jax.nn's and
Flax's), not ``i + kv_len - q_len``; `MaskSpec.top_left` carries that to every
implementation, element-wise and tile-wise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtile import api


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
    segment_ids: jax.Array | tuple[jax.Array, jax.Array] | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``jax.nn.dot_product_attention`` on jaxtile.

    Args (jax.nn's, with its meaning):
      query: ``[batch, q_len, num_heads, head_dim]`` or unbatched ``[q_len, num_heads,
        head_dim]``.
      key, value: ``[batch, kv_len, num_kv_heads, head_dim]`` (or unbatched);
        ``num_heads`` a multiple of ``num_kv_heads`` (GQA/MQA).
      bias: float, broadcastable to ``[batch, num_heads, q_len, kv_len]``, added to the
        scaled scores; read tile by tile and differentiable (`jaxtile.flash_attention`'s
        ``bias``).
      mask: bool, True = attend, broadcastable to ``[batch, num_heads, q_len, kv_len]``
        (`jaxtile.flash_attention`'s ``mask``: causal masks run as ``is_causal``).
      scale: default ``1 / sqrt(head_dim)``.
      is_causal: key ``j`` visible to query ``i`` only if ``j <= i`` (top-left).
      query_seq_lengths, key_value_seq_lengths: ``[batch]`` ints: rows and keys past
        them are padding; padding rows get output 0. Positions stay top-left.
      local_window_size: ``(left, right)`` (an int ``w``: ``(w, w)``): key ``j`` visible
        to query ``i`` only if ``i - left <= j <= i + right``.
      implementation: a jaxtile implementation (`jaxtile.registry.names()`) or None for
        the fastest that supports the call; jax.nn's ``"xla"`` and ``"cudnn"`` are not
        jaxtile's.
      return_residual: also return the log-sum-exp, ``[batch, q_len, num_heads]`` (or
        ``[q_len, num_heads]``) in the query's dtype, as jax.nn does.

    jaxtile's own keywords, as in `jaxtile.flash_attention`: ``segment_ids``,
    ``logits_soft_cap``, ``sinks``, ``block_q``, ``block_k``.

    Returns:
      ``out`` shaped and typed like ``query`` (with ``return_residual``, ``(out, lse)``).
      One deliberate difference from jax.nn's ``"xla"`` implementation: a query that
      sees no key gets output 0 and lse ``-inf`` (as with cuDNN), where jax.nn's fill
      of large negative logits gives it the mean of all values.
    """
    unbatched = jnp.ndim(query) == 3
    if unbatched:  # a batch of one; masks and biases of rank <= 4 broadcast to it as they are
        query, key, value, segment_ids = jax.tree.map(lambda x: x[None], (query, key, value, segment_ids))
    out = api.attend(
        query,
        key,
        value,
        sinks=sinks,
        return_lse=return_residual,
        top_left=True,
        causal=is_causal,
        window=local_window_size,
        segment_ids=segment_ids,
        mask=mask,
        bias=bias,
        q_lengths=query_seq_lengths,
        kv_lengths=key_value_seq_lengths,
        logits_soft_cap=logits_soft_cap,
        scale=scale,
        implementation=implementation,
        block_q=block_q,
        block_k=block_k,
        tuning=None,
    )
    if not return_residual:
        return out[0] if unbatched else out
    out, lse = out
    lse = jnp.swapaxes(lse, -1, -2).astype(out.dtype)
    return (out[0], lse[0]) if unbatched else (out, lse)
