"""The public entry point, ``jaxtile.flash_attention``."""

from __future__ import annotations

import functools
import importlib

import jax

from jaxtile import _inputs, _sharding
from jaxtile._core import Attention
from jaxtile.tuning import Tuning

IMPLEMENTATIONS = ("reference", "scan_v1", "scan_v2", "pallas_v1", "pallas_v2")
_PALLAS = frozenset({"pallas_v1", "pallas_v2"})


def _platform(x) -> str:
    """Platform of the device holding ``x``; the default backend for traced values."""
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        return next(iter(x.devices())).platform
    return jax.default_backend()


def default_implementation(platform: str) -> str:
    """The fastest correct implementation for arrays on ``platform``."""
    return "pallas_v2" if platform == "gpu" else "scan_v2"


def get_implementation(name: str) -> Attention:
    """The ``attention(inputs, config) -> (out, lse)`` function of an implementation."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation={name!r}; choose one of {IMPLEMENTATIONS} or None")
    return importlib.import_module(f"jaxtile.{name}").attention


def prepare(query, key, value, *, implementation, return_lse, block_q, block_k, **options):
    """Validates a call (before any compute); returns the implementation's name, the
    canonical `Inputs` and `Config`, and the batch shape to restore. ``options`` are
    `_inputs.canonicalize`'s mask, logit and tuning arguments."""
    platform = _platform(query)
    name = default_implementation(platform) if implementation is None else implementation
    get_implementation(name)
    for block_name, block in (("block_q", block_q), ("block_k", block_k)):
        _inputs.check_block(block_name, block, power_of_two=name in _PALLAS)
    _inputs.check_static("return_lse", return_lse, "bool")
    inputs, config, batch = _inputs.canonicalize(
        query, key, value, block_q=block_q, block_k=block_k, platform=platform, **options
    )
    return name, inputs, config, batch


@functools.cache
def _compiled(name: str) -> Attention:
    """``name``'s attention, batch/head-sharding aware and jitted with its static config,
    so that calls outside ``jit`` compile once per shape and option set."""
    return jax.jit(_sharding.partitioned(get_implementation(name)), static_argnums=1)


def flash_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    causal: bool = False,
    window: int | tuple[int | None, int | None] | None = None,
    segment_ids: jax.Array | tuple[jax.Array, jax.Array] | None = None,
    mask: jax.Array | None = None,
    logits_soft_cap: float | None = None,
    scale: float | None = None,
    implementation: str | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
    tuning: Tuning | str | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Exact attention ``softmax(scale · q kᵀ) v``, computed tile by tile.

    Args:
      query: ``[batch..., q_len, num_heads, head_dim]``.
      key: ``[batch..., kv_len, num_kv_heads, head_dim]``; ``num_heads`` must be a
        multiple of ``num_kv_heads`` (query head ``h`` uses kv head ``h // group``).
      value: ``[batch..., kv_len, num_kv_heads, head_dim_v]``.
      causal: key ``j`` visible to query ``i`` only if ``pos_k(j) <= pos_q(i)``, with
        query positions bottom-right aligned: ``pos_q(i) = i + kv_len - q_len``.
      window: ``(left, right)`` (or ``w`` for ``(w, w)``): key visible only if
        ``pos_q(i) - left <= pos_k(j) <= pos_q(i) + right``; ``None`` leaves a side
        unbounded. With ``causal`` the right side is 0.
      segment_ids: ``[batch..., q_len]`` ints (shared by queries and keys when
        ``q_len == kv_len``) or a ``(q_ids, kv_ids)`` pair; keys are visible only within
        the query's own segment.
      mask: bool, True = attend, broadcastable to ``[batch..., num_heads, q_len, kv_len]``;
        combined (AND) with all of the above.
      logits_soft_cap: scores become ``cap * tanh(scores / cap)`` before masking.
      scale: multiplies ``q kᵀ``; default ``1 / sqrt(head_dim)``.
      implementation: ``"reference"``, ``"scan_v1"``, ``"scan_v2"``, ``"pallas_v1"``,
        ``"pallas_v2"``, or None for the fastest on the arrays' platform.
      block_q, block_k: tile sizes; None picks a default for the shape, mask and device.
        The Pallas kernels need powers of two >= 16 and shrink them (and their pipeline
        depth) until what they keep in shared memory fits the GPU's.
      return_lse: also return the log-sum-exp of each row.
      tuning: launch parameters of the Pallas kernels: None (a table measured on
        Hopper), a `jaxtile.tuning.Tuning`, or ``"autotune"`` (time candidates once per
        shape on the GPU and cache the fastest). Other implementations ignore it.

    Returns:
      ``out [batch..., q_len, num_heads, head_dim_v]`` in the query's dtype, and with
      ``return_lse`` also ``lse [batch..., num_heads, q_len]`` float32 (natural log).
      A query that sees no key gets output 0 and lse ``-inf``.
    """
    name, inputs, config, batch = prepare(
        query,
        key,
        value,
        implementation=implementation,
        return_lse=return_lse,
        causal=causal,
        window=window,
        segment_ids=segment_ids,
        mask=mask,
        logits_soft_cap=logits_soft_cap,
        scale=scale,
        block_q=block_q,
        block_k=block_k,
        tuning=tuning,
    )
    out, lse = _compiled(name)(inputs, config)
    out = out.reshape(*batch, *out.shape[1:])
    if not return_lse:
        return out
    return out, lse.reshape(*batch, *lse.shape[1:])
