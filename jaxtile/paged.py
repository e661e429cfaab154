"""Attention over a paged key/value cache (``jaxtile.paged_attention``): the decode and
chunked-prefill steps of a server whose cache lives in a pool of fixed-size pages, in the
layout of vLLM and of JAX's TPU paged attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxtile import _inputs, api, registry
from jaxtile._core import Config, Inputs, gather_pages
from jaxtile._softmax import with_sinks


def _check_shapes(query, k_pages, v_pages) -> None:
    """Ranks, dtypes, head counts and page geometry of the three float arrays."""
    for name, x in (("query", query), ("k_pages", k_pages), ("v_pages", v_pages)):
        _inputs._array(name, x)
        if jnp.dtype(x.dtype) not in _inputs.FLOAT_DTYPES:
            raise TypeError(f"{name}.dtype={jnp.dtype(x.dtype)} is not supported; use float32, bfloat16 or float16")
    if not query.dtype == k_pages.dtype == v_pages.dtype:
        raise TypeError(
            f"query, k_pages and v_pages must share a dtype; got {query.dtype=}, {k_pages.dtype=}, {v_pages.dtype=}"
        )
    if query.ndim != 4:
        raise ValueError(f"query must be [batch, q_len, num_heads, head_dim]; got {query.shape=}")
    for name, x, dim in (("k_pages", k_pages, "head_dim"), ("v_pages", v_pages, "head_dim_v")):
        if x.ndim != 4:
            raise ValueError(f"{name} must be [num_kv_heads, num_pages, page_size, {dim}]; got {name}.shape={x.shape}")
    if k_pages.shape[:3] != v_pages.shape[:3]:
        raise ValueError(
            "k_pages and v_pages must agree on [num_kv_heads, num_pages, page_size]; "
            f"got {k_pages.shape=}, {v_pages.shape=}"
        )
    if 0 in query.shape[1:] or 0 in k_pages.shape or 0 in v_pages.shape:
        raise ValueError(
            f"lengths, heads, pages and head dims must be positive; got {query.shape=}, {k_pages.shape=}, {v_pages.shape=}"
        )
    if query.shape[-1] != k_pages.shape[-1]:
        raise ValueError(f"head_dim of query and k_pages differ: {query.shape=}, {k_pages.shape=}")
    num_heads, num_kv_heads = query.shape[2], k_pages.shape[0]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} is not a multiple of {num_kv_heads=}")


def _check_page_table(page_table, batch: int, num_pages: int) -> None:
    """Dtype and shape; the entries too where they are concrete."""
    _inputs._array("page_table", page_table)
    if not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise TypeError(f"page_table must have an integer dtype; got {page_table.dtype}")
    if page_table.ndim != 2 or page_table.shape[0] != batch:
        raise ValueError(f"page_table must have shape ({batch}, pages_per_sequence); got {page_table.shape=}")
    if page_table.shape[1] == 0:
        raise ValueError(f"page_table needs at least one page per sequence; got {page_table.shape=}")
    if not _inputs._is_traced(page_table):
        table = np.asarray(page_table)
        bad = (table < 0) | (table >= num_pages)
        if bad.any():
            where = [tuple(int(i) for i in index) for index in np.argwhere(bad)[:8]]
            raise ValueError(
                f"page_table entries must lie in [0, {num_pages}) ({num_pages=}); "
                f"got {table[bad].tolist()[:8]} at (sequence, page) {where}"
            )


def paged_attention(
    query: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    kv_lengths: jax.Array,
    *,
    q_lengths: jax.Array | None = None,
    causal: bool = False,
    window: int | tuple[int | None, int | None] | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
    tuning: object | str | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Exact attention of a batch of queries over a paged key/value cache.

    Sequence ``b``'s cache is the pages ``page_table[b, 0], page_table[b, 1], ...`` laid
    end to end: page ``p`` holds its positions ``p * page_size ... (p + 1) * page_size -
    1``, and the first ``kv_lengths[b]`` positions are filled. Pages may appear in any
    order and be shared between sequences. The result is exactly
    ``flash_attention(query, K, V, kv_lengths=kv_lengths, q_lengths=q_lengths, ...)`` with
    ``K``, ``V`` the contiguous caches ``[batch, pages_per_sequence * page_size,
    num_kv_heads, head_dim]``: a decode step is ``q_len = 1``; in a chunked prefill the
    ``q_lengths[b]`` (default ``q_len``) queries are the last positions of the cache,
    query row ``i`` at position ``i + kv_lengths[b] - q_lengths[b]`` for ``causal`` and
    ``window``; rows past ``q_lengths[b]`` are padding (output 0, lse ``-inf``), as is a
    sequence with an empty cache.

    Implementations whose record has a ``paged_forward`` (the Pallas kernels) read the
    pages in place through the table and are differentiated by gathering them; the
    others run on the gathered caches (one copy of them: ``O(batch ·
    pages_per_sequence · page_size)`` memory, never ``N×N``). Either way it is
    differentiable with respect to ``query``, ``k_pages`` and ``v_pages`` (gradients of
    a shared page add up).

    Args:
      query: ``[batch, q_len, num_heads, head_dim]``.
      k_pages: ``[num_kv_heads, num_pages, page_size, head_dim]``; ``num_heads`` must be
        a multiple of ``num_kv_heads`` (query head ``h`` uses kv head ``h // group``).
      v_pages: ``[num_kv_heads, num_pages, page_size, head_dim_v]``.
      page_table: ``[batch, pages_per_sequence]`` ints in ``[0, num_pages)``.
      kv_lengths: ``[batch]`` ints in ``[0, pages_per_sequence * page_size]``.
      q_lengths: ``[batch]`` ints in ``[0, q_len]``, or None (every row is a query).
      causal, window, logits_soft_cap, sinks, scale, implementation: as in
        `jaxtile.flash_attention`.
      return_lse: also return the log-sum-exp of each row.
      tuning: as in `jaxtile.flash_attention`: a `jaxtile.triton.decode.Tuning` gives
        the tiles (``forward``) and ``num_splits`` pallas_decode reads the pages with;
        None, its defaults for pages (measured by ``python -m bench.decode --tiles
        --splits``, which times every candidate on the pages too).

    Returns:
      ``out [batch, q_len, num_heads, head_dim_v]`` in the query's dtype, and with
      ``return_lse`` also ``lse [batch, num_heads, q_len]`` float32 (natural log).

    Bad shapes or dtypes of the arrays raise before any compute, naming the values, and
    so do concrete page indices outside ``[0, num_pages)`` and lengths outside their
    ranges (and the options, as `jaxtile.flash_attention` checks them). Traced values (under
    ``jit``) cannot be checked: page indices are clipped into ``[0, num_pages)`` by the
    gather, and lengths into their ranges, as in `jaxtile.flash_attention`.
    """
    _check_shapes(query, k_pages, v_pages)
    batch, q_len = query.shape[:2]
    num_pages, page_size = k_pages.shape[1:3]
    _check_page_table(page_table, batch, num_pages)
    pages_per_sequence = page_table.shape[1]
    capacity = pages_per_sequence * page_size
    why = f"{pages_per_sequence=} * {page_size=}"
    _inputs.check_lengths_array("kv_lengths", kv_lengths, (batch,), capacity, why)
    if q_lengths is not None:
        _inputs.check_lengths_array("q_lengths", q_lengths, (batch,), q_len, f"{q_len=}")
    k_cache, v_cache = (jax.ShapeDtypeStruct((batch, capacity, *x.shape[::3]), x.dtype) for x in (k_pages, v_pages))
    chosen, inputs, config, _ = api.prepare(
        query,
        k_cache,
        v_cache,
        implementation=implementation,
        return_lse=return_lse,
        causal=causal,
        window=window,
        segment_ids=None,
        mask=None,
        q_lengths=q_lengths,
        kv_lengths=kv_lengths,
        logits_soft_cap=logits_soft_cap,
        scale=scale,
        block_q=None,
        block_k=None,
        tuning=tuning,
    )
    pages = (k_pages, v_pages, jnp.asarray(page_table, jnp.int32))
    attend = _gathered if chosen.paged_forward is None else _paged
    sinks = _inputs.check_sinks(sinks, inputs.q.shape[2])
    out, lse = attend(chosen.name, inputs.q, *pages, inputs.lengths, config)
    if sinks is not None:
        out, lse = with_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out


