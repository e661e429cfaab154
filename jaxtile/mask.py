"""The attention mask, described once.

Every implementation asks this module two questions and nothing else about masking:

* element-wise, inside a tile: is key ``j`` visible to query ``i``?
  (:meth:`MaskSpec.visible`)
* tile-wise: which key tiles can query tile ``t`` see at all, and which of those need
  the element-wise mask? (:meth:`MaskSpec.kv_spans`; :meth:`MaskSpec.q_spans` answers
  the transposed question for backward passes that loop over query tiles.)

Positions and windows answer the tile-wise question from indices alone. Segment ids,
a dense mask and per-sequence lengths are runtime arrays: :meth:`MaskSpec.tile_bounds`
reduces them, in XLA before the loops run, to per-tile bounds that the span functions
intersect with the positional ones, so packed documents, padding and partly filled
caches skip the tiles they hide too. Where lengths are the only runtime part, a kernel
can form a tile's bounds itself from its sequence's two lengths
(:meth:`MaskSpec.length_bounds`, the same bounds in closed form). The API asks one more question before choosing a
call: is a dense mask really a causal mask with padding (:meth:`MaskSpec.recognise`)?

Positions are bottom-right aligned, as in flash-attn and cuDNN: query row ``i`` sits at
position ``i + kv_len - q_len`` and key column ``j`` at position ``j``. With per-sequence
lengths (``q_lengths``, ``kv_lengths``: rows and keys past them are padding) the
alignment is to each sequence's own lengths, ``i + kv_lengths[b] - q_lengths[b]``, so a
decode step sits at the end of its own cache. Key ``j`` is visible to query ``i`` iff
both are in bounds (and within the lengths) and

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
import numpy as np
from jax import lax


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative Python ints (static sizes)."""
    return -(-a // b)


def _tile_div(a, b: int):
    """Floor division of a non-negative tile index or position (an int, NumPy or traced
    integer) by a positive int, as an int32 array: span bounds keep one type on every
    path, with 64-bit integers enabled too."""
    return lax.div(jnp.asarray(a, jnp.int32), np.int32(b))


def _tile_cdiv(a, b: int):
    """Ceiling division as `_tile_div`."""
    return _tile_div(a + (b - 1), b)


def _same_rank(a, b, op):
    """``op(a, b)`` with the lower-rank operand given leading unit dims first (explicit,
    so strict rank promotion accepts it)."""
    rank = max(jnp.ndim(a), jnp.ndim(b))
    a, b = (jnp.reshape(x, (1,) * (rank - jnp.ndim(x)) + jnp.shape(x)) for x in (a, b))
    return op(a, b)


def _clip(x, lo, hi):
    return jnp.minimum(jnp.maximum(x, lo), hi)


class TileSpan(NamedTuple):
    """Tiles ``start <= t < stop`` of one loop; ``masked`` (static) says whether the
    element-wise mask must be applied to them."""

    start: jnp.ndarray | int
    stop: jnp.ndarray | int
    masked: bool

    def within(self, lo, hi) -> TileSpan:
        """The tiles of this span in ``[lo, hi)`` (one split of a loop)."""
        return TileSpan(_clip(self.start, lo, hi), _clip(self.stop, lo, hi), self.masked)


class TileBounds(NamedTuple):
    """The tiles ``lo <= t < hi`` of one loop that can hold a visible pair; of those,
    ``full_lo <= t < full_hi`` need no element-wise mask (``lo <= full_lo <= full_hi
    <= hi``). Python ints, NumPy arrays or traced int32 scalars."""

    lo: jnp.ndarray | int
    full_lo: jnp.ndarray | int
    full_hi: jnp.ndarray | int
    hi: jnp.ndarray | int

    def intersect(self, other: TileBounds) -> TileBounds:
        """Tiles both bounds visit; unmasked only where both say so."""
        lo = jnp.maximum(self.lo, other.lo)
        hi = jnp.maximum(jnp.minimum(self.hi, other.hi), lo)
        full_lo = _clip(jnp.maximum(self.full_lo, other.full_lo), lo, hi)
        full_hi = _clip(jnp.minimum(self.full_hi, other.full_hi), full_lo, hi)
        return TileBounds(lo, full_lo, full_hi, hi)

    def spans(self, *, head: bool = True, interior: bool = True, tail: bool = True) -> tuple[TileSpan, ...]:
        """The masked head ``[lo, full_lo)``, the interior ``[full_lo, full_hi)`` and the
        masked tail ``[full_hi, hi)``; a span known statically to be empty is left out."""
        spans = []
        if head:
            spans.append(TileSpan(self.lo, self.full_lo, True))
        if interior:
            spans.append(TileSpan(self.full_lo, self.full_hi, False))
        if tail:
            spans.append(TileSpan(self.full_hi, self.hi, True))
        return tuple(spans)


# Tile classes of `MaskSpec._tile_classes`.
_SKIP, _MASKED, _FULL = 0, 1, 2


def _bounds_from_classes(classes) -> jnp.ndarray:
    """Per outer tile, the `TileBounds` of its inner loop, from tile classes ``[...,
    n_outer, n_inner]``: ``[..., n_outer, 4]`` int32 ``(lo, full_lo, full_hi, hi)``. The
    interior is the first run of `_FULL` tiles; later `_FULL` tiles are visited masked."""
    n = classes.shape[-1]
    index = jnp.arange(n, dtype=jnp.int32)
    seen = classes != _SKIP
    full = classes == _FULL

    def first(x, default):
        return jnp.where(jnp.any(x, axis=-1), jnp.argmax(x, axis=-1).astype(jnp.int32), default)

    lo = first(seen, 0)
    hi = jnp.where(jnp.any(seen, axis=-1), n - jnp.argmax(seen[..., ::-1], axis=-1).astype(jnp.int32), 0)
    full_lo = first(full, lo)
    full_hi = first(_same_rank(index, full_lo[..., None], jnp.greater_equal) & ~full, n)
    full_lo = _clip(full_lo, lo, hi)
    return jnp.stack([lo, full_lo, _clip(full_hi, full_lo, hi), hi], axis=-1)


def uniform_bounds(bounds, axis: int | None = None) -> jnp.ndarray:
    """Bounds ``[..., n_outer, 4]`` that hold for every index of leading ``axis`` at once
    (None: of every leading axis; for loops that process several batch elements or heads
    together): the union of the visited tiles, the intersection of the interiors."""
    lead = tuple(range(bounds.ndim - 2)) if axis is None else axis
    lo = jnp.min(bounds[..., 0], axis=lead)
    hi = jnp.max(bounds[..., 3], axis=lead)
    full_lo = _clip(jnp.max(bounds[..., 1], axis=lead), lo, hi)
    full_hi = _clip(jnp.min(bounds[..., 2], axis=lead), full_lo, hi)
    return jnp.stack([lo, full_lo, full_hi, hi], axis=-1)


def bounds_at(bounds, tile, b, h=0):
    """Tile ``tile``'s ``(lo, full_lo, full_hi, hi)`` in batch element ``b`` and head ``h``
    from `MaskSpec.tile_bounds`' ``[1|batch, 1|heads, tiles, 4]`` (an array, or a kernel's
    ref; None: None)."""
    if bounds is None:
        return None
    b = b if bounds.shape[0] > 1 else 0
    h = h if bounds.shape[1] > 1 else 0
    return tuple(bounds[b, h, tile, i] for i in range(4))


def _first_tile(index, n: int, block: int):
    """The tile of ``block`` that holds ``index`` (clipped to 0), or the number of tiles
    when ``index`` is past ``n``: the first tile a span visits from there."""
    return jnp.where(index >= n, _tile_cdiv(n, block), _tile_div(_clip(index, 0, n), block))


def _segment_range(ids, block: int):
    """Per tile of ``ids [batch, len]``: the smallest and largest id, ``[batch, tiles]``."""
    n = ids.shape[1]
    pad = -n % block
    info = jnp.iinfo(jnp.int32)
    lo = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=info.max).reshape(ids.shape[0], -1, block)
    hi = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=info.min).reshape(ids.shape[0], -1, block)
    return jnp.min(lo, axis=-1), jnp.max(hi, axis=-1)


