"""The public entry point, ``jaxtile.flash_attention``: validation, the choice of an
implementation (`jaxtile.registry`), and the assembly of its passes into one
differentiable, sharding-aware, jitted function."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad
from jax.interpreters import partial_eval as pe

from jaxtile import _core, _inputs, _softmax, registry
from jaxtile._core import Config, Inputs
from jaxtile.distributed import _sharding
from jaxtile.mask import MaskSpec


def _platform(x) -> str:
    """Platform of the device holding ``x``; the default backend for traced values."""
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        return next(iter(x.devices())).platform
    return jax.default_backend()


def prepare(
    query,
    key,
    value,
    *,
    implementation,
    return_lse,
    block_q,
    block_k,
    require: registry.Requirement | None = None,
    **options,
):
    """Validates a call (before any compute) and chooses its implementation; returns the
    record, the canonical `Inputs` and `Config`, and the batch shape to restore.
    ``options`` are `_inputs.canonicalize`'s mask, logit and tuning arguments."""
    platform = _platform(query)
    chosen = None if implementation is None else registry.get(implementation)
    power_of_two = chosen is not None and chosen.power_of_two_blocks
    block_q, block_k = (
        _inputs.check_block(name, block, power_of_two=power_of_two)
        for name, block in (("block_q", block_q), ("block_k", block_k))
    )
    _inputs.check_static("return_lse", return_lse, "bool")
    tuning_types = tuple(i.tuning for i in registry.implementations() if i.tuning is not None)
    inputs, config, batch = _inputs.canonicalize(
        query, key, value, block_q=block_q, block_k=block_k, tuning_types=tuning_types, platform=platform, **options
    )
    if chosen is None:
        chosen = registry.choose(inputs, config, require)
    elif require is not None and not require[0](chosen):
        able = [i.name for i in registry.implementations() if require[0](i)]
        raise registry.Unsupported(f"{require[1]}; {chosen.name!r} has none. Use one of {able}")
    registry.check(chosen, inputs, config)
    if chosen.power_of_two_blocks:  # blocks given with implementation=None, now known to need it
        for block_name, block in (("block_q", block_q), ("block_k", block_k)):
            _inputs.check_block(block_name, block, power_of_two=True)
    return chosen, inputs, config, batch


@functools.cache
def compiled(implementation: registry.Implementation, jax_autodiff: bool = False):
    """``implementation``'s attention ``(inputs, config, sinks=None) -> (out, lse)``,
    jitted with its static config so that calls outside ``jit`` compile once per shape
    and option set: its forward and recomputing backward joined into one ``custom_vjp``
    and run per batch/head shard (`_sharding.partitioned`); an implementation without a
    backward pass is plain JAX, differentiated and partitioned by JAX itself. ``sinks``
    go to a forward pass that `takes_sinks` (`registry.Implementation`); for the others
    they fold into the result after it (`_softmax.with_sinks`), and autodiff gives their
    gradient, so every implementation takes them.

    Second derivatives differentiate the passes themselves: a record that is
    ``jax_differentiable`` runs them over every tile there (`_core.differentiated_as`),
    the others raise `registry.Unsupported`. ``jax_autodiff`` (forward-mode calls, which
    a ``custom_vjp`` refuses) runs the forward pass over every tile alone, for JAX to
    differentiate in either mode.
    """
    forward = implementation.forward
    in_kernel = implementation.takes_sinks and not jax_autodiff and implementation.backward is not None
    if jax_autodiff or implementation.backward is None:

        def attention(inputs: Inputs, config: Config):
            out, lse, _ = forward(inputs, _core.every_tile(config) if jax_autodiff else config)
            return out, lse

    else:
        attention = _sharding.partitioned(
            forward, implementation.backward, functools.partial(_derivative, implementation)
        )

    def attend(inputs: Inputs, config: Config, sinks=None):
        if sinks is None or in_kernel:
            return attention(inputs._replace(sinks=sinks), config)
        return _softmax.with_sinks(*attention(inputs, config), sinks)

    return jax.jit(attend, static_argnums=1)


def _derivative(implementation: registry.Implementation, pass_: Callable) -> _core.Derivative:
    """What differentiating one of ``implementation``'s passes runs (`_core.Derivative`)."""

    def derivative(config: Config):
        if implementation.jax_differentiable:
            return lambda *arrays: pass_(*arrays, _core.every_tile(config))
        able = [i.name for i in registry.implementations() if i.jax_differentiable]
        raise registry.Unsupported(
            f"{implementation.name!r} has first derivatives only (its kernels are opaque to JAX); "
            f"second derivatives and forward-mode autodiff need one of {able}"
        )

    return derivative


