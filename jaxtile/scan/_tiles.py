"""Tiled, head-major views of the canonical arrays, for the ``jax.lax`` implementations.

The lax loops process every batch element and head of a tile at once, so tiles are
``[batch, num_kv_heads, group, rows, dim]`` slices (``group = num_heads //
num_kv_heads``: the query heads that share one kv head). Sequences are zero-padded to a
whole number of tiles; the mask description hides the padding.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxtile._core import Config, Inputs, Shape, group_heads, pad_to
from jaxtile.mask import MaskSpec, cdiv, uniform_bounds


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Tile sizes and counts of one call."""

    block_q: int
    block_k: int
    q_len: int
    kv_len: int

    @classmethod
    def create(cls, config: Config, default_block: int) -> Tiling:
        """Tiles from the config (or ``default_block``), never longer than the sequence."""
        return cls.of(config.mask.q_len, config.mask.kv_len, config.block_q, config.block_k, default_block)

    @classmethod
    def of(cls, q_len: int, kv_len: int, block_q: int | None, block_k: int | None, default_block: int) -> Tiling:
        """``block_q``/``block_k`` (or ``default_block``), never longer than the sequence."""
        return cls(min(block_q or default_block, q_len), min(block_k or default_block, kv_len), q_len, kv_len)

    @property
    def num_q_tiles(self) -> int:
        return cdiv(self.q_len, self.block_q)

    @property
    def num_kv_tiles(self) -> int:
        return cdiv(self.kv_len, self.block_k)

    @property
    def q_padded(self) -> int:
        return self.num_q_tiles * self.block_q

    @property
    def kv_padded(self) -> int:
        return self.num_kv_tiles * self.block_k


class Tiled(NamedTuple):
    """Head-major, padded arrays.

    q: ``[batch, kv_heads, group, q_padded, head_dim]``
    k: ``[batch, kv_heads, kv_padded, head_dim]``; v likewise with ``head_dim_v``.
    q_segment_ids / kv_segment_ids: ``[batch, q_padded]`` / ``[batch, kv_padded]``.
    mask: ``[1|batch, 1|kv_heads, 1|group, 1|q_padded, 1|kv_padded]``; bias likewise.
    lengths: ``[batch, 2]`` ``(q_length, kv_length)``.
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    q_segment_ids: jax.Array | None
    kv_segment_ids: jax.Array | None
    mask: jax.Array | None
    lengths: jax.Array | None
    bias: jax.Array | None


def q_heads_first(x, num_kv_heads: int, padded: int):
    """``[batch, len, heads, ...]`` -> ``[batch, kv_heads, group, padded, ...]`` (zero-padded)."""
    b, n, h, *rest = x.shape
    x = x.reshape(b, n, num_kv_heads, h // num_kv_heads, *rest)
    return pad_to(jnp.moveaxis(x, 1, 3), 3, padded)


def q_seq_last(x, num_kv_heads: int, padded: int, value=0):
    """``[batch, heads, len]`` -> ``[batch, kv_heads, group, padded]``."""
    b, h, n = x.shape
    return pad_to(x.reshape(b, num_kv_heads, h // num_kv_heads, n), 3, padded, value)


def q_heads_last(x, q_len: int):
    """Inverse of `q_heads_first`: ``[batch, kv_heads, group, padded, ...]`` ->
    ``[batch, q_len, heads, ...]``."""
    b, hk, g, _, *rest = x.shape
    return jnp.moveaxis(x[:, :, :, :q_len], 3, 1).reshape(b, q_len, hk * g, *rest)


def kv_heads_first(x, padded: int):
    """``[batch, len, kv_heads, dim]`` -> ``[batch, kv_heads, padded, dim]``."""
    return pad_to(jnp.moveaxis(x, 1, 2), 2, padded)


def kv_heads_last(x, kv_len: int, dtype):
    """Per-tile results ``[kv_tiles, batch, kv_heads, block_k, dim]`` (as a ``lax.scan``
    over key tiles stacks them) -> ``[batch, kv_len, kv_heads, dim]`` in ``dtype``."""
    n, b, h, bk, d = x.shape
    return jnp.moveaxis(x, 0, 2).reshape(b, h, n * bk, d)[:, :, :kv_len].swapaxes(1, 2).astype(dtype)


def _scores_layout(x, num_kv_heads: int, tiling: Tiling, fill):
    """A ``[1|batch, 1|num_heads, 1|q_len, 1|kv_len]`` array (dense mask, bias) as
    ``[1|batch, 1|kv_heads, 1|group, 1|q_padded, 1|kv_padded]``, padded with ``fill``."""
    if x is None:
        return None
    x = group_heads(x, num_kv_heads)
    n_q, n_kv = x.shape[3:]
    if n_q > 1:
        x = pad_to(x, 3, tiling.q_padded, fill)
    if n_kv > 1:
        x = pad_to(x, 4, tiling.kv_padded, fill)
    return x


def tile(inputs: Inputs, tiling: Tiling) -> Tiled:
    """Pads the canonical inputs to whole tiles and puts heads before sequence."""
    num_kv_heads = inputs.k.shape[2]

    def seg(ids, padded):
        return None if ids is None else pad_to(ids, 1, padded)

    return Tiled(
        q_heads_first(inputs.q, num_kv_heads, tiling.q_padded),
        kv_heads_first(inputs.k, tiling.kv_padded),
        kv_heads_first(inputs.v, tiling.kv_padded),
        seg(inputs.q_segment_ids, tiling.q_padded),
        seg(inputs.kv_segment_ids, tiling.kv_padded),
        _scores_layout(inputs.mask, num_kv_heads, tiling, False),
        inputs.lengths,
        _scores_layout(inputs.bias, num_kv_heads, tiling, 0),
    )


def tile_bounds(inputs: Inputs, spec: MaskSpec, tiling: Tiling, *, transposed: bool):
    """`MaskSpec.tile_bounds` of the runtime mask that hold for every batch element and
    head at once (the loops process them together), or None: ``[num_outer_tiles, 4]``."""
    bounds = spec.tile_bounds(
        tiling.block_q,
        tiling.block_k,
        transposed=transposed,
        q_segment_ids=inputs.q_segment_ids,
        kv_segment_ids=inputs.kv_segment_ids,
        dense=inputs.mask,
        lengths=inputs.lengths,
    )
    return None if bounds is None else uniform_bounds(bounds)


def bounds_of(bounds, tile):
    """Tile ``tile``'s ``(lo, full_lo, full_hi, hi)`` from `tile_bounds` (None stays None)."""
    return None if bounds is None else tuple(bounds[tile, i] for i in range(4))


