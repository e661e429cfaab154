"""What every implementation receives, and how its backward pass is attached.

The public API validates and canonicalises the user's arguments into `Inputs` (arrays)
and `Config` (static, hashable); `Shape` is the sizes of a call. An implementation is a
``forward`` and a recomputing ``backward`` over those (`jaxtile.registry`); the API
joins them with `differentiable` into one ``jax.custom_vjp`` that saves only the inputs,
the output and the softmax statistics.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxtile._softmax import Logits
from jaxtile.mask import MaskSpec

# Hopper (an H100 SXM or H200), what the kernels plan for where no GPU answers: its
# streaming multiprocessors, and the shared memory a thread block may opt into (sm_90).
HOPPER_SMS = 132
HOPPER_SHARED_MEMORY = 232448


class Inputs(NamedTuple):
    """Canonical arrays: one batch dimension, sequence before heads.

    q: ``[batch, q_len, num_heads, head_dim]``
    k: ``[batch, kv_len, num_kv_heads, head_dim]``
    v: ``[batch, kv_len, num_kv_heads, head_dim_v]``
    q_segment_ids: ``[batch, q_len]`` int32, or None.
    kv_segment_ids: ``[batch, kv_len]`` int32, or None.
    mask: bool ``[1|batch, 1|num_heads, 1|q_len, 1|kv_len]`` (True = attend), or None.
    lengths: ``[batch, 2]`` int32 ``(q_length, kv_length)`` per sequence, or None.
    bias: float ``[1|batch, 1|num_heads, 1|q_len, 1|kv_len]`` added to the scaled
      scores, or None.
    sinks: ``[num_heads]`` float32 sink logits (``-inf``: none for that head), or None;
      given only to implementations whose record `takes_sinks` (the API folds them in
      after the others, `_softmax.with_sinks`).
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    q_segment_ids: jax.Array | None = None
    kv_segment_ids: jax.Array | None = None
    mask: jax.Array | None = None
    lengths: jax.Array | None = None
    bias: jax.Array | None = None
    sinks: jax.Array | None = None


# ``tuning="autotune"``: an implementation times its own candidates once per shape.
AUTOTUNE = "autotune"


@dataclasses.dataclass(frozen=True)
class Shape:
    """The sizes of one call: q ``[batch, q_len, num_heads, head_dim]``, k and v
    ``[batch, kv_len, num_kv_heads, head_dim|head_dim_v]`` (leading batch dimensions
    flattened into ``batch``), ``itemsize`` bytes per element."""

    batch: int
    q_len: int
    kv_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    itemsize: int

    @classmethod
    def of(cls, query, key, value) -> Shape:
        """From arrays (or anything with ``shape`` and ``dtype``) ``[batch..., len, heads, dim]``."""
        *batch, q_len, num_heads, head_dim = query.shape
        kv_len, num_kv_heads, head_dim_v = key.shape[-3], key.shape[-2], value.shape[-1]
        itemsize = jnp.dtype(query.dtype).itemsize
        return cls(math.prod(batch), q_len, kv_len, num_heads, num_kv_heads, head_dim, head_dim_v, itemsize)

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.num_heads // self.num_kv_heads

    def head_shares(self, kv_tiles: int, min_programs: int) -> int:
        """Shares of each kv head's query heads in a dK/dV kernel of one program per (key
        tile, batch, kv head, share), each share summing dK, dV over its heads: the
        fewest, a power of two dividing the group, that give ``min_programs`` programs,
        so that MQA's few kv heads still fill the GPU."""
        programs = kv_tiles * self.batch * self.num_kv_heads
        shares = 1
        while self.group % (2 * shares) == 0 and programs * shares < min_programs:
            shares *= 2
        return shares

    def q_bytes(self, dim: int, itemsize: int | None = None) -> int:
        """Bytes of a ``[batch, q_len, num_heads, dim]`` array."""
        return self.batch * self.q_len * self.num_heads * dim * (itemsize or self.itemsize)

    def kv_bytes(self, dim: int, itemsize: int | None = None) -> int:
        """Bytes of a ``[batch, kv_len, num_kv_heads, dim]`` array."""
        return self.batch * self.kv_len * self.num_kv_heads * dim * (itemsize or self.itemsize)


@dataclasses.dataclass(frozen=True)
class Config:
    """Static configuration of one attention call.

    ``block_q``/``block_k`` of None let the implementation choose. ``tuning`` holds an
    implementation's launch parameters (its record's tuning type, `AUTOTUNE`, or None for
    its defaults). ``platform`` is where the arrays live (``"gpu"``, ``"cpu"``, ...).
    """

    mask: MaskSpec
    logits: Logits
    block_q: int | None = None
    block_k: int | None = None
    tuning: Any = None
    platform: str = "cpu"


