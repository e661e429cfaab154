"""What every jaxtile Pallas kernel shares: shapes, tiles and what they cost in shared
memory, tiles in and out of HBM, the runtime part of the mask, masked products, and the
launch.

Kernels see whole arrays (``[batch, len, heads, dim]``, head dim padded to a power of two)
and index them by program id, so one kernel serves every batch element, head and tile
of a 1-D grid (``jax.vmap`` adds grid dimensions; Triton allows three). Tiles past the
end of a sequence or past the head dim are loaded as zeros by masked loads and never
stored; the mask description decides which tiles are visited at all.

A query tile may hold the rows of several query heads that share one kv head (``pack``
heads, GQA packing as in FlashAttention-3): its ``block_q`` rows are ``block_q / pack``
positions times ``pack`` heads, row ``r`` being position ``r // pack`` of head
``r % pack``, so that each key/value tile is loaded once for all of them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxtile import _softmax as sm
from jaxtile._core import HOPPER_SHARED_MEMORY, HOPPER_SMS, Config, Inputs, Shape, bias_grad_dtype
from jaxtile._softmax import Logits
from jaxtile.mask import MaskSpec, bounds_at, cdiv
from jaxtile.triton.tuning import KernelTuning

MIN_BLOCK = 16  # the smallest tile Triton's dot accepts
MAX_HEAD_DIM = 256  # the largest head dim whose tiles fit (`Tiles.fit`)


def next_pow2(n: int) -> int:
    return max(MIN_BLOCK, 1 << (n - 1).bit_length())


def _pow2_factor(n: int) -> int:
    """The largest power of two dividing ``n``."""
    return n & -n


# Shared memory per thread block that a kernel may ask for, by compute capability (CUDA's
# opt-in maximum); Hopper's where the device is unknown (interpret mode lowers for it).
_SHARED_MEMORY = {(8, 0): 166912, (8, 7): 166912, (9, 0): HOPPER_SHARED_MEMORY, (10, 0): HOPPER_SHARED_MEMORY}
_SHARED_MEMORY_OTHER = 101376  # sm_86, sm_89, sm_120


def shared_memory_limit(platform: str) -> int:
    """Bytes of shared memory one program may use on this process's first GPU."""
    if platform != "gpu":
        return HOPPER_SHARED_MEMORY
    capability = getattr(jax.devices("gpu")[0], "compute_capability", "9.0")
    major, minor = (int(x) for x in str(capability).split("."))
    return _SHARED_MEMORY.get((major, minor), _SHARED_MEMORY_OTHER)


def sm_count(platform: str) -> int:
    """Streaming multiprocessors of this process's first GPU (Hopper's off the GPU)."""
    if platform != "gpu":
        return HOPPER_SMS
    return int(getattr(jax.devices("gpu")[0], "core_count", 0) or HOPPER_SMS)


_SCRATCH = 2048