def rows(x, index, block: int, axis: int):
    """Tile ``index`` of ``x`` along ``axis``: ``x[..., index*block : (index+1)*block, ...]``."""
    return lax.dynamic_slice_in_dim(x, index * block, block, axis)


def pair_tile(x, tiling: Tiling, q_tile, kv_tile):
    """Tile ``(q_tile, kv_tile)`` of a `Tiled` mask or bias (dimensions of size 1 stay)."""
    if x.shape[3] > 1:
        x = rows(x, q_tile, tiling.block_q, 3)
    if x.shape[4] > 1:
        x = rows(x, kv_tile, tiling.block_k, 4)
    return x


def set_pair_tile(x, value, tiling: Tiling, q_tile, kv_tile):
    """``x [..., q_padded, kv_padded]`` with tile ``(q_tile, kv_tile)`` set to ``value``."""
    q_tile, kv_tile = jnp.asarray(q_tile, jnp.int32), jnp.asarray(kv_tile, jnp.int32)
    start = (jnp.int32(0),) * (x.ndim - 2) + (q_tile * tiling.block_q, kv_tile * tiling.block_k)
    return lax.dynamic_update_slice(x, value, start)


def bias_tile(x: Tiled, tiling: Tiling, q_tile, kv_tile):
    """Tile ``(q_tile, kv_tile)`` of the bias in float32, or None without one."""
    return None if x.bias is None else pair_tile(x.bias, tiling, q_tile, kv_tile).astype(jnp.float32)


def scores_grad(dbias, shape, q_len: int, kv_len: int):
    """``[batch, kv_heads, group, q_padded, kv_padded]`` per-tile gradients of the
    scores -> ``[batch, num_heads, q_len, kv_len]`` (`_core.Backward`'s dbias); None
    stays None."""
    if dbias is None:
        return None
    b, hk, g, qp, kp = shape
    return dbias.reshape(b, hk * g, qp, kp)[:, :, :q_len, :kv_len]