def group_heads(mask, num_kv_heads: int):
    """A dense mask ``[1|batch, 1|num_heads, q, k]`` as ``[1|batch, 1|num_kv_heads,
    1|group, q, k]``, to broadcast against grouped-query layouts."""
    b, h, q, k = mask.shape
    if h == 1:
        return mask.reshape(b, 1, 1, q, k)
    return mask.reshape(b, num_kv_heads, h // num_kv_heads, q, k)


def pad_to(x, axis: int, size: int, value=0):
    """``x`` padded with ``value`` along ``axis`` to ``size``."""
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def sum_to_shape(x, shape: tuple[int, ...]):
    """``x`` summed over the dimensions that ``shape`` broadcasts (size 1 there): the
    gradient of an array broadcast from ``shape`` to ``x.shape``."""
    axes = tuple(i for i, (n, m) in enumerate(zip(x.shape, shape)) if m == 1 and n != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def bias_grad_dtype(inputs: Inputs):
    """The dtype a backward pass writes the bias's gradient in (`Backward`): the bias's
    where it broadcasts nothing (written once, in its final form), else float32, to be
    summed over what it broadcasts."""
    dims = Shape.of(inputs.q, inputs.k, inputs.v)
    full = (dims.batch, dims.num_heads, dims.q_len, dims.kv_len)
    return inputs.bias.dtype if inputs.bias.shape == full else jnp.float32


def gather_pages(pages, page_table):
    """The contiguous cache ``[batch, pages_per_sequence * page_size, num_kv_heads, dim]``
    held by ``pages [num_kv_heads, num_pages, page_size, dim]``: each sequence's pages in
    the order of its row of ``page_table [batch, pages_per_sequence]`` (indices clipped
    into ``[0, num_pages)``)."""
    num_kv_heads, num_pages, page_size, dim = pages.shape
    batch, pages_per_sequence = page_table.shape
    table = jnp.clip(page_table.astype(jnp.int32), 0, num_pages - 1)
    gathered = pages[:, table].reshape(num_kv_heads, batch, pages_per_sequence * page_size, dim)
    return gathered.transpose(1, 2, 0, 3)


# forward(inputs, config) -> (out, lse, stats); stats is what backward needs besides out.
Forward = Callable[[Inputs, Config], tuple[jax.Array, jax.Array, Any]]
# backward(inputs, out, stats, dout, dlse, config) -> (dq, dk, dv, dbias); dbias is
# ``[batch, num_heads, q_len, kv_len]`` float32 or the bias's dtype (None without a
# bias), whatever the bias broadcasts: `differentiable` sums it to the bias's shape.
Backward = Callable[..., tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]]
# paged_forward(inputs, config, (k_pages, v_pages, page_table)) -> (out, lse): the forward
# pass reading K and V from pages; inputs.k and inputs.v only give the cache's shape.
PagedForward = Callable[[Inputs, Config, tuple[jax.Array, jax.Array, jax.Array]], tuple[jax.Array, jax.Array]]
Attention = Callable[[Inputs, Config], tuple[jax.Array, jax.Array]]


class Unsupported(NotImplementedError):
    """The call needs something the chosen implementation's record says it lacks."""


def every_tile(config: Config) -> Config:
    """``config`` with loops over every tile (`MaskSpec.every_tile`)."""
    return dataclasses.replace(config, mask=dataclasses.replace(config.mask, every_tile=True))


# derivative(config) -> a function of a pass's arrays that computes what the pass does in
# code JAX differentiates, or raises `Unsupported`.
Derivative = Callable[[Config], Callable[..., Any]]


def differentiated_as(pass_: Callable[..., Any], derivative: Derivative) -> Callable[..., Any]:
    """``pass_(*arrays, config)`` (a forward or backward pass, its static config last),
    whose JVP is that of ``derivative(config)``: what forward-mode autodiff and second
    derivatives take from it. A pass's loops skip tiles with bounds computed at run
    time, which JAX can differentiate in forward mode only; ``derivative`` is the same
    pass over every tile (`every_tile`), or one that raises."""

    def run(*args):
        *arrays, config = args
        compute = jax.custom_jvp(lambda *arrays: pass_(*arrays, config))
        compute.defjvp(lambda primals, tangents: jax.jvp(derivative(config), primals, tangents))
        return compute(*arrays)

    return run


def _sinks_grad(sinks, out, lse, dout, dlse):
    """The gradient of ``sinks [h]``: each row's sink probability ``exp(sink - lse)``
    times ``dlse - rowsum(dO ∘ O)`` (the sink's value is 0, so its score's gradient is
    that of a key whose ``dP`` is 0), summed over the batch and the rows; 0 for a sink of
    ``-inf``, whatever the cotangents of rows that see nothing."""
    sink = sinks[None, :, None]
    rows = jnp.einsum("bqhd,bqhd->bhq", dout.astype(jnp.float32), out.astype(jnp.float32))
    return jnp.sum(jnp.where(sink == -jnp.inf, 0.0, jnp.exp(sink - lse) * (dlse - rows)), axis=(0, 2))


def differentiable(forward: Forward, backward: Backward) -> Attention:
    """Returns ``attention(inputs, config) -> (out, lse)`` with a recomputing VJP.

    ``out`` is ``[batch, q_len, num_heads, head_dim_v]`` in the query dtype, ``lse`` is
    ``[batch, num_heads, q_len]`` float32. The backward pass receives the cotangent of
    ``lse`` too, so ``return_lse=True`` outputs are differentiable. With ``inputs.sinks``
    the forward pass has folded them into ``out`` and ``lse``, so the backward pass's
    recomputed ``P`` is already normalised over them; their gradient is `_sinks_grad`.
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
    def attention(inputs: Inputs, config: Config):
        out, lse, _ = forward(inputs, config)
        return out, lse

    def attention_fwd(inputs: Inputs, config: Config):
        out, lse, stats = forward(inputs, config)
        return (out, lse), (inputs, out, stats, None if inputs.sinks is None else lse)

    def attention_bwd(config: Config, residuals, cotangents):
        inputs, out, stats, lse = residuals
        dout, dlse = cotangents
        dq, dk, dv, dbias = backward(inputs, out, stats, dout, dlse, config)
        if dbias is not None:
            dbias = sum_to_shape(dbias, inputs.bias.shape).astype(inputs.bias.dtype)
        dsinks = None if inputs.sinks is None else _sinks_grad(inputs.sinks, out, lse, dout, dlse)
        return (Inputs(dq, dk, dv, bias=dbias, sinks=dsinks),)

    attention.defvjp(attention_fwd, attention_bwd)
    return attention
