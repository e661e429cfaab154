"""How much work and memory an attention call needs, computed without running it.

* `tile_visits`: how many (query tile, key tile) pairs the tiled implementations visit
  for a mask, how many of those need the element-wise mask, and the fraction of the work
  that causal or windowed masking saves (FlashTile's ``get_causal_efficiency``). The
  counts come from `MaskSpec.kv_spans`, the same function that bounds the loops.
* `memory_usage`: the bytes a call needs (FlashTile's ``get_memory_usage``): inputs,
  outputs, what the forward pass saves for the backward pass, and temporaries. The
  reference materialises ``[batch, heads, q_len, kv_len]`` score matrices, O(N²); the
  ``lax`` tile loops hold O(N) rows plus a few ``[block_q, block_k]`` tiles. Each
  implementation's record carries the model of its algorithm
  (`jaxtile.registry.Implementation.memory`); ``tests/test_analysis.py`` checks them
  against XLA's own accounting (``jax.jit(f).lower(...).compile().memory_analysis()``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxtile import registry
from jaxtile._core import Shape
from jaxtile.mask import MaskSpec, cdiv


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
    num_q_tiles = cdiv(spec.q_len, block_q)
    spans = spec.kv_spans(np.arange(num_q_tiles), block_q, block_k)
    counts = [
        (int(np.sum(np.broadcast_to(np.asarray(s.stop) - np.asarray(s.start), num_q_tiles))), s.masked) for s in spans
    ]
    return TileVisits(
        num_q_tiles=num_q_tiles,
        num_kv_tiles=cdiv(spec.kv_len, block_k),
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
      implementation: a registered implementation's name (`jaxtile.registry.names`).
      block_q, block_k: the tiles of implementations whose memory depends on them
        (None: their default).
      backward: the forward and backward pass together, as ``jax.vjp`` runs them.
    """
    shape = Shape.of(query, key, value)
    qkv = shape.q_bytes(shape.head_dim) + shape.kv_bytes(shape.head_dim + shape.head_dim_v)
    inputs = qkv + (shape.q_bytes(shape.head_dim_v) if backward else 0)
    lse = shape.batch * shape.num_heads * shape.q_len * 4
    outputs = qkv if backward else shape.q_bytes(shape.head_dim_v) + lse
    residuals, temporaries = registry.get(implementation).memory(shape, block_q, block_k, backward)
    return MemoryUsage(inputs, outputs, residuals, temporaries)