def visible(spec: MaskSpec, x: Tiled, tiling: Tiling, q_tile, kv_tile):
    """Element-wise mask of one tile pair, ``[1|batch, 1|kv_heads, 1|group, block_q, block_k]``."""
    bq, bk = tiling.block_q, tiling.block_k
    q_tile, kv_tile = jnp.asarray(q_tile, jnp.int32), jnp.asarray(kv_tile, jnp.int32)
    q_seg = kv_seg = dense = lengths = None
    if spec.has_lengths:
        lengths = (x.lengths[:, 0, None, None, None, None], x.lengths[:, 1, None, None, None, None])
    if spec.has_segments:
        q_seg = rows(x.q_segment_ids, q_tile, bq, 1)[:, None, None, :, None]
        kv_seg = rows(x.kv_segment_ids, kv_tile, bk, 1)[:, None, None, None, :]
    if spec.has_dense_mask:
        dense = pair_tile(x.mask, tiling, q_tile, kv_tile)
    vis = spec.visible(
        q_tile * bq + jnp.arange(bq, dtype=jnp.int32)[:, None],
        kv_tile * bk + jnp.arange(bk, dtype=jnp.int32)[None, :],
        q_segment=q_seg,
        kv_segment=kv_seg,
        dense=dense,
        lengths=lengths,
    )
    return vis.reshape((1,) * (5 - vis.ndim) + vis.shape)


# The products of the loops, accumulated in float32 at full precision (a GPU's default
# for float32 inputs is one TF32 product, ~1e-3 relative): scores ``Q Kᵀ`` (and
# ``dP = dO Vᵀ``) of ``[b, h, g, rows, dim]`` by ``[b, h, cols, dim]`` tiles; a
# ``[b, h, g, block_q, block_k]`` tile (P or dS) times ``[..., dim]`` tiles over the keys
# (``P V``, ``dS K``) and over the group's query rows (``Pᵀ dO``, ``dSᵀ Q``).
_einsum = functools.partial(jnp.einsum, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
scores = functools.partial(_einsum, "bhgqd,bhkd->bhgqk")
over_keys = functools.partial(_einsum, "bhgqk,bhkd->bhgqd")
over_queries = functools.partial(_einsum, "bhgqk,bhgqd->bhkd")


def memory(shape: Shape, tiling: Tiling, fa1: bool, backward: bool) -> tuple[int, int]:
    """Residuals and temporaries of the ``lax`` tile loops: O(N) rows plus a few tiles.

    Both passes make head-major, padded copies of q, k, v; each visited tile pair forms
    float32 ``[block_q, block_k]`` tiles for every head at once (S and P forward; S, P,
    dP and dS backward). Forward, FlashAttention-2 stacks the per-tile outputs and lse;
    FlashAttention-1 carries the float32 output and its ``m``, ``l``. Backward keeps the
    output and the statistics (lse, or ``m`` and ``l``), accumulates dQ over the whole
    sequence and stacks per-tile dK, dV, all in float32.
    """
    f32 = 4
    padded = dataclasses.replace(shape, q_len=tiling.q_padded, kv_len=tiling.kv_padded)
    tile = shape.batch * shape.num_heads * tiling.block_q * tiling.block_k * f32
    row = shape.batch * shape.num_heads * tiling.q_padded * f32
    copies = padded.q_bytes(shape.head_dim) + padded.kv_bytes(shape.head_dim + shape.head_dim_v)
    stats = 2 if fa1 else 1
    if fa1:
        state = padded.q_bytes(shape.head_dim_v, f32) + stats * row
    else:
        state = padded.q_bytes(shape.head_dim_v) + row
    forward = copies + state + 2 * tile
    if not backward:
        return 0, forward
    residuals = shape.q_bytes(shape.head_dim_v) + stats * shape.batch * shape.num_heads * shape.q_len * f32
    # dO (and O for FA1, which reads it per tile) head-major; dQ, dK, dV in float32.
    rows_in = padded.q_bytes(shape.head_dim_v) * (2 if fa1 else 1)
    grads = padded.q_bytes(shape.head_dim, f32) + padded.kv_bytes(shape.head_dim + shape.head_dim_v, f32)
    backward_temps = copies + rows_in + grads + (stats + 1) * row + 4 * tile
    return residuals, max(forward, backward_temps)