def _forward_mode(*arrays) -> bool:
    """Whether an array is differentiated in forward mode (``jax.jvp``, ``jax.jacfwd``,
    the outer derivative of ``jax.hessian``) at this call: a tracer of a JVP, possibly
    under reverse-mode and batching tracers. (Reverse mode linearises, with its own
    tracers; forward mode applied to a whole ``jit`` is seen by JAX alone.)"""
    stack = [x for x in arrays if isinstance(x, jax.core.Tracer)]
    while stack:
        x = stack.pop()
        if isinstance(x, ad.JVPTracer) and not isinstance(x.tangent, pe.JaxprTracer):
            return True
        stack += [y for y in (getattr(x, "primal", None), getattr(x, "val", None)) if isinstance(y, jax.core.Tracer)]
    return False


def _recognises(chosen: registry.Implementation, inputs: Inputs, config: Config) -> bool:
    """Whether the call's dense mask may run as the structured call it reads as
    (`registry.Implementation.recognises_masks`)."""
    if not (chosen.recognises_masks and config.platform in chosen.platforms and config.mask.recognisable()):
        return False
    return chosen.supports(inputs, dataclasses.replace(config, mask=config.mask.recognised())) is None


def _recognising(dense: Callable, structured: Callable, inputs: Inputs, config: Config, sinks):
    """The dense call's attention, or that of the structured call its dense mask equals
    (`MaskSpec.recognise`), chosen at run time: causal, causal with padding (lengths,
    which cost the kernels more than positions alone), or the dense mask. ``dense`` is
    the dense call's attention; ``structured(inputs, config)`` a structured call's."""
    lengths, branch = _recognise(config.mask, inputs.mask)
    lengths = jnp.broadcast_to(lengths, (inputs.q.shape[0], 2))

    def recognised(padded: bool):
        call = inputs._replace(mask=None, lengths=lengths if padded else None)
        call_config = dataclasses.replace(config, mask=config.mask.recognised(padded))
        return lambda: structured(call, call_config)(call, call_config, sinks)

    return lax.switch(branch, [recognised(False), recognised(True), lambda: dense(inputs, config, sinks)])


def _recognise(spec: MaskSpec, dense):
    """`MaskSpec.recognise`'s lengths, and the branch of `_recognising` to take: 0 (causal),
    1 (causal with padding) or 2 (dense). Under ``vmap`` the branch stays one scalar for
    the whole batch, so that the choice stays a branch instead of a select that runs
    every call."""

    @jax.custom_batching.custom_vmap
    def recognise(dense):
        lengths, same = spec.recognise(dense)
        padded = jnp.any((lengths[:, 0] != spec.q_len) | (lengths[:, 1] != spec.kv_len))
        return lengths, jnp.where(same, padded.astype(jnp.int32), 2)

    @recognise.def_vmap
    def _batched(axis_size: int, in_batched, dense):
        lengths, branch = recognise(dense.reshape(-1, *dense.shape[2:]))
        return (lengths.reshape(axis_size, -1, 2), branch), (True, False)

    return recognise(dense)


def attend(query, key, value, *, sinks, return_lse: bool, **options):
    """`flash_attention`'s body, shared with `jaxtile.dot_product_attention`: ``options``
    are `prepare`'s (``top_left`` among them)."""
    forward_mode = _forward_mode(query, key, value, sinks)
    if forward_mode:
        options["require"] = (lambda i: i.jax_differentiable, "forward-mode autodiff needs passes JAX differentiates")
    chosen, inputs, config, batch = prepare(query, key, value, return_lse=return_lse, **options)
    sinks = _inputs.check_sinks(sinks, inputs.q.shape[2])
    attention = compiled(chosen, forward_mode)
    if _recognises(chosen, inputs, config):

        def structured(call: Inputs, call_config: Config) -> Callable:
            """The attention of a structured call the mask reads as: that of the call's
            own choice when ``implementation`` is None (say, a kernel without dense
            masks), else the named implementation's."""
            if options["implementation"] is not None:
                return attention
            return compiled(registry.choose(call, call_config, options.get("require")), forward_mode)

        out, lse = _recognising(attention, structured, inputs, config, sinks)
    else:
        out, lse = attention(inputs, config, sinks)
    out = out.reshape(*batch, *out.shape[1:])
    if not return_lse:
        return out
    return out, lse.reshape(*batch, *lse.shape[1:])