def _dense_tiles(dense, block: int, axis: int, fill: bool, reduce):
    """``reduce`` (``jnp.any``/``jnp.all``) of ``dense`` over tiles of ``block`` along
    ``axis`` (left as is where that axis broadcasts), padding with ``fill``."""
    n = dense.shape[axis]
    if n == 1:
        return dense
    pad = [(0, 0)] * dense.ndim
    pad[axis] = (0, -n % block)
    tiles = jnp.pad(dense, pad, constant_values=fill)
    shape = (*tiles.shape[:axis], tiles.shape[axis] // block, block, *tiles.shape[axis + 1 :])
    return reduce(tiles.reshape(shape), axis=axis + 1)


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
      has_lengths: per-sequence query and key lengths apply (runtime ``[batch, 2]``
        int32 ``(q_length, kv_length)``, each within ``[0, q_len]``/``[0, kv_len]``);
        bottom-right positions are aligned to them.
      top_left: query row ``i`` has position ``i`` (``jax.nn.dot_product_attention``'s
        alignment) instead of ``i + kv_len - q_len`` (bottom-right, flash-attn's and
        cuDNN's; with lengths, ``i + kv_length - q_length`` per sequence). Key ``j``
        has position ``j`` either way.
      every_tile: the span functions visit every tile, masked, with static bounds: the
        loops of a pass become ones JAX can differentiate in reverse mode (what its
        second derivatives need), at the cost of the tiles the mask would skip.
    """

    q_len: int
    kv_len: int
    left: int | None = None
    right: int | None = None
    has_segments: bool = False
    has_dense_mask: bool = False
    has_lengths: bool = False
    top_left: bool = False
    every_tile: bool = False

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
        has_lengths: bool = False,
        top_left: bool = False,
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
        return cls(q_len, kv_len, left, right, has_segments, has_dense_mask, has_lengths, top_left)

    @property
    def offset(self) -> int:
        """Position of query row 0: ``kv_len - q_len`` (bottom-right), or 0 (`top_left`)."""
        return 0 if self.top_left else self.kv_len - self.q_len

    @property
    def is_structured(self) -> bool:
        """True when tiles can be classified from indices alone (no runtime mask)."""
        return not (self.has_segments or self.has_dense_mask or self.has_lengths)

    @property
    def sees_every_key(self) -> bool:
        """True when nothing bounds the keys a query row sees (no causal mask, window,
        lengths, segment ids or dense mask): every row sees every key."""
        return self.is_structured and self.left is None and self.right is None

    @property
    def masks_elements(self) -> bool:
        """True when a runtime array decides single elements (segment ids or a dense
        mask), not only where each row's keys start and stop (lengths)."""
        return self.has_segments or self.has_dense_mask

    @property
    def heaviest_last(self) -> bool:
        """True when the mask bounds keys on the right (causal masks, windows with a right
        side): each query row then sees at least as many keys as the rows before it, until
        a left bound caps them, so kernels launch the query tiles last to first and the
        short ones start last (with no right bound, the first rows see the most)."""
        return self.right is not None

    @property
    def bounds_from_lengths(self) -> bool:
        """True when lengths are the mask's only runtime part: a kernel can form a tile's
        bounds from its sequence's two lengths (`length_bounds`) instead of reading
        `tile_bounds`' array."""
        return self.has_lengths and not (self.masks_elements or self.every_tile)

    def visible(self, q_idx, kv_idx, *, q_segment=None, kv_segment=None, dense=None, lengths=None, check_bounds=True):
        """Element-wise visibility; arguments broadcast against each other.

        Args:
          q_idx: query row indices, e.g. ``[block_q, 1]``.
          kv_idx: key column indices, e.g. ``[1, block_k]``.
          q_segment, kv_segment: segment ids, shaped to broadcast like the indices;
            required iff ``has_segments``.
          dense: the boolean mask tile; required iff ``has_dense_mask``.
          lengths: ``(q_length, kv_length)``, shaped to broadcast like the indices;
            required iff ``has_lengths`` (they replace the bounds check).
          check_bounds: also hide indices past ``q_len``/``kv_len``; a kernel whose
            tiles never reach past the key sequence may skip it.
        Returns:
          bool array of the broadcast shape.
        """
        q_idx, kv_idx = jnp.asarray(q_idx, jnp.int32), jnp.asarray(kv_idx, jnp.int32)
        if self.has_lengths:
            q_length, kv_length = lengths
            pos = q_idx if self.top_left else _same_rank(q_idx, kv_length - q_length, jnp.add)
            terms = [_same_rank(q_idx, q_length, jnp.less), _same_rank(kv_idx, kv_length, jnp.less)]
        else:
            pos = q_idx + self.offset
            terms = [(q_idx < self.q_len) & (kv_idx < self.kv_len)] if check_bounds else []
        if self.left is not None:
            terms.append(_same_rank(kv_idx, pos - self.left, jnp.greater_equal))
        if self.right is not None:
            terms.append(_same_rank(kv_idx, pos + self.right, jnp.less_equal))
        if self.has_segments:
            terms.append(_same_rank(q_segment, kv_segment, jnp.equal))
        if self.has_dense_mask:
            terms.append(dense)
        if not terms:
            return jnp.ones(jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(kv_idx)), jnp.bool_)
        ok = terms[0]
        for term in terms[1:]:
            ok = _same_rank(ok, term, jnp.logical_and)
        return ok

    def _tile_classes(
        self, block_q: int, block_k: int, *, q_segment_ids=None, kv_segment_ids=None, dense=None, lengths=None
    ):
        """Classes of every (query tile, key tile) pair from the runtime parts of the mask
        alone: `_SKIP` where no pair can be visible, `_FULL` where every pair of the tile is
        (before positions and windows, or, with lengths, after them), `_MASKED` otherwise.

        Args:
          q_segment_ids, kv_segment_ids: ``[batch, q_len]``, ``[batch, kv_len]`` int32,
            required iff ``has_segments``. Sorted or not: tiles whose id ranges do not
            overlap are skipped.
          dense: bool ``[1|batch, 1|heads, 1|q_len, 1|kv_len]``, required iff
            ``has_dense_mask``.
          lengths: ``[batch, 2]`` int32, required iff ``has_lengths``.
        Returns:
          ``[1|batch, 1|heads, n_q_tiles, n_kv_tiles]`` int32.
        """
        n_q, n_kv = cdiv(self.q_len, block_q), cdiv(self.kv_len, block_k)
        classes = jnp.full((1, 1, n_q, n_kv), _FULL, jnp.int32)
        if self.has_lengths:
            classes = self._length_classes(block_q, block_k, lengths)
        if self.has_segments:
            q_lo, q_hi = _segment_range(q_segment_ids, block_q)
            k_lo, k_hi = _segment_range(kv_segment_ids, block_k)
            q_lo, q_hi, k_lo, k_hi = q_lo[:, :, None], q_hi[:, :, None], k_lo[:, None, :], k_hi[:, None, :]
            apart = (q_hi < k_lo) | (k_hi < q_lo)
            same = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
            classes = jnp.minimum(classes, jnp.where(apart, _SKIP, jnp.where(same, _FULL, _MASKED))[:, None])
        if self.has_dense_mask:
            seen = _dense_tiles(_dense_tiles(dense, block_q, 2, False, jnp.any), block_k, 3, False, jnp.any)
            whole = _dense_tiles(_dense_tiles(dense, block_q, 2, True, jnp.all), block_k, 3, True, jnp.all)
            classes = jnp.minimum(classes, jnp.where(seen, jnp.where(whole, _FULL, _MASKED), _SKIP))
        return jnp.broadcast_to(classes, (*classes.shape[:2], n_q, n_kv))

    def _length_classes(self, block_q: int, block_k: int, lengths):
        """`_tile_classes` of the lengths with the positions and windows they align,
        ``[batch, 1, n_q_tiles, n_kv_tiles]``, from `length_bounds`: the tiles a query
        tile sees, and the tiles it sees whole, are each one run of key tiles."""
        bounds = self._length_bounds(block_q, block_k, lengths, False)
        lo, full_lo, full_hi, hi = (bounds[..., i, None] for i in range(4))
        inner = jnp.arange(cdiv(self.kv_len, block_k), dtype=jnp.int32).reshape(1, 1, 1, -1)
        full = (full_lo <= inner) & (inner < full_hi)
        return jnp.where((lo <= inner) & (inner < hi), jnp.where(full, _FULL, _MASKED), _SKIP)

    def _length_bounds(self, block_q: int, block_k: int, lengths, transposed: bool):
        """`length_bounds` of every tile of every sequence, from ``lengths [batch, 2]``:
        ``[batch, 1, n_tiles, 4]`` int32."""
        n = cdiv(self.kv_len, block_k) if transposed else cdiv(self.q_len, block_q)
        tiles = jnp.arange(n, dtype=jnp.int32)[None]
        bounds = self.length_bounds(tiles, block_q, block_k, lengths[:, :1], lengths[:, 1:], transposed=transposed)
        return jnp.stack(jnp.broadcast_arrays(*bounds), axis=-1)[:, None]

    def length_bounds(self, tile, block_q: int, block_k: int, q_length, kv_length, *, transposed: bool = False):
        """`TileBounds` of the lengths with the positions and windows they align, for
        one tile of one sequence, from its ``q_length`` and ``kv_length`` (int32 scalars,
        or arrays of ``tile``'s rank to broadcast with it): the key tiles of query tile ``tile``, or with
        ``transposed`` the query tiles of key tile ``tile``. A tile is visited if one of
        its pairs is visible, and unmasked only if every key of it (past the end of the
        keys too: interior tiles are loaded unmasked) and every row up to ``q_len`` (rows
        past it are never stored, and contribute nothing to dK, dV) is within the lengths
        and the window. In closed form, so that a kernel forms them where it needs them;
        `tile_bounds` and `_tile_classes` derive theirs from it."""
        zero = np.int32(0)  # not 0: from Python ints Pallas built an ill-typed arith.maxsi (i32, i1) in Triton
        offset = 0 if self.top_left else kv_length - q_length
        left, right = self.left, self.right
        if transposed:
            n, first = np.int32(cdiv(self.q_len, block_q)), tile * block_k
            end = first + block_k - 1
            last = jnp.minimum(end, kv_length - 1)
            # Rows i * block_q ... that see key `first` (right) and `last` (left).
            seen = first < kv_length
            lo, hi = zero, _tile_cdiv(q_length, block_q)
            if right is not None:
                reach = first - offset - right  # the first row whose window reaches key `first`
                seen &= q_length - 1 >= reach
                lo = _tile_div(jnp.maximum(reach, 0), block_q)
            if left is not None:
                reach = last - offset + left  # the last row whose window reaches key `last`
                seen &= reach >= 0
                hi = jnp.minimum(hi, _tile_div(jnp.maximum(reach, 0), block_q) + 1)
            # Tiles whose every row (up to q_len) is within q_length and sees the whole tile.
            whole = end < kv_length
            full_lo = zero if right is None else _tile_cdiv(jnp.maximum(end - offset - right, 0), block_q)
            full_hi = jnp.where(q_length >= self.q_len, n, _tile_div(q_length, block_q))
            if left is not None:
                reach = first - offset + left + 1
                limit = jnp.where(self.q_len <= reach, n, _tile_div(jnp.maximum(reach, 0), block_q))
                full_hi = jnp.minimum(full_hi, limit)
        else:
            first = tile * block_q
            end = jnp.minimum(first + block_q, self.q_len) - 1
            last = jnp.minimum(end, q_length - 1)
            seen = first < q_length
            lo, hi = zero, _tile_cdiv(kv_length, block_k)
            if left is not None:
                reach = first + offset - left  # the first key row `first` sees
                seen &= kv_length - 1 >= reach
                lo = _tile_div(jnp.maximum(reach, 0), block_k)
            if right is not None:
                reach = last + offset + right  # the last key row `last` sees
                seen &= reach >= 0
                hi = jnp.minimum(hi, _tile_div(jnp.maximum(reach, 0), block_k) + 1)
            whole = end < q_length
            full_lo = zero if left is None else _tile_cdiv(jnp.maximum(end + offset - left, 0), block_k)
            full_hi = _tile_div(kv_length, block_k)
            if right is not None:
                full_hi = jnp.minimum(full_hi, _tile_div(jnp.maximum(first + offset + right + 1, 0), block_k))
        seen &= lo < hi
        lo, hi = jnp.where(seen, lo, zero), jnp.where(seen, hi, zero)
        whole &= full_lo < full_hi
        full_lo = jnp.where(whole, _clip(full_lo, lo, hi), lo)
        full_hi = jnp.where(whole, _clip(full_hi, full_lo, hi), full_lo)
        return TileBounds(lo, full_lo, full_hi, hi)

    def tile_bounds(self, block_q: int, block_k: int, *, transposed: bool = False, **runtime):
        """Per-tile bounds of the runtime mask (`_tile_classes`'s arguments), for the span
        functions: ``[1|batch, 1|heads, n_q_tiles, 4]`` for `kv_spans`, or with
        ``transposed`` ``[..., n_kv_tiles, 4]`` for `q_spans`; None if the mask has no
        runtime part (or `every_tile` visits them all)."""
        if self.is_structured or self.every_tile:
            return None
        if self.bounds_from_lengths:
            return self._length_bounds(block_q, block_k, runtime["lengths"], transposed)
        classes = self._tile_classes(block_q, block_k, **runtime)
        return _bounds_from_classes(jnp.swapaxes(classes, -1, -2) if transposed else classes)

    def recognisable(self) -> bool:
        """Whether `recognise` can read this spec's dense mask as a structured one: a dense
        mask and no other runtime part (segment ids or lengths)."""
        return self.has_dense_mask and not (self.has_segments or self.has_lengths or self.every_tile)

    def recognised(self, padded: bool = True) -> MaskSpec:
        """What a dense mask that `recognise` accepts becomes: this spec made causal, with
        per-sequence lengths in place of the dense mask (none if not ``padded``: lengths
        that are the whole sequences change nothing)."""
        return dataclasses.replace(self, right=0, has_dense_mask=False, has_lengths=padded)

    def recognise(self, dense):
        """Reads ``dense`` as the mask Flax builds (``make_causal_mask`` combined with
        ``make_attention_mask`` of padding): a causal mask within per-sequence lengths,
        `recognised`. For `recognisable` specs.

        The lengths are one past the last row and the last key that anything sees, so
        whenever some lengths give the same visible pairs, these do.

        Args:
          dense: bool ``[1|batch, 1|heads, 1|q_len, 1|kv_len]``.
        Returns:
          ``(lengths, same)``: ``[1|batch, 2]`` int32 ``(q_length, kv_length)``, and a bool
          scalar, True iff `recognised` with ``lengths`` shows exactly the pairs this
          spec with ``dense`` shows.
        """
        q_idx = jnp.arange(self.q_len, dtype=jnp.int32)[:, None]
        kv_idx = jnp.arange(self.kv_len, dtype=jnp.int32)[None, :]
        seen = jnp.broadcast_to(self.visible(q_idx, kv_idx, dense=dense), (*dense.shape[:2], self.q_len, self.kv_len))

        def extent(used):  # one past the last True of ``used [1|batch, n]``
            n = used.shape[-1]
            return jnp.where(jnp.any(used, axis=-1), n - jnp.argmax(used[:, ::-1], axis=-1), 0).astype(jnp.int32)

        q_length, kv_length = extent(jnp.any(seen, axis=(1, 3))), extent(jnp.any(seen, axis=(1, 2)))
        lengths = (q_length[:, None, None, None], kv_length[:, None, None, None])
        same = jnp.all(seen == self.recognised().visible(q_idx, kv_idx, lengths=lengths))
        return jnp.stack([q_length, kv_length], axis=-1), same

    def kv_spans(self, q_tile, block_q: int, block_k: int, bounds=None) -> tuple[TileSpan, ...]:
        """Key tiles that query tile ``q_tile`` must visit, in increasing order.

        Tiles outside the spans hold no visible key for any row of the query tile.
        Spans with ``masked=False`` are interior: every key of the tile is in bounds and
        inside the window for every row (and, given ``bounds``, in the row's segment and
        the dense mask), so no element-wise mask is needed there.

        Args:
          bounds: this query tile's ``(lo, full_lo, full_hi, hi)`` from `tile_bounds`;
            without it a mask with runtime parts visits every tile its positions allow,
            masked.
        """
        if self.every_tile:
            return (TileSpan(0, cdiv(self.kv_len, block_k), True),)
        if self.has_lengths:
            # Positions are aligned per sequence: the runtime bounds hold them. (A tile
            # is interior only if it holds block_k keys.) Every row that sees a key sees
            # key 0 unless a left window hides it, so without one the interior starts
            # the visited tiles.
            n = cdiv(self.kv_len, block_k)
            head = self.left is not None
            return self._spans(TileBounds(0, 0, n, n), bounds, head=head, interior=self.kv_len >= block_k, tail=True)
        n_kv = self.kv_len
        first = q_tile * block_q + self.offset
        last = jnp.minimum(q_tile * block_q + block_q, self.q_len) - 1 + self.offset
        lo = 0 if self.left is None else _first_tile(first - self.left, n_kv, block_k)
        if self.right is None:
            hi = _tile_cdiv(n_kv, block_k)
        else:
            hi = _tile_cdiv(_clip(last + self.right + 1, 0, n_kv), block_k)
        lo = jnp.minimum(lo, hi)
        if self.left is None:
            full_lo = lo
        else:
            last_unclipped = q_tile * block_q + block_q - 1 + self.offset
            full_lo = _clip(_tile_cdiv(jnp.maximum(last_unclipped - self.left, 0), block_k), lo, hi)
        if self.right is None:
            full_hi = n_kv // block_k
        else:
            full_hi = _tile_div(_clip(first + self.right + 1, 0, n_kv), block_k)
        positional = TileBounds(lo, full_lo, _clip(full_hi, full_lo, hi), hi)
        return self._spans(
            positional,
            bounds,
            head=self.left is not None,
            interior=n_kv >= block_k,
            tail=self.right is not None or n_kv % block_k != 0,
        )

    def q_spans(self, kv_tile, block_q: int, block_k: int, bounds=None) -> tuple[TileSpan, ...]:
        """Query tiles that can see key tile ``kv_tile``; the transpose of `kv_spans`
        (``bounds`` from `tile_bounds` with ``transposed=True``).

        A (query tile, key tile) pair is interior here iff it is interior there. Query
        rows past ``q_len`` are not masked in interior tiles: callers load them as zeros
        with an lse of +inf, so they contribute nothing.
        """
        if self.every_tile:
            return (TileSpan(0, cdiv(self.q_len, block_q), True),)
        if self.has_lengths:
            # Every key that a row sees, the rows before it see too unless the right
            # side of the window hides it from them (as `kv_spans` for key 0).
            n = cdiv(self.q_len, block_q)
            return self._spans(TileBounds(0, 0, n, n), bounds, head=self.right is not None, interior=True, tail=True)
        n_q = self.q_len
        first = kv_tile * block_k
        last = jnp.minimum(first + block_k, self.kv_len) - 1
        lo = 0 if self.right is None else _first_tile(first - self.right - self.offset, n_q, block_q)
        if self.left is None:
            hi = _tile_cdiv(n_q, block_q)
        else:
            hi = _tile_cdiv(_clip(last + self.left - self.offset + 1, 0, n_q), block_q)
        lo = jnp.minimum(lo, hi)
        if self.right is None:
            full_lo = lo
        else:
            first_row = first + block_k - 1 - self.offset - self.right
            full_lo = _clip(_tile_cdiv(jnp.maximum(first_row, 0), block_q), lo, hi)
        if self.left is None:
            full_hi = hi
        else:
            full_hi = _tile_div(jnp.maximum(first + self.left - self.offset + 1, 0), block_q)
        full_hi = _clip(full_hi, full_lo, hi)
        ragged_kv = self.kv_len % block_k != 0
        if ragged_kv:
            partial = first + block_k > self.kv_len
            full_lo = jnp.where(partial, hi, full_lo)
            full_hi = jnp.where(partial, hi, full_hi)
        positional = TileBounds(lo, full_lo, full_hi, hi)
        return self._spans(
            positional, bounds, head=self.right is not None or ragged_kv, interior=True, tail=self.left is not None
        )

    def _spans(self, positional: TileBounds, bounds, *, head: bool, interior: bool, tail: bool):
        """The spans of ``positional`` intersected with the runtime ``bounds``; without
        bounds, one masked span for a mask with runtime parts, else the spans that can be
        non-empty. ``head``, ``interior`` and ``tail`` (static) say which spans the
        positions (and lengths) can make non-empty; segment ids and a dense mask can make
        both masked spans non-empty anywhere. (A span left out is a loop less in a
        kernel: on an H100 that took the forward kernel with lengths from 1.10 to 1.02 ms
        at 4×4096×32×64.)"""
        if bounds is not None:
            anywhere = self.has_segments or self.has_dense_mask
            spans = dict(head=head or anywhere, interior=interior, tail=tail or anywhere)
            return positional.intersect(TileBounds(*bounds)).spans(**spans)
        if not self.is_structured:
            return (TileSpan(positional.lo, positional.hi, True),)
        return positional.spans(head=head, interior=interior, tail=tail)
