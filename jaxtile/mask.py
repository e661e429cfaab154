"""The attention mask, described once.

Every implementation asks this module two questions and nothing else about masking:

* element-wise, inside a tile: is key ``j`` visible to query ``i``?
  (:meth:`MaskSpec.visible`)
* tile-wise: which key tiles can query tile ``t`` see at all, and which of those need
  the element-wise mask? (:meth:`MaskSpec.kv_spans`; :meth:`MaskSpec.q_spans` answers
  the transposed question for backward passes that loop over query tiles.)

Positions are bottom-right aligned, as in flash-attn and cuDNN: query row ``i`` sits at
position ``i + kv_len - q_len`` and key column ``j`` at position ``j``. Key ``j`` is
visible to query ``i`` iff both are in bounds and

    pos_q(i) - left  <=  j  <=  pos_q(i) + right

(``None`` leaves a side unbounded; causal is ``right = 0``), the segment ids of the two
match, and the dense mask, if any, is True there.

The tile functions take tile indices as Python ints, NumPy arrays or traced int32
scalars, so the same code bounds the loops of the ``lax`` implementations, the Pallas
kernels and the analysis helpers.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax


class TileSpan(NamedTuple):
    """Tiles ``start <= t < stop`` of one loop; ``masked`` (static) says whether the
    element-wise mask must be applied to them."""

    start: jnp.ndarray | int
    stop: jnp.ndarray | int
    masked: bool


def _cdiv(a, b: int):
    """Ceiling division of a non-negative int (or int array) by a positive int."""
    return lax.div(a + (b - 1), b)


def _clip(x, lo, hi):
    return jnp.minimum(jnp.maximum(x, lo), hi)


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """Static description of which keys each query may attend to.

    Attributes:
      q_len: number of query rows.
      kv_len: number of key columns.
      left: how far back (in positions) a query may look; ``None`` is unbounded.
      right: how far ahead a query may look; ``None`` is unbounded, ``0`` is causal.
      has_segments: per-token segment ids also apply (their values are runtime arrays).
      has_dense_mask: an arbitrary boolean mask also applies (a runtime array).
    """

    q_len: int
    kv_len: int
    left: int | None = None
    right: int | None = None
    has_segments: bool = False
    has_dense_mask: bool = False

    @classmethod
    def create(
        cls,
        q_len: int,
        kv_len: int,
        *,
        causal: bool = False,
        window: int | tuple[int | None, int | None] | None = None,
        has_segments: bool = False,
        has_dense_mask: bool = False,
    ) -> MaskSpec:
        """Builds the spec from the public arguments of ``flash_attention``."""
        if window is None:
            left, right = None, None
        elif isinstance(window, int):
            left, right = window, window
        else:
            left, right = window
        if causal:
            right = 0 if right is None else min(right, 0)
        return cls(q_len, kv_len, left, right, has_segments, has_dense_mask)

    @property
    def offset(self) -> int:
        """Position of query row 0: ``kv_len - q_len`` (bottom-right alignment)."""
        return self.kv_len - self.q_len

    @property
    def is_structured(self) -> bool:
        """True when tiles can be classified from indices alone (no runtime mask)."""
        return not (self.has_segments or self.has_dense_mask)

    def visible(self, q_idx, kv_idx, *, q_segment=None, kv_segment=None, dense=None, check_bounds=True):
        """Element-wise visibility; arguments broadcast against each other.

        Args:
          q_idx: query row indices, e.g. ``[block_q, 1]``.
          kv_idx: key column indices, e.g. ``[1, block_k]``.
          q_segment, kv_segment: segment ids, shaped to broadcast like the indices;
            required iff ``has_segments``.
          dense: the boolean mask tile; required iff ``has_dense_mask``.
          check_bounds: also hide indices past ``q_len``/``kv_len``; a kernel whose
            tiles never reach past the key sequence may skip it.
        Returns:
          bool array of the broadcast shape.
        """
        pos = q_idx + self.offset
        ok = (q_idx < self.q_len) & (kv_idx < self.kv_len) if check_bounds else True
        if self.left is not None:
            ok &= kv_idx >= pos - self.left
        if self.right is not None:
            ok &= kv_idx <= pos + self.right
        if self.has_segments:
            ok &= q_segment == kv_segment
        if self.has_dense_mask:
            ok &= dense
        return ok

    def kv_spans(self, q_tile, block_q: int, block_k: int) -> tuple[TileSpan, ...]:
        """Key tiles that query tile ``q_tile`` must visit, in increasing order.

        Tiles outside the spans hold no visible key for any row of the query tile.
        Spans with ``masked=False`` are interior: every key of the tile is in bounds and
        inside the window for every row, so no element-wise mask is needed there.
        """
        n_kv = self.kv_len
        first = q_tile * block_q + self.offset
        last = jnp.minimum(q_tile * block_q + block_q, self.q_len) - 1 + self.offset
        lo = 0 if self.left is None else lax.div(_clip(first - self.left, 0, n_kv), block_k)
        if self.right is None:
            hi = _cdiv(n_kv, block_k)
        else:
            hi = _cdiv(_clip(last + self.right + 1, 0, n_kv), block_k)
        lo = jnp.minimum(lo, hi)
        if not self.is_structured:
            return (TileSpan(lo, hi, True),)
        if self.left is None:
            full_lo = lo
        else:
            last_unclipped = q_tile * block_q + block_q - 1 + self.offset
            full_lo = _clip(_cdiv(jnp.maximum(last_unclipped - self.left, 0), block_k), lo, hi)
        if self.right is None:
            full_hi = n_kv // block_k
        else:
            full_hi = lax.div(_clip(first + self.right + 1, 0, n_kv), block_k)
        full_hi = _clip(full_hi, full_lo, hi)
        spans = []
        if self.left is not None:
            spans.append(TileSpan(lo, full_lo, True))
        if n_kv >= block_k:  # otherwise no key tile is whole, and the span is empty
            spans.append(TileSpan(full_lo, full_hi, False))
        if self.right is not None or n_kv % block_k:
            spans.append(TileSpan(full_hi, hi, True))
        return tuple(spans)

    def q_spans(self, kv_tile, block_q: int, block_k: int) -> tuple[TileSpan, ...]:
        """Query tiles that can see key tile ``kv_tile``; the transpose of `kv_spans`.

        A (query tile, key tile) pair is interior here iff it is interior there. Query
        rows past ``q_len`` are not masked in interior tiles: callers load them as zeros
        with an lse of +inf, so they contribute nothing.
        """
        n_q = self.q_len
        first = kv_tile * block_k
        last = jnp.minimum(first + block_k, self.kv_len) - 1
        lo = 0 if self.right is None else lax.div(_clip(first - self.right - self.offset, 0, n_q), block_q)
        if self.left is None:
            hi = _cdiv(n_q, block_q)
        else:
            hi = _cdiv(_clip(last + self.left - self.offset + 1, 0, n_q), block_q)
        lo = jnp.minimum(lo, hi)
        if not self.is_structured:
            return (TileSpan(lo, hi, True),)
        if self.right is None:
            full_lo = lo
        else:
            first_row = first + block_k - 1 - self.offset - self.right
            full_lo = _clip(_cdiv(jnp.maximum(first_row, 0), block_q), lo, hi)
        if self.left is None:
            full_hi = hi
        else:
            full_hi = lax.div(jnp.maximum(first + self.left - self.offset + 1, 0), block_q)
        full_hi = _clip(full_hi, full_lo, hi)
        ragged_kv = self.kv_len % block_k != 0
        if ragged_kv:
            partial = first + block_k > self.kv_len
            full_lo = jnp.where(partial, hi, full_lo)
            full_hi = jnp.where(partial, hi, full_hi)
        spans = []
        if self.right is not None or ragged_kv:
            spans.append(TileSpan(lo, full_lo, True))
        spans.append(TileSpan(full_lo, full_hi, False))
        if self.left is not None:
            spans.append(TileSpan(full_hi, hi, True))
        return tuple(spans)
