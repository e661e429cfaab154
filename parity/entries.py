"""jaxtile's entry points besides `jaxtile.flash_attention`, under test in the suite.

Each has ``flash_attention``'s signature (what the suite calls an implementation) and
raises ``NotImplementedError`` (a "not implemented" row) for a call its own semantics
cannot express.

``dot_product_attention`` runs `jaxtile.dot_product_attention`, jax.nn's semantics, with
``implementation=None`` (the fastest implementation that takes the call). jax.nn puts
query ``i`` at position ``i``, flash_attention at ``i + d`` (``d = kv_len - q_len``), so a
bottom-right causal mask or window becomes the top-left ``local_window_size`` of
`jax_nn_masking`, which needs both sides non-negative; with per-sequence lengths the
offset differs by sequence, so those calls take neither a causal mask nor a window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxtile
from jaxtile.mask import MaskSpec


def jax_nn_masking(
    causal: bool, window: int | tuple[int | None, int | None] | None, q_len: int, kv_len: int
) -> tuple[bool, tuple[int, int] | None] | None:
    """jax.nn's ``(is_causal, local_window_size)`` for flash_attention's bottom-right
    ``causal`` and ``window``, or None where a side of the window would be negative."""
    spec = MaskSpec.create(q_len, kv_len, causal=causal, window=window)
    is_causal = causal and spec.offset == 0
    left, right = spec.left, None if is_causal else spec.right
    if left is None and right is None:
        return is_causal, None
    unbounded = q_len + kv_len
    top_left = (unbounded if left is None else left - spec.offset, unbounded if right is None else right + spec.offset)
    return (is_causal, top_left) if min(top_left) >= 0 else None


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    window: int | tuple[int | None, int | None] | None = None,
    segment_ids: jax.Array | tuple[jax.Array, jax.Array] | None = None,
    mask: jax.Array | None = None,
    q_lengths: jax.Array | None = None,
    kv_lengths: jax.Array | None = None,
    bias: jax.Array | None = None,
    sinks: jax.Array | None = None,
    logits_soft_cap: float | None = None,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`jaxtile.dot_product_attention` called with flash_attention's arguments, batch dims
    ``[batch...]`` flattened to jax.nn's one; lse ``[batch..., num_heads, q_len]`` in float32."""
    *batch, q_len, _, _ = q.shape
    kv_len = k.shape[-3]
    has_lengths = q_lengths is not None or kv_lengths is not None
    masking = jax_nn_masking(causal, window, q_len, kv_len)
    if masking is None or (has_lengths and (causal or window is not None)):
        raise NotImplementedError(f"jax.nn's top-left positions cannot express {causal=}, {window=} here")
    is_causal, local_window_size = masking

    def flat(x, rank):  # [batch..., *rest] -> [B, *rest] for ``rank`` trailing dims; lower ranks broadcast as they are
        return x if x is None or jnp.ndim(x) < len(batch) + rank else x.reshape(-1, *jnp.shape(x)[len(batch) :])

    if isinstance(segment_ids, tuple):
        segment_ids = tuple(flat(ids, 1) for ids in segment_ids)
    out, lse = jaxtile.dot_product_attention(
        flat(q, 3),
        flat(k, 3),
        flat(v, 3),
        flat(bias, 3),
        flat(mask, 3),
        scale=scale,
        is_causal=is_causal,
        query_seq_lengths=flat(q_lengths, 0),
        key_value_seq_lengths=flat(kv_lengths, 0),
        local_window_size=local_window_size,
        return_residual=True,
        segment_ids=segment_ids if isinstance(segment_ids, tuple) else flat(segment_ids, 1),
        logits_soft_cap=logits_soft_cap,
        sinks=sinks,
        block_q=block_q,
        block_k=block_k,
    )
    out = out.reshape(*batch, *out.shape[1:])
    lse = jnp.swapaxes(lse, -1, -2).astype(jnp.float32)  # [B, num_heads, q_len]
    lse = lse.reshape(*batch, *lse.shape[1:])
    return (out, lse) if return_lse else out


ENTRIES = (dot_product_attention,)