@dataclasses.dataclass(frozen=True)
class Staging:
    """What a kernel keeps in shared memory, as tile shapes in rows × columns of the input
    dtype: ``resident`` tiles are loaded once per program, ``streamed`` ones once per
    step of the pipelined loop (``num_stages`` copies in flight), and ``staged``
    intermediates (a float32 tile rounded for a second product, a transpose) once.

    Each entry is ``(rows, cols)`` with symbolic sizes: ``"q"`` (``block_q``), ``"k"``
    (``block_k``), ``"d"`` (padded head dim of q and k), ``"v"`` (padded head dim of v).
    ``copies``: sets of streamed buffers the compiler keeps (XLA's Triton gave loops
    nested two deep, in FlashAttention-1's backward, a set each). ``split_float32``: in
    float32, the three-pass TF32 products also keep a low part of the resident tiles and
    of one stage of the streamed ones (XLA asked 256 KiB for FlashAttention-2's forward at
    128×128 tiles, head dim 64, two stages, where these tiles alone are 160 KiB).
    ``dense_mask``: a ``block_q × block_k`` tile of the dense mask (a byte an element)
    streams with the others (XLA asked 256 KiB for FlashAttention-2's forward with a
    dense mask at 128×128 tiles, head dim 128, three stages, where the model without it
    said 226 KiB; `Kernel.create` sets it for calls that have one).
    """

    resident: tuple[tuple[str, str], ...]
    streamed: tuple[tuple[str, str], ...]
    staged: tuple[tuple[str, str], ...] = ()
    copies: int = 1
    split_float32: bool = False
    dense_mask: bool = False

    def bytes(self, block_q: int, block_k: int, shape: Shape, itemsize: int, num_stages: int) -> int:
        """Modelled shared memory of one program: the tiles, plus `_SCRATCH` for the
        mask's and the statistics' small loads."""
        size = {"q": block_q, "k": block_k, "d": next_pow2(shape.head_dim), "v": next_pow2(shape.head_dim_v)}

        def total(tiles):
            return sum(size[r] * size[c] for r, c in tiles) * itemsize

        mask = block_q * block_k if self.dense_mask else 0
        streamed = self.copies * max(num_stages, 1) * (total(self.streamed) + mask)
        split = total(self.resident) + total(self.streamed) if self.split_float32 and itemsize == 4 else 0
        return total(self.resident) + streamed + split + total(self.staged) + _SCRATCH


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The tile shape of one kernel: ``block_q`` query rows (``pack`` heads of
    ``positions`` each) by ``block_k`` key columns, and the pipeline depth."""

    block_q: int
    block_k: int
    num_stages: int
    pack: int = 1

    @property
    def positions(self) -> int:
        """Query positions per tile (each with ``pack`` rows)."""
        return self.block_q // self.pack

    @classmethod
    def fit(
        cls,
        tuning: KernelTuning,
        dims: Shape,
        dtype,
        staging: Staging,
        limit: int,
        *,
        packable: bool = False,
    ) -> Tiles:
        """The tuned (or requested) tiles and stages, shortened to the sequences and then
        shrunk until `Staging.bytes` fits in ``limit``: stages first (down to 2), then the
        longer tile side, halving (never below 16).

        With ``packable``, queries too short to fill a tile share it with other heads
        of their GQA group (up to the largest power of two dividing the group): a decode
        step with one query fills a tile with its heads and reads each key/value tile
        once for all of them. Longer queries keep one head per tile, where packing
        measured slower on an H200 (GQA 32:8 at 8K: 6% forward) and saves no loads
        (every tile of ``block_q`` rows still reads each key/value tile once).
        """
        rows = tuning.block_q
        q_len_p = 1 << (dims.q_len - 1).bit_length()
        pack = min(_pow2_factor(dims.group), max(rows // q_len_p, 1)) if packable else 1
        block_q = max(MIN_BLOCK, min(rows, pack * q_len_p))
        block_k = min(tuning.block_k, next_pow2(dims.kv_len))
        stages = tuning.num_stages
        itemsize = jnp.dtype(dtype).itemsize

        def size(bq, bk, stages):
            return staging.bytes(bq, bk, dims, itemsize, stages)

        if size(max(MIN_BLOCK, pack), MIN_BLOCK, 1) > limit:
            raise NotImplementedError(
                f"the smallest tiles of this Pallas kernel need {size(max(MIN_BLOCK, pack), MIN_BLOCK, 1)} bytes of "
                f"shared memory, more than this GPU's {limit} ({dims.head_dim=}, {dims.head_dim_v=}, "
                f"{jnp.dtype(dtype).name}); use implementation='scan_v2'"
            )
        while size(block_q, block_k, stages) > limit:
            if stages > 2:
                stages -= 1
                continue
            can_q, can_k = block_q > max(MIN_BLOCK, pack), block_k > MIN_BLOCK
            if not (can_q or can_k):
                stages = 1
                continue
            # Halve the side that frees more (K/V tiles when they are pipelined).
            if can_q and (not can_k or size(block_q // 2, block_k, stages) <= size(block_q, block_k // 2, stages)):
                block_q //= 2
            else:
                block_k //= 2
        return cls(block_q, block_k, stages, pack)

    def num_q_tiles(self, dims: Shape) -> int:
        return cdiv(dims.q_len, self.positions)

    def num_kv_tiles(self, dims: Shape) -> int:
        return cdiv(dims.kv_len, self.block_k)


def program_ids(num_tiles: int, num_heads: int, heaviest_first: bool):
    """``(tile, batch, head)`` of this program in a 1-D grid of ``tiles * batch * heads``.

    Consecutive programs share a head (and so its K/V in L2). With ``heaviest_first``
    the tiles run in reverse, so the longest causal rows start first.
    """
    pid = pl.program_id(0)
    num_tiles, num_heads = np.int32(num_tiles), np.int32(num_heads)
    tile = lax.rem(pid, num_tiles)
    bh = lax.div(pid, num_tiles)
    if heaviest_first:
        tile = num_tiles - 1 - tile
    return tile, lax.div(bh, num_heads), lax.rem(bh, num_heads)


def fori_loop(lower, upper, body, carry):
    """``lax.fori_loop`` whose body sees an int32 index, ``jax_enable_x64`` or not (static
    bounds count in Python ints, int64 under x64, which refs refuse next to int32)."""
    return lax.fori_loop(lower, upper, lambda i, c: body(lax.convert_element_type(i, jnp.int32), c), carry)


def _iota(n: int):
    return lax.broadcasted_iota(jnp.int32, (n,), 0)


def _in_dims(dim_p: int, dim: int):
    """``[1, dim_p]`` True for the columns of a padded head dim that exist, or None."""
    return None if dim == dim_p else (_iota(dim_p) < dim)[None, :]


def _columns(dim_p: int):
    """All ``dim_p`` columns of a ref, as an index (a ``:`` is discharged with a 64-bit
    start under ``jax_enable_x64`` in interpret mode, which masked stores refuse)."""
    return pl.ds(np.int32(0), dim_p)


def _and(a, b):
    return b if a is None else a if b is None else a & b


def load_tile(ref, b, h, start, block: int, length: int, dim: int, *, ragged: bool):
    """``ref[b, start:start+block, h, :]`` as ``[block, dim_p]``, zeros past ``length``
    (only checked when ``ragged``) and past ``dim``."""
    mask = _and((start + _iota(block) < length)[:, None] if ragged else None, _in_dims(ref.shape[-1], dim))
    view = ref.at[b, pl.ds(start, block), h, :]
    return view[...] if mask is None else plgpu.load(view, mask=mask, other=0.0)


@dataclasses.dataclass(frozen=True)
class Pages:
    """Keys and values in a pool of pages, ``[num_kv_heads, num_pages, page_size, dim]``,
    that sequence ``b`` reads through row ``b`` of a page table ``[batch,
    pages_per_sequence]`` (the layout of vLLM and of JAX's TPU paged attention).
    ``ids_ahead``: the key loop reads the next tile's page ids one step ahead and carries
    them, rather than each tile's at its own step."""

    page_size: int
    num_pages: int
    ids_ahead: bool = True

    def lookup(self, table, b, start, block: int):
        """The pages of sequence ``b``'s keys ``start:start+block`` from its row of the
        table: one page id for a tile within one page, else one per key (slots past the
        table's end read its last entry; ids out of the pool are clipped into it, so no
        read is ever out of bounds)."""
        page_size = np.int32(self.page_size)
        keys = start if self.page_size % block == 0 else start + _iota(block)
        slots = jnp.minimum(lax.div(keys, page_size), np.int32(table.shape[1] - 1))
        return jnp.clip(table[b, slots], 0, self.num_pages - 1)

    def load(self, ref, pages, h, start, block: int, length: int, dim: int, *, ragged: bool):
        """`load_tile` of keys ``start:start+block`` from their ``pages`` (`lookup`). A
        tile within one page is a slice of it; a tile over several pages (or across a
        page boundary) gathers its rows, so that the tile need not shrink to the page."""
        mask = _and((start + _iota(block) < length)[:, None] if ragged else None, _in_dims(ref.shape[-1], dim))
        page_size = np.int32(self.page_size)
        if self.page_size % block == 0:
            view = ref.at[h, pages, pl.ds(lax.rem(start, page_size), block), :]
        else:
            keys = start + _iota(block)
            columns = _iota(ref.shape[-1])[None, :]
            view = ref.at[h, pages[:, None], lax.rem(keys, page_size)[:, None], columns]
        return view[...] if mask is None else plgpu.load(view, mask=mask, other=0.0)


def store_tile(ref, b, h, start, value, length: int, dim: int):
    """Stores ``value [block, dim_p]`` into ``ref[b, start:start+block, h, :dim]``."""
    block, dim_p = value.shape
    mask = _and((start + _iota(block) < length)[:, None], _in_dims(dim_p, dim))
    plgpu.store(ref.at[b, pl.ds(start, block), h, _columns(dim_p)], value.astype(ref.dtype), mask=mask)


def load_rows(ref, b, h0, start, tiles: Tiles, length: int, dim: int, *, ragged: bool):
    """A query tile of ``ref [batch, len, heads, dim]``: ``tiles.positions`` positions
    from ``start`` of the ``tiles.pack`` heads from ``h0``, as ``[block_q, dim_p]`` (row
    ``r``: position ``r // pack``, head ``r % pack``); zeros past ``length`` and ``dim``."""
    if tiles.pack == 1:
        return load_tile(ref, b, h0, start, tiles.block_q, length, dim, ragged=ragged)
    n, pack, dim_p = tiles.positions, tiles.pack, ref.shape[-1]
    mask = (start + _iota(n) < length)[:, None, None] if ragged else None
    cols = _in_dims(dim_p, dim)
    mask = _and(mask, None if cols is None else cols[None])
    view = ref.at[b, pl.ds(start, n), pl.ds(h0, pack), :]
    tile = view[...] if mask is None else plgpu.load(view, mask=mask, other=0.0)
    return tile.reshape(tiles.block_q, dim_p)


def store_rows(ref, b, h0, start, value, tiles: Tiles, length: int, dim: int):
    """Stores a query tile ``value [block_q, dim_p]`` (the layout of `load_rows`)."""
    if tiles.pack == 1:
        return store_tile(ref, b, h0, start, value, length, dim)
    n, pack, dim_p = tiles.positions, tiles.pack, value.shape[-1]
    mask = _and((start + _iota(n) < length)[:, None, None], (_iota(dim_p) < dim)[None, None, :])
    view = ref.at[b, pl.ds(start, n), pl.ds(h0, pack), _columns(dim_p)]
    plgpu.store(view, value.reshape(n, pack, dim_p).astype(ref.dtype), mask=mask)


def load_row_stat(ref, b, h, start, block: int, length: int, other: float):
    """``ref[b, h, start:start+block]`` (per-row float32 statistics, heads before
    positions), ``other`` past the end."""
    return plgpu.load(ref.at[b, h, pl.ds(start, block)], mask=start + _iota(block) < length, other=other)


def store_row_stat(ref, b, h, start, value, length: int):
    """Stores ``value [block]`` into ``ref[b, h, start:start+block]`` up to ``length``."""
    block = value.shape[0]
    plgpu.store(ref.at[b, h, pl.ds(start, block)], value, mask=start + _iota(block) < length)


def load_rows_stat(ref, b, h0, start, tiles: Tiles, length: int, other: float):
    """The statistics of a query tile from ``ref [batch, len, heads]`` (positions before
    heads), as ``[block_q]`` in `load_rows`' row order; ``other`` past the end."""
    n, pack = tiles.positions, tiles.pack
    view = ref.at[b, pl.ds(start, n), pl.ds(h0, pack)]
    return plgpu.load(view, mask=(start + _iota(n) < length)[:, None], other=other).reshape(tiles.block_q)


def store_rows_stat(ref, b, h0, start, value, tiles: Tiles, length: int):
    """Stores a query tile's statistics ``[block_q]`` into ``ref [batch, len, heads]``."""
    n, pack = tiles.positions, tiles.pack
    view = ref.at[b, pl.ds(start, n), pl.ds(h0, pack)]
    plgpu.store(view, value.reshape(n, pack), mask=(start + _iota(n) < length)[:, None])


def load_heads_stat(ref, h0, tiles: Tiles):
    """A per-head statistic ``ref [heads]`` for each row of a query tile, as ``[block_q]``
    in `load_rows`' row order."""
    per_head = ref[pl.ds(h0, tiles.pack)]
    return jnp.broadcast_to(per_head[None, :], (tiles.positions, tiles.pack)).reshape(tiles.block_q)


@dataclasses.dataclass(frozen=True)
class RuntimeMask:
    """The runtime arrays of the mask (segment ids, dense mask, lengths, tile bounds) and
    the bias added to the scores, as refs."""

    q_segment_ids: object = None
    kv_segment_ids: object = None
    dense: object = None
    lengths: object = None
    bias: object = None
    bounds: object = None

    def lengths_of(self, b):
        """Batch element ``b``'s ``(q_length, kv_length)`` scalars."""
        return self.lengths[b, 0], self.lengths[b, 1]

    def spans(self, spec: MaskSpec, b, h, tile, along_q: bool, block_q: int, block_k: int):
        """`MaskSpec.kv_spans` (``along_q=False``: the key tiles of query tile ``tile``)
        or `MaskSpec.q_spans`, with this call's runtime bounds (formed here from the
        sequence's lengths where they are the only runtime part)."""
        if spec.bounds_from_lengths:
            bounds = spec.length_bounds(tile, block_q, block_k, *self.lengths_of(b), transposed=along_q)
        else:
            bounds = bounds_at(self.bounds, tile, b, h)
        if along_q:
            return spec.q_spans(tile, block_q, block_k, bounds)
        return spec.kv_spans(tile, block_q, block_k, bounds)

    def visible(self, spec: MaskSpec, b, h, q_start, tiles: Tiles, kv_start, block_k: int, *, transposed=False):
        """Element-wise visibility of a tile: ``[block_q, block_k]`` in `load_rows`' row
        order, or ``[block_k, block_q]`` when ``transposed`` (the dK/dV kernel's layout).
        ``h`` is the tile's first head."""
        n, pack = tiles.positions, tiles.pack
        positions = q_start + _iota(n)
        rows = positions if pack == 1 else jnp.broadcast_to(positions[:, None], (n, pack)).reshape(tiles.block_q)
        cols = kv_start + _iota(block_k)
        # Rows past q_len are never stored (forward, dQ) or contribute zeros (dK/dV:
        # they load as zeros with lse = +inf), so only a ragged key tail needs hiding.
        check_bounds = spec.kv_len % block_k != 0
        q_seg = kv_seg = dense = lengths = None
        if spec.has_lengths:
            lengths = self.lengths_of(b)
        if spec.has_segments:
            q_seg = plgpu.load(self.q_segment_ids.at[b, pl.ds(q_start, n)], mask=positions < spec.q_len, other=-1)
            if pack > 1:
                q_seg = jnp.broadcast_to(q_seg[:, None], (n, pack)).reshape(tiles.block_q)
            kv_seg = plgpu.load(self.kv_segment_ids.at[b, pl.ds(kv_start, block_k)], mask=cols < spec.kv_len, other=-2)
        if spec.has_dense_mask:
            dense = _scores_tile(self.dense, b, h, q_start, tiles, kv_start, block_k, spec, other=False)
            if transposed:
                dense = dense.T
        if transposed:
            return spec.visible(
                rows[None, :],
                cols[:, None],
                q_segment=None if q_seg is None else q_seg[None, :],
                kv_segment=None if kv_seg is None else kv_seg[:, None],
                dense=dense,
                lengths=lengths,
                check_bounds=check_bounds,
            )
        return spec.visible(
            rows[:, None],
            cols[None, :],
            q_segment=None if q_seg is None else q_seg[:, None],
            kv_segment=None if kv_seg is None else kv_seg[None, :],
            dense=dense,
            lengths=lengths,
            check_bounds=check_bounds,
        )

    def bias_tile(self, spec: MaskSpec, b, h, q_start, tiles: Tiles, kv_start, block_k: int, *, transposed=False):
        """The bias of a tile in float32, laid out as `visible`'s (dimensions the bias
        broadcasts stay 1), or None when the call has no bias."""
        if self.bias is None:
            return None
        tile = _scores_tile(self.bias, b, h, q_start, tiles, kv_start, block_k, spec, other=0.0).astype(jnp.float32)
        return tile.T if transposed else tile


def _scores_tile(ref, b, h, q_start, tiles: Tiles, kv_start, block_k: int, spec: MaskSpec, other):
    """The ``[block_q|1, block_k|1]`` tile of a ``[1|B, 1|H, 1|T, 1|S]`` array over the
    scores (a dense mask or a bias), ``other`` past the sequences' ends; packed tiles only
    where the array has no head axis."""
    nb, nh, nq, nk = ref.shape
    n = tiles.positions
    rows = pl.ds(q_start, n) if nq > 1 else pl.ds(0, 1)
    cols = pl.ds(kv_start, block_k) if nk > 1 else pl.ds(0, 1)
    ok_rows = (q_start + _iota(n) < spec.q_len)[:, None] if nq > 1 else jnp.ones((1, 1), jnp.bool_)
    ok_cols = (kv_start + _iota(block_k) < spec.kv_len)[None, :] if nk > 1 else jnp.ones((1, 1), jnp.bool_)
    zero = jnp.int32(0)
    view = ref.at[b if nb > 1 else zero, h if nh > 1 else zero, rows, cols]
    tile = plgpu.load(view, mask=ok_rows & ok_cols, other=other)
    if tiles.pack > 1 and nq > 1:
        width = tile.shape[1]
        tile = jnp.broadcast_to(tile[:, None, :], (n, tiles.pack, width)).reshape(tiles.block_q, width)
    return tile


def store_scores_tile(ref, b, h, q_start, kv_start, value, spec: MaskSpec):
    """Stores ``value [block_q, block_k]`` (one head's rows) into ``ref[b, h, q_start:,
    kv_start:]`` of a ``[batch, heads, q_len, kv_len]`` array over the scores."""
    block_q, block_k = value.shape
    mask = (q_start + _iota(block_q) < spec.q_len)[:, None] & (kv_start + _iota(block_k) < spec.kv_len)[None, :]
    plgpu.store(ref.at[b, h, pl.ds(q_start, block_q), pl.ds(kv_start, block_k)], value.astype(ref.dtype), mask=mask)


def zero_scores_tiles(ref, b, h, q_start, start, stop, block_q: int, block_k: int, spec: MaskSpec):
    """Zeros the key tiles ``start <= j < stop`` of query tile ``q_start`` in ``ref``
    (`store_scores_tile`): the bias's gradient where the mask hides every score."""
    zeros = jnp.zeros((block_q, block_k), jnp.float32)

    def zero_tile(j, carry):
        store_scores_tile(ref, b, h, q_start, j * block_k, zeros, spec)
        return carry

    fori_loop(start, stop, zero_tile, 0)


def score_grad(p, dp, delta, pre, logits: Logits, visible, store_bias_grad: Callable | None = None):
    """`jaxtile._softmax.score_grad`, dL/d(q·k) of a tile. With ``store_bias_grad``, the
    gradient of the logit (the bias's, `Logits.logit_grad`) is formed first, handed to
    it, and scaled into dL/d(q·k)."""
    if store_bias_grad is None:
        return sm.score_grad(p, dp, delta, pre, logits, visible)
    dlogit = sm.score_grad(p, dp, delta, pre, logits, visible, of_logit=True)
    store_bias_grad(dlogit)
    return dlogit * logits.scale


def runtime_inputs(inputs: Inputs) -> list[jax.Array]:
    """The runtime mask arrays and the bias a kernel reads, in `split_refs` order (tile
    bounds, which depend on each kernel's tiles, follow them)."""
    arrays = []
    if inputs.q_segment_ids is not None:
        arrays += [inputs.q_segment_ids, inputs.kv_segment_ids]
    if inputs.mask is not None:
        arrays.append(inputs.mask)
    if inputs.lengths is not None:
        arrays.append(inputs.lengths)
    if inputs.bias is not None:
        arrays.append(inputs.bias)
    return arrays


def scores_grad(inputs: Inputs, dims: Shape) -> list[jax.ShapeDtypeStruct]:
    """``[dbias]``, the output of a kernel that writes the bias's gradient as ``[batch,
    num_heads, q_len, kv_len]`` in `_core.bias_grad_dtype`, or ``[]`` without a bias."""
    if inputs.bias is None:
        return []
    shape = (dims.batch, dims.num_heads, dims.q_len, dims.kv_len)
    return [jax.ShapeDtypeStruct(shape, bias_grad_dtype(inputs))]


def tile_bounds(inputs: Inputs, spec: MaskSpec, block_q: int, block_k: int, *, transposed: bool) -> list[jax.Array]:
    """``[MaskSpec.tile_bounds(...)]`` for a kernel with these tiles (``block_q`` in
    positions), or ``[]`` when the mask has no runtime part or the kernel forms the
    bounds from lengths (`RuntimeMask.spans`)."""
    if spec.bounds_from_lengths:
        return []
    bounds = spec.tile_bounds(
        block_q,
        block_k,
        transposed=transposed,
        q_segment_ids=inputs.q_segment_ids,
        kv_segment_ids=inputs.kv_segment_ids,
        dense=inputs.mask,
        lengths=inputs.lengths,
    )
    return [] if bounds is None else [bounds]


def split_refs(refs: Sequence, num_leading: int, config: Config):
    """Splits a kernel's refs into ``(leading, RuntimeMask, rest)``."""
    spec = config.mask
    leading, rest = list(refs[:num_leading]), list(refs[num_leading:])
    runtime = RuntimeMask()
    if spec.has_segments:
        runtime = dataclasses.replace(runtime, q_segment_ids=rest.pop(0), kv_segment_ids=rest.pop(0))
    if spec.has_dense_mask:
        runtime = dataclasses.replace(runtime, dense=rest.pop(0))
    if spec.has_lengths:
        runtime = dataclasses.replace(runtime, lengths=rest.pop(0))
    if config.logits.bias:
        runtime = dataclasses.replace(runtime, bias=rest.pop(0))
    if not (spec.is_structured or spec.bounds_from_lengths):
        runtime = dataclasses.replace(runtime, bounds=rest.pop(0))
    return leading, runtime, rest


def _full_block(shape: tuple[int, ...], padded_last: int | None = None) -> pl.BlockSpec:
    block = (*shape[:-1], padded_last or shape[-1])
    return pl.BlockSpec(block, lambda i: (0,) * len(shape))


def _block_for(x: jax.ShapeDtypeStruct | jax.Array) -> pl.BlockSpec:
    """Whole-array block; 4-D float ``[batch, len, heads, dim]`` arrays get a padded head
    dim (and so do a bias and its gradient their key axis, which their masked tiles
    never read or write past ``kv_len``)."""
    if x.ndim == 4 and jnp.issubdtype(x.dtype, jnp.floating):
        return _full_block(x.shape, next_pow2(x.shape[-1]))
    return _full_block(x.shape)


def _varying_like(out: jax.ShapeDtypeStruct, like: jax.Array) -> jax.ShapeDtypeStruct:
    """``out``, varying over the same manual mesh axes as ``like``, as ``shard_map``
    with ``check_vma`` needs (the field is ``manual_axis_type`` in jax 0.10, ``vma``
    before)."""
    aval = jax.typeof(like)
    for field in ("manual_axis_type", "vma"):
        if field in inspect.signature(jax.ShapeDtypeStruct).parameters and hasattr(aval, field):
            return jax.ShapeDtypeStruct(out.shape, out.dtype, **{field: getattr(aval, field)})
    return out


def launch(
    body: Callable,
    kernel: Kernel,
    *,
    num_programs: int,
    inputs: Sequence[jax.Array],
    outputs: Sequence[jax.ShapeDtypeStruct],
    name: str,
):
    """Runs ``body`` on a 1-D grid through the Triton backend (interpreted off-GPU), with
    ``kernel``'s tiles, warps, stages and modelled shared memory as the call's metadata
    (what `bench.kernels` reports beside the compiler's numbers)."""
    tiles = kernel.tiles
    metadata = dict(
        block_q=tiles.block_q,
        block_k=tiles.block_k,
        pack=tiles.pack,
        num_stages=tiles.num_stages,
        shared_memory_model=kernel.shared_memory,
    )
    return pl.pallas_call(
        functools.partial(body, kernel=kernel),
        grid=(num_programs,),
        in_specs=[_block_for(x) for x in inputs],
        out_specs=[_block_for(x) for x in outputs],
        out_shape=[_varying_like(out, inputs[0]) for out in outputs],
        compiler_params=plgpu.CompilerParams(num_warps=kernel.num_warps, num_stages=tiles.num_stages),
        interpret=kernel.config.platform != "gpu",
        name=name,
        metadata={key: str(value) for key, value in metadata.items()},
    )(*inputs)


def _exp2_hardware(x):
    [y] = plgpu.elementwise_inline_asm(
        "ex2.approx.ftz.f32 $0, $1;",
        args=[x],
        constraints="=f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )
    return y


@dataclasses.dataclass(frozen=True)
class Contained:
    """How a masked tile's product reaches the non-finite entries of its right operand
    ``x`` (`Kernel.accumulate`): ``row(c)`` reloads row ``c`` of ``x`` as ``[1, dim_p]``
    and ``seen(c)`` gives the ``[rows, 1]`` visibility of that row of ``x`` (a key, or
    in the dK/dV kernel a query) to the rows of the result; ``count`` rows in all."""

    row: Callable
    seen: Callable
    count: int


def _spread_nonfinite(acc, contained: Contained):
    """Adds each non-finite entry of ``x`` to the result rows that see its row, one row of
    ``x`` at a time: ``inf`` and ``-inf`` give ``inf``/``-inf``, mixed or NaN give NaN,
    as in `jaxtile._softmax.masked_dot` (whose count-and-sign products this does without
    a second accumulator: in a kernel, registers are what the product costs)."""

    def one_row(c, acc):
        x = contained.row(c).astype(jnp.float32)
        special = contained.seen(c) & ~(jnp.abs(x) < jnp.inf)
        return jnp.where(special, acc + x, acc)

    return fori_loop(0, contained.count, one_row, acc)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """Static parameters every kernel body reads: the call's config, sizes and tiles, and
    the launch's warps and shared-memory model."""

    config: Config
    dims: Shape
    tiles: Tiles
    num_warps: int
    staging: Staging

    @classmethod
    def create(cls, inputs: Inputs, config: Config, tuning: KernelTuning, staging: Staging, **fit) -> Kernel:
        """Tiles and stages from ``tuning`` that fit ``staging`` (with the dense mask's
        tiles where the call has one) in shared memory (`Tiles.fit`)."""
        dims = Shape.of(inputs.q, inputs.k, inputs.v)
        staging = dataclasses.replace(staging, dense_mask=inputs.mask is not None)
        limit = shared_memory_limit(config.platform)
        tiles = Tiles.fit(tuning, dims, inputs.q.dtype, staging, limit, **fit)
        return cls(config, dims, tiles, tuning.num_warps, staging)

    @property
    def head_dim_p(self) -> int:
        """q and k's head dim, padded to a power of two (tiles past the real one load as 0)."""
        return next_pow2(self.dims.head_dim)

    @property
    def head_dim_v_p(self) -> int:
        """v's head dim, padded to a power of two."""
        return next_pow2(self.dims.head_dim_v)

    @property
    def shared_memory(self) -> int:
        """Modelled shared-memory bytes of one program (`Staging.bytes`)."""
        t = self.tiles
        return self.staging.bytes(t.block_q, t.block_k, self.dims, self.dims.itemsize, t.num_stages)

    def dot(self, a, b, *, trans_a: bool = False, trans_b: bool = False):
        """``a @ b`` (optionally transposed) with float32 accumulation. float32 inputs get
        float32 accuracy: three TF32 products on the GPU's tensor cores (Triton's default
        would be one, ~1e-3 relative; IEEE products on CUDA cores compile and run an
        order of magnitude slower), exact products in interpret mode."""
        precision = None
        if a.dtype == jnp.float32:
            gpu = self.config.platform == "gpu"
            precision = lax.DotAlgorithmPreset.TF32_TF32_F32_X3 if gpu else lax.Precision.HIGHEST
        return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=precision)

    def accumulate(self, acc, p, x, contained: Contained | None = None, *, trans_a=False, unbounded=False):
        """``acc + p @ x`` (``pᵀ @ x`` with ``trans_a``) for a float32 tile ``p`` (P, or
        dS with ``unbounded``) rounded to ``x``'s dtype for the matrix units.

        With ``contained`` (a masked tile), the product is exact as if the masked entries
        of ``p`` were absent: non-finite entries of ``x`` enter it as 0 and, in the rare
        tile that has any, `_spread_nonfinite` adds them to the rows that see them. An
        interior tile (no ``contained``) is the plain product.

        ``unbounded``: in float16, each row of ``p`` whose magnitude exceeds ``2**15`` is
        divided by a power of two that brings it under, and the product multiplied back
        (``|dS|`` can exceed float16's 65504 where dQ and dK do not).
        """
        if contained is not None:
            finite = jnp.abs(x) < jnp.inf  # False for ±inf and NaN
            x = jnp.where(finite, x, jnp.zeros_like(x))
        if unbounded and x.dtype == jnp.float16:
            peak = jnp.max(jnp.abs(p), axis=0 if trans_a else 1)
            inv_scale = jnp.where(peak > 2.0**15, jnp.exp2(15.0 - jnp.ceil(jnp.log2(peak))), 1.0)
            scaled = p * (inv_scale[None, :] if trans_a else inv_scale[:, None])
            acc = acc + self.dot(scaled.astype(x.dtype), x, trans_a=trans_a) / inv_scale[:, None]
        else:
            acc = acc + self.dot(p.astype(x.dtype), x, trans_a=trans_a)
        if contained is None:
            return acc
        clean = jnp.max(jnp.where(finite, 0.0, 1.0)) == 0.0
        return lax.cond(clean, lambda acc: acc, functools.partial(_spread_nonfinite, contained=contained), acc)

    def barrier(self) -> None:
        """Orders this program's earlier global-memory writes before its later reads
        (a block-wide barrier on the GPU; interpret mode runs sequentially)."""
        if self.config.platform == "gpu":
            plgpu.debug_barrier()

    @property
    def exp2(self):
        """Base-2 exponential: one ``ex2.approx.ftz`` instruction on the GPU (relative
        error below 2**-22; denormal results flush to 0, negligible next to the row
        maximum of 1), ``jnp.exp2`` in interpret mode."""
        return _exp2_hardware if self.config.platform == "gpu" else jnp.exp2


def memory(shape: Shape, fa1: bool, backward: bool) -> tuple[int, int]:
    """Residuals and temporaries of the kernels: O(N) rows, nothing per tile (tiles live
    in registers and shared memory).

    FlashAttention-2 writes out and lse directly; its backward pass adds ``D`` and the
    base-2 lse, one float32 row each. FlashAttention-1 keeps
    the running output in a float32 buffer with ``m`` and ``l`` (forward) and accumulates
    dQ in float32 beside ``m`` and ``1/l`` (backward); for float32 inputs the buffers are
    the outputs.
    """
    f32 = 4
    row = shape.batch * shape.num_heads * shape.q_len * f32
    stats = 2 if fa1 else 1
    buffers = fa1 and shape.itemsize != f32
    forward = (shape.q_bytes(shape.head_dim_v, f32) if buffers else 0) + (2 * row if fa1 else 0)
    if not backward:
        return 0, forward
    residuals = shape.q_bytes(shape.head_dim_v) + stats * row
    backward_temps = (shape.q_bytes(shape.head_dim, f32) if buffers else 0) + 2 * row
    return residuals, max(forward, backward_temps)