def flash_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    causal: bool = False,
    window: int | tuple[int | None, int | None] | None = None,
    segment_ids: jax.Array | tuple[jax.Array, jax.Array] | None = None,
    mask: jax.Array | None = None,
    q_lengths: jax.Array | None = None,
    kv_lengths: jax.Array | None = None,
    bias: jax.Array | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    scale: float | None = None,
    implementation: str | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
    tuning: object | str | None = None,
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
        combined (AND) with all of the above. Read tile by tile; on the GPU kernels a
        mask that is causal, or causal with padding (Flax's ``make_causal_mask`` and
        ``make_attention_mask``), runs as ``causal=True`` with lengths instead, chosen
        at run time (`registry.Implementation.recognises_masks`), on the implementation
        that call picks when ``implementation`` is None.
      q_lengths, kv_lengths: ``[batch...]`` ints: sequence ``b`` has ``q_lengths[b]``
        queries and ``kv_lengths[b]`` keys (a partly filled cache); rows and keys past
        them are padding (padding rows get output 0 and lse ``-inf``), as
        ``jax.nn.dot_product_attention``'s ``query_seq_lengths`` and
        ``key_value_seq_lengths``. Causal masks and windows align query row ``i`` to
        position ``i + kv_lengths[b] - q_lengths[b]`` (bottom-right within each
        sequence's own lengths; either defaults to the full length). Concrete lengths
        outside ``[0, q_len]``/``[0, kv_len]`` are an error; traced ones are clipped.
      bias: float, broadcastable to ``[batch..., num_heads, q_len, kv_len]``: added to the
        scaled scores (``scale · q kᵀ + bias``, before the soft cap and the masks), read
        tile by tile; differentiable. Its gradient is formed per batch element and head
        (``[batch, num_heads, q_len, kv_len]``) and summed to the bias's shape.
      logits_soft_cap: scores become ``cap * tanh(scores / cap)`` before masking.
      sinks: ``[num_heads]`` float learnable attention sinks (gpt-oss): one more logit in
        each row's softmax denominator that contributes no value, so
        ``out_i = sum_j exp(s_ij - lse_i) v_j`` with ``lse_i = log(exp(sinks[h]) +
        sum_j exp(s_ij))``. Differentiable; ``-inf`` means no sink for that head.
      scale: multiplies ``q kᵀ``; default ``1 / sqrt(head_dim)``.
      implementation: a registered name (`jaxtile.registry.names()`: ``"reference"``,
        ``"scan_v1"``, ``"scan_v2"``, ``"pallas_v1"``, ``"pallas_v2"``,
        ``"pallas_decode"``, ``"mosaic_v3"``), or None for the fastest that supports the call on the
        arrays' platform.
      block_q, block_k: tile sizes; None picks a default for the shape, mask and device.
        The Pallas kernels need powers of two >= 16 and shrink them (and their pipeline
        depth) until what they keep in shared memory fits the GPU's.
      return_lse: also return the log-sum-exp of each row.
      tuning: launch parameters of the Pallas kernels: None (a table measured on
        Hopper), a `jaxtile.triton.Tuning`, a `jaxtile.triton.decode.Tuning` (with
        pallas_decode's ``num_splits``), a `jaxtile.mosaic.v3.Tuning` (its
        ``backward`` field tunes the Mosaic backward kernels), or ``"autotune"`` (the
        Triton kernels time candidates once per shape on the GPU and cache the
        fastest). Implementations that take another type ignore it.

    Returns:
      ``out [batch..., q_len, num_heads, head_dim_v]`` in the query's dtype, and with
      ``return_lse`` also ``lse [batch..., num_heads, q_len]`` float32 (natural log).
      A query that sees no key gets output 0 and lse ``-inf`` (with ``sinks``, the
      sink's logit).
    """
    return attend(
        query,
        key,
        value,
        sinks=sinks,
        return_lse=return_lse,
        implementation=implementation,
        causal=causal,
        window=window,
        segment_ids=segment_ids,
        mask=mask,
        q_lengths=q_lengths,
        kv_lengths=kv_lengths,
        bias=bias,
        logits_soft_cap=logits_soft_cap,
        scale=scale,
        block_q=block_q,
        block_k=block_k,
        tuning=tuning,
    )
