"""Flax NNX layers on jaxtile: ``pip install jaxtile[flax]``.

* `Attention`: multi-head (GQA/MQA) self-attention in FlashTile's shape, with a fused
  ``qkv_proj`` or separate ``q_proj``/``k_proj``/``v_proj`` and an ``out_proj``, whose
  weights load from the matching PyTorch state dict (`Attention.load_torch_state_dict`),
  and a KV cache for generation (`Attention.init_cache`, ``layer(x, decode=True)``).
* `attention_fn`: a drop-in for ``flax.nnx.dot_product_attention``, so that
  ``nnx.MultiHeadAttention(..., attention_fn=jaxtile.nn.attention_fn)`` runs on jaxtile.
* `rotary`: the rotary position embedding `Attention` applies with ``rope_theta``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes

from jaxtile.api import flash_attention
from jaxtile.jax_nn import dot_product_attention


def attention_fn(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: nnx.Module | None = None,
    promote_dtype=dtypes.promote_dtype,
    is_causal: bool = False,
    *,
    local_window_size: int | tuple[int, int] | None = None,
    segment_ids: jax.Array | tuple[jax.Array, jax.Array] | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    implementation: str | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> jax.Array:
    """``flax.nnx.dot_product_attention`` computed by `jaxtile.dot_product_attention`.

    Same arguments and layout: ``query [batch..., q_len, num_heads, head_dim]``, key and
    value ``[batch..., kv_len, num_heads, head_dim]``, ``mask`` broadcastable to
    ``[batch..., num_heads, q_len, kv_len]`` (nonzero = attend), ``is_causal`` aligned
    top-left like ``jax.nn.dot_product_attention``. Structured masks skip the tiles they
    hide, where a dense ``mask`` is read tile by tile (except the causal and padding
    masks Flax builds, which the GPU kernels recognise at run time and run as
    structured): pass them, and jaxtile's other options, through
    ``functools.partial(attention_fn, local_window_size=...,
    segment_ids=..., logits_soft_cap=..., sinks=..., implementation=..., block_q=...,
    block_k=...)`` (as `jaxtile.dot_product_attention` takes them).
    ``bias`` (added to the scaled scores, as Flax adds it) is read tile by tile, with
    its gradient (`jaxtile.flash_attention`'s ``bias``).
    ``precision`` is ignored: jaxtile always accumulates in float32. A query that sees
    no key gets output 0 (Flax's default gives it the mean of all values).

    Raises:
      NotImplementedError: for active dropout, or ``module`` (Flax's ``sow_weights``):
        jaxtile never forms the attention weights.
    """
    if dropout_rate > 0.0 and not deterministic:
        raise NotImplementedError(f"attention_fn: attention dropout is not supported ({dropout_rate=})")
    if module is not None:
        raise NotImplementedError("attention_fn: sow_weights is not supported; the attention weights are never formed")
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    return dot_product_attention(
        query,
        key,
        value,
        bias=bias,
        mask=None if mask is None else mask.astype(jnp.bool_),
        is_causal=is_causal,
        local_window_size=local_window_size,
        segment_ids=segment_ids,
        logits_soft_cap=logits_soft_cap,
        sinks=sinks,
        implementation=implementation,
        block_q=block_q,
        block_k=block_k,
    )


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (RoFormer, Su et al. 2021) of ``x [batch..., len, heads,
    head_dim]`` at integer ``positions [batch..., len]``: the pairs ``(x[..., i],
    x[..., i + head_dim // 2])`` rotated by ``positions * theta ** (-2i / head_dim)``
    (the half-split layout of GPT-NeoX and Llama), in float32, returned in ``x``'s dtype."""
    half = x.shape[-1] // 2
    if 2 * half != x.shape[-1]:
        raise ValueError(f"rotary embedding needs an even head_dim; got {x.shape[-1]}")
    frequencies = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[..., None, None] * frequencies  # [..., len, 1, half]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    first, second = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Multi-head self-attention in FlashTile's shape, computed by `jaxtile.flash_attention`.

    ``x [batch..., len, embed_dim]`` is projected to queries (``num_heads`` heads) and
    keys and values (``num_kv_heads`` heads, GQA/MQA when fewer), of ``head_dim`` each;
    the attention output ``[batch..., len, num_heads * head_dim]`` goes through
    ``out_proj`` back to ``embed_dim``. Projections are either one fused ``qkv_proj``
    with outputs ordered ``[q heads | k heads | v heads]`` (FlashTile's ``BaseAttention``
    layout when ``num_kv_heads == num_heads``), or ``q_proj``, ``k_proj``, ``v_proj``
    (FlashTile's ``GroupedQueryAttention``).

    For generation, `init_cache` allocates a KV cache and ``layer(x, decode=True)`` feeds
    the next tokens of each sequence through it: a causal layer (or one whose window has
    right side 0) then gives what the whole sequence would give at those positions.

    Args:
      embed_dim: model width.
      num_heads: query heads.
      num_kv_heads: key/value heads, dividing ``num_heads``; default ``num_heads``.
      head_dim: default ``embed_dim // num_heads``.
      causal, window, logits_soft_cap, implementation, block_q, block_k: passed to
        `jaxtile.flash_attention` (``window`` in its ``(left, right)`` convention).
      sinks: learn one attention-sink logit per query head (``self.sinks``, initialised
        to 0), as gpt-oss does.
      rope_theta: rotate queries and keys by their positions (`rotary`, base
        ``rope_theta``, e.g. 10000) before attention; None for no rotary embedding.
      bias: whether the projections have biases.
      fused_qkv: one ``qkv_proj`` instead of three.
      dtype, param_dtype, precision: as for ``nnx.Linear``.
      rngs: initialisation randomness.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        causal: bool = False,
        window: int | tuple[int | None, int | None] | None = None,
        logits_soft_cap: float | None = None,
        sinks: bool = False,
        rope_theta: float | None = None,
        bias: bool = True,
        fused_qkv: bool = True,
        implementation: str | None = None,
        block_q: int | None = None,
        block_k: int | None = None,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        rngs: nnx.Rngs,
    ):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(f"{embed_dim=} is not a multiple of {num_heads=}; pass head_dim")
            head_dim = embed_dim // num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads=} is not a multiple of {num_kv_heads=}")
        self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim = embed_dim, num_heads, num_kv_heads, head_dim
        self.fused_qkv, self.rope_theta = fused_qkv, rope_theta
        self.cache_dtype = param_dtype if dtype is None else dtype
        self.options = dict(
            causal=causal,
            window=window,
            logits_soft_cap=logits_soft_cap,
            implementation=implementation,
            block_q=block_q,
            block_k=block_k,
        )
        linear = functools.partial(
            nnx.Linear, use_bias=bias, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs
        )
        q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
        if fused_qkv:
            self.qkv_proj = linear(embed_dim, q_width + 2 * kv_width)
        else:
            self.q_proj = linear(embed_dim, q_width)
            self.k_proj = linear(embed_dim, kv_width)
            self.v_proj = linear(embed_dim, kv_width)
        self.out_proj = linear(q_width, embed_dim)
        self.sinks = nnx.Param(jnp.zeros((num_heads,), param_dtype)) if sinks else None
        self.cached_key: nnx.Cache | None = nnx.data(None)
        self.cached_value: nnx.Cache | None = nnx.data(None)
        self.cache_lengths: nnx.Cache | None = nnx.data(None)

    def init_cache(self, batch: int, max_len: int, *, dtype: Any = None) -> None:
        """Allocates an empty KV cache for ``batch`` sequences of up to ``max_len`` tokens.

        Creates ``nnx.Cache`` variables ``cached_key`` and ``cached_value`` ``[batch,
        max_len, num_kv_heads, head_dim]`` (keys stored after the rotary embedding) and
        ``cache_lengths [batch]`` int32, the positions of each sequence filled so far (0
        here), replacing any previous cache. ``dtype``: of the cached keys and values;
        default the layer's ``dtype``, else its ``param_dtype``. Queries are cast to it
        for the attention.
        """
        if batch < 1 or max_len < 1:
            raise ValueError(f"init_cache needs batch >= 1 and max_len >= 1; got {batch=}, {max_len=}")
        shape = (batch, max_len, self.num_kv_heads, self.head_dim)
        dtype = self.cache_dtype if dtype is None else dtype
        self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
        self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
        self.cache_lengths = nnx.Cache(jnp.zeros((batch,), jnp.int32))

    def __call__(
        self,
        x: jax.Array,
        *,
        decode: bool = False,
        context: jax.Array | None = None,
        positions: jax.Array | None = None,
        kv_positions: jax.Array | None = None,
        segment_ids: jax.Array | tuple[jax.Array, jax.Array] | None = None,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        """``x [batch..., len, embed_dim]`` -> ``[batch..., len, embed_dim]``.

        Args:
          decode: ``x [batch, q_len, embed_dim]`` holds the next ``q_len`` tokens of each
            sequence in the cache (`init_cache`): one for a decode step, more for a
            prefill chunk. Their keys and values are written at positions
            ``cache_lengths[b] + arange(q_len)`` (also the default rotary ``positions``),
            the queries attend to each sequence's first ``cache_lengths[b] + q_len``
            cached keys (causal masks and windows aligned to their positions), and
            ``cache_lengths`` advances by ``q_len``. Concrete lengths that would pass
            ``max_len`` are an error; traced ones (under ``jit``) cannot be checked: the
            write is clipped to the cache's end (``jax.lax.dynamic_update_slice``) and
            the result is wrong. Not with ``context``, ``kv_positions``,
            ``segment_ids`` or ``mask``.
          context: ``[batch..., kv_len, embed_dim]``: keys and values come from it
            (cross-attention; needs separate projections, ``fused_qkv=False``) instead
            of from ``x``. Causal masks and windows align the last query with the last
            key (`jaxtile.flash_attention`'s bottom-right positions).
          positions, kv_positions: ``[batch..., len]`` and ``[batch..., kv_len]`` ints
            for the rotary embedding (default ``0, 1, ...``; ``kv_positions`` defaults to
            ``positions`` without ``context``). Only with ``rope_theta``.
          segment_ids, mask: passed to `jaxtile.flash_attention` (``mask`` bool, True =
            attend).
        """
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if decode:
            refused = dict(context=context, kv_positions=kv_positions, segment_ids=segment_ids, mask=mask)
            lengths = self._cache_lengths(x, [name for name, value in refused.items() if value is not None])
        if context is not None and self.fused_qkv:
            raise ValueError(
                "cross-attention (context=...) needs separate projections: build the layer with fused_qkv=False"
            )
        if self.rope_theta is None and (positions is not None or kv_positions is not None):
            raise ValueError("positions are for the rotary embedding: build the layer with rope_theta")
        if self.fused_qkv:
            qkv = self.qkv_proj(x)
            q, k, v = qkv[..., :q_width], qkv[..., q_width : q_width + kv_width], qkv[..., q_width + kv_width :]
        else:
            source = x if context is None else context
            q, k, v = self.q_proj(x), self.k_proj(source), self.v_proj(source)
        q = q.reshape(*q.shape[:-1], self.num_heads, self.head_dim)
        k = k.reshape(*k.shape[:-1], self.num_kv_heads, self.head_dim)
        v = v.reshape(*v.shape[:-1], self.num_kv_heads, self.head_dim)
        if self.rope_theta is not None:
            if positions is None:
                start = lengths[:, None] if decode else 0
                positions = jnp.broadcast_to(start + jnp.arange(q.shape[-3]), q.shape[:-2])
            if kv_positions is None:
                kv_positions = positions if context is None else jnp.broadcast_to(jnp.arange(k.shape[-3]), k.shape[:-2])
            q, k = rotary(q, positions, self.rope_theta), rotary(k, kv_positions, self.rope_theta)
        kv_lengths = None
        if decode:
            k, v, kv_lengths = self._write_cache(k, v, lengths)
            q = q.astype(k.dtype)
        sinks = None if self.sinks is None else self.sinks[...]
        out = flash_attention(
            q, k, v, segment_ids=segment_ids, mask=mask, kv_lengths=kv_lengths, sinks=sinks, **self.options
        )
        return self.out_proj(out.reshape(*out.shape[:-2], q_width))

    def _cache_lengths(self, x: jax.Array, refused: list[str]) -> jax.Array:
        """The ``cache_lengths [batch]`` a decode call of ``x [batch, q_len, embed_dim]``
        starts from, after checking the call against the cache."""
        if refused:
            raise ValueError(f"decode=True is self-attention through the KV cache; it does not take {refused}")
        if self.cached_key is None:
            raise ValueError("decode=True needs a cache: call layer.init_cache(batch, max_len) first")
        batch, max_len = self.cached_key.shape[:2]
        if x.ndim != 3 or x.shape[0] != batch:
            raise ValueError(f"decode=True needs x of shape [batch={batch}, q_len, embed_dim]; got {x.shape}")
        q_len, lengths = x.shape[1], self.cache_lengths[...]
        if q_len > max_len:
            raise ValueError(f"decode of {q_len=} tokens cannot fit in the cache ({max_len=})")
        if not isinstance(lengths, jax.core.Tracer) and int(lengths.max()) + q_len > max_len:
            raise ValueError(
                f"decode of {q_len=} tokens would overflow the cache ({max_len=}): "
                f"cache_lengths={np.asarray(lengths).tolist()}"
            )
        return lengths

    def _write_cache(self, k: jax.Array, v: jax.Array, lengths: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Writes ``k, v [batch, q_len, num_kv_heads, head_dim]`` into the cache at each
        sequence's ``lengths`` and advances them; returns the cached keys, values and
        new lengths."""
        write = jax.vmap(lambda cache, new, start: jax.lax.dynamic_update_slice_in_dim(cache, new, start, axis=0))
        for cache, new in ((self.cached_key, k), (self.cached_value, v)):
            cache[...] = write(cache[...], new.astype(cache[...].dtype), lengths)
        self.cache_lengths[...] = lengths + k.shape[1]
        return self.cached_key[...], self.cached_value[...], self.cache_lengths[...]

    def load_torch_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Copies the weights of a PyTorch module of the same shape into this layer.

        ``state_dict`` holds ``{name}.weight`` ``[out_features, in_features]`` (and
        ``{name}.bias``) for each projection of this layer (``qkv_proj`` or
        ``q_proj``/``k_proj``/``v_proj``, and ``out_proj``), and ``sinks`` ``[num_heads]``
        for a layer with sinks (gpt-oss's name), as torch tensors or arrays;
        torch's ``nn.Linear`` stores the transpose of ``nnx.Linear``'s kernel. Other
        keys (e.g. FlashTile's buffers) are ignored; missing or misshapen ones raise.
        """
        names = ("qkv_proj",) if self.fused_qkv else ("q_proj", "k_proj", "v_proj")
        params = [] if self.sinks is None else [("sinks", self.sinks, False)]
        for name in (*names, "out_proj"):
            layer = getattr(self, name)
            params.append((f"{name}.weight", layer.kernel, True))
            if layer.bias is not None:
                params.append((f"{name}.bias", layer.bias, False))
        for key, param, transpose in params:
            if key not in state_dict:
                raise KeyError(f"state_dict has no {key!r}; it has {sorted(state_dict)}")
            array = _numpy(state_dict[key])
            needed = param.shape[::-1] if transpose else param.shape
            if array.shape != needed:
                raise ValueError(f"{key} has shape {array.shape}; this layer needs {needed}")
            param[...] = jnp.asarray(array.T if transpose else array, param.dtype)


def _numpy(x) -> np.ndarray:
    """A torch tensor (on any device) or an array, as NumPy."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)
