"""How much work and memory an attention call needs, computed without running it.

* `tile_visits`: how many (query tile, key tile) pairs the tiled implementations visit
  for a mask, how many of those need the element-wise mask, and the fraction of the work
  that causal or windowed masking saves (FlashTile's ``get_causal_efficiency``). The
  counts come from `MaskSpec.kv_spans`, the same function that bounds the loops.
* `memory_usage`: the bytes a call needs (FlashTile's ``get_memory_usage``): inputs,
  outputs, what the forward pass saves for the backward pass, and temporaries. The
  reference materialises ``[batch, heads, q_len, kv_len]`` score matrices, O(N²); the
  ``lax`` tile loops hold O(N) rows plus a few ``[block_q, block_k]`` tiles. These are
  models of the algorithms; ``tests/test_analysis.py`` checks them against XLA's own
  accounting (``jax.jit(f).lower(...).compile().memory_analysis()``).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from jaxtile import scan_v1, scan_v2
from jaxtile._lax_tiles import Tiling
from jaxtile.mask import MaskSpec

_F32 = 4


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class TileVisits:
    """The (query tile, key tile) pairs one forward (or backward) pass visits, per head.

    Attributes:
      num_q_tiles, num_kv_tiles: tiles along each sequence.
      visited: pairs whose scores are computed.
      masked: visited pairs that also apply the element-wise mask (the boundary tiles).
    """

    num_q_tiles: int
    num_kv_tiles: int
    visited: int
    masked: int

    @property
    def total(self) -> int:
        """All pairs: what attention without any mask visits."""
        return self.num_q_tiles * self.num_kv_tiles

    @property
    def skipped(self) -> int:
        return self.total - self.visited

    @property
    def savings(self) -> float:
        """The fraction of the tile work that the mask saves, ``skipped / total``."""
        return self.skipped / self.total


def tile_visits(spec: MaskSpec, block_q: int, block_k: int) -> TileVisits:
    """Tile pairs the tiled implementations visit for ``spec`` with these tiles.

    Blocks longer than a sequence are shortened to it, as the implementations do.
    With segment ids or a dense mask, tiles are skipped by position only (every visited
    tile is masked); the counts then depend on ``causal``/``window`` alone.

    >>> visits = tile_visits(MaskSpec.create(4096, 4096, causal=True), 128, 128)
    >>> visits.visited, visits.total, visits.masked
    (528, 1024, 32)
    """
    block_q, block_k = min(block_q, spec.q_len), min(block_k, spec.kv_len)
    num_q_tiles = _cdiv(spec.q_len, block_q)
    spans = spec.kv_spans(np.arange(num_q_tiles), block_q, block_k)
    counts = [
        (int(np.sum(np.broadcast_to(np.asarray(s.stop) - np.asarray(s.start), num_q_tiles))), s.masked) for s in spans
    ]
    return TileVisits(
        num_q_tiles=num_q_tiles,
        num_kv_tiles=_cdiv(spec.kv_len, block_k),
        visited=sum(n for n, _ in counts),
        masked=sum(n for n, masked in counts if masked),
    )


@dataclasses.dataclass(frozen=True)
class MemoryUsage:
    """Bytes one attention call needs, by what they hold.

    Attributes:
      inputs: q, k, v (and the output cotangent dO with ``backward``).
      outputs: out and lse; with ``backward``, dq, dk, dv.
      residuals: what the forward pass keeps for the backward pass besides the inputs
        (0 without ``backward``).
      temporaries: the largest working set besides all of the above.
    """

    inputs: int
    outputs: int
    residuals: int
    temporaries: int

    @property
    def total(self) -> int:
        return self.inputs + self.outputs + self.residuals + self.temporaries


@dataclasses.dataclass(frozen=True)
class _Shape:
    batch: int
    q_len: int
    kv_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    itemsize: int

    def q(self, dim: int, itemsize: int) -> int:
        """Bytes of a ``[batch, q_len, num_heads, dim]`` array."""
        return self.batch * self.q_len * self.num_heads * dim * itemsize

    def kv(self, dim: int, itemsize: int) -> int:
        """Bytes of a ``[batch, kv_len, num_kv_heads, dim]`` array."""
        return self.batch * self.kv_len * self.num_kv_heads * dim * itemsize


def memory_usage(
    query,
    key,
    value,
    *,
    implementation: str,
    block_q: int | None = None,
    block_k: int | None = None,
    backward: bool = False,
) -> MemoryUsage:
    """The memory ``flash_attention(query, key, value, ...)`` needs, in bytes.

    Args:
      query, key, value: arrays or anything with ``shape`` and ``dtype`` (such as
        ``jax.ShapeDtypeStruct``), shaped as for `jaxtile.flash_attention`.
      implementation: one of `jaxtile.IMPLEMENTATIONS`.
      block_q, block_k: the tiles of the ``scan`` implementations (None: their default;
        the Pallas kernels' memory does not depend on their tiles).
      backward: the forward and backward pass together, as ``jax.vjp`` runs them.
    """
    *batch, q_len, num_heads, head_dim = query.shape
    kv_len, num_kv_heads, head_dim_v = key.shape[-3], key.shape[-2], value.shape[-1]
    shape = _Shape(
        math.prod(batch),
        q_len,
        kv_len,
        num_heads,
        num_kv_heads,
        head_dim,
        head_dim_v,
        jnp.dtype(query.dtype).itemsize,
    )
    s = shape.itemsize
    qkv = shape.q(head_dim, s) + shape.kv(head_dim + head_dim_v, s)
    inputs = qkv + (shape.q(head_dim_v, s) if backward else 0)
    lse = shape.batch * num_heads * q_len * _F32
    outputs = qkv if backward else shape.q(head_dim_v, s) + lse
    if implementation == "reference":
        residuals, temporaries = _materialised(shape, backward)
    elif implementation in ("scan_v1", "scan_v2"):
        module = scan_v1 if implementation == "scan_v1" else scan_v2
        default = module.DEFAULT_BLOCK
        tiling = Tiling(min(block_q or default, q_len), min(block_k or default, kv_len), q_len, kv_len)
        residuals, temporaries = _lax_tiles(shape, tiling, implementation == "scan_v1", backward)
    elif implementation in ("pallas_v1", "pallas_v2"):
        residuals, temporaries = _kernels(shape, implementation == "pallas_v1", backward)
    else:
        raise ValueError(f"unknown {implementation=}")
    return MemoryUsage(inputs, outputs, residuals, temporaries)


def _kernels(shape: _Shape, fa1: bool, backward: bool) -> tuple[int, int]:
    """Residuals and temporaries of the Pallas kernels: O(N) rows, nothing per tile
    (tiles live in registers and shared memory).

    FlashAttention-2 writes out and lse directly; its backward pass adds ``D`` and the
    base-2 lse, one float32 row each. FlashAttention-1 keeps the running output in a
    float32 buffer with ``m`` and ``l`` (forward) and accumulates dQ in float32 beside
    ``m`` and ``1/l`` (backward); for float32 inputs the buffers are the outputs.
    """
    row = shape.batch * shape.num_heads * shape.q_len * _F32
    stats = 2 if fa1 else 1
    buffers = fa1 and shape.itemsize != _F32
    forward = (shape.q(shape.head_dim_v, _F32) if buffers else 0) + (2 * row if fa1 else 0)
    if not backward:
        return 0, forward
    residuals = shape.q(shape.head_dim_v, shape.itemsize) + stats * row
    backward_temps = (shape.q(shape.head_dim, _F32) if buffers else 0) + 2 * row
    return residuals, max(forward, backward_temps)


def _materialised(shape: _Shape, backward: bool) -> tuple[int, int]:
    """Residuals and temporaries of the reference, in float32 score matrices.

    Forward: the scores S and the probabilities P. Backward: autodiff keeps P
    unnormalised and normalised, and forms dP and dS.
    """
    scores = shape.batch * shape.num_heads * shape.q_len * shape.kv_len * _F32
    if backward:
        return 2 * scores, 2 * scores
    return 0, 2 * scores


def _lax_tiles(shape: _Shape, tiling: Tiling, fa1: bool, backward: bool) -> tuple[int, int]:
    """Residuals and temporaries of the ``lax`` tile loops: O(N) rows plus a few tiles.

    Both passes make head-major, padded copies of q, k, v; each visited tile pair forms
    float32 ``[block_q, block_k]`` tiles for every head at once (S and P forward; S, P,
    dP and dS backward). Forward, FlashAttention-2 stacks the per-tile outputs and lse;
    FlashAttention-1 carries the float32 output and its ``m``, ``l``. Backward keeps the
    output and the statistics (lse, or ``m`` and ``l``), accumulates dQ over the whole
    sequence and stacks per-tile dK, dV, all in float32.
    """
    s = shape.itemsize
    padded = dataclasses.replace(shape, q_len=tiling.q_padded, kv_len=tiling.kv_padded)
    tile = shape.batch * shape.num_heads * tiling.block_q * tiling.block_k * _F32
    row = shape.batch * shape.num_heads * tiling.q_padded * _F32
    copies = padded.q(shape.head_dim, s) + padded.kv(shape.head_dim + shape.head_dim_v, s)
    stats = 2 if fa1 else 1
    if fa1:
        state = padded.q(shape.head_dim_v, _F32) + stats * row
    else:
        state = padded.q(shape.head_dim_v, s) + row
    forward = copies + state + 2 * tile
    if not backward:
        return 0, forward
    residuals = shape.q(shape.head_dim_v, s) + stats * shape.batch * shape.num_heads * shape.q_len * _F32
    # dO (and O for FA1, which reads it per tile) head-major; dQ, dK, dV in float32.
    rows_in = padded.q(shape.head_dim_v, s) * (2 if fa1 else 1)
    grads = padded.q(shape.head_dim, _F32) + padded.kv(shape.head_dim + shape.head_dim_v, _F32)
    backward_temps = copies + rows_in + grads + (stats + 1) * row + 4 * tile
    return residuals, max(forward, backward_temps)