def _attend(name: str, query, k_pages, v_pages, page_table, lengths, config: Config):
    """``flash_attention``'s implementation ``name`` on the gathered caches."""
    k, v = gather_pages(k_pages, page_table), gather_pages(v_pages, page_table)
    return api.compiled(registry.get(name))(Inputs(query, k, v, lengths=lengths), config)


def _in_place(name: str, query, k_pages, v_pages, page_table, lengths, config: Config):
    """Implementation ``name``'s forward reading the pages where they are."""
    batch, pages_per_sequence = page_table.shape
    k, v = (
        jax.ShapeDtypeStruct((batch, pages_per_sequence * x.shape[2], x.shape[0], x.shape[3]), x.dtype)
        for x in (k_pages, v_pages)
    )
    inputs = Inputs(query, k, v, lengths=lengths)
    return registry.get(name).paged_forward(inputs, config, (k_pages, v_pages, page_table))


def _in_place_fwd(name, query, k_pages, v_pages, page_table, lengths, config):
    out = _in_place(name, query, k_pages, v_pages, page_table, lengths, config)
    return out, (query, k_pages, v_pages, page_table, lengths)


def _in_place_bwd(name, config, residuals, cotangents):
    """Differentiated by gathering the pages: `_attend`'s VJP (it recomputes the forward)."""
    query, k_pages, v_pages, page_table, lengths = residuals
    _, vjp = jax.vjp(lambda q, k, v: _attend(name, q, k, v, page_table, lengths, config), query, k_pages, v_pages)
    return (*vjp(cotangents), None, None)


_differentiable_in_place = jax.custom_vjp(_in_place, nondiff_argnums=(0, 6))
_differentiable_in_place.defvjp(_in_place_fwd, _in_place_bwd)
_gathered = jax.jit(_attend, static_argnums=(0, 6))
_paged = jax.jit(_differentiable_in_place, static_argnums=(0, 6))
