"""What the Mosaic GPU kernels share: padding to ``wgmma`` tiles, shared-memory tiles,
and the producer warpgroup's ring of TMA copies that the consumers read.

A kernel of this family runs consumer warpgroups and one producer. The producer copies
the tiles of step ``s`` of the consumers' loop into slot ``s % num_stages`` of a ring in
shared memory; for each operand a "ready" barrier per slot says its copy has landed and
a "free" barrier (one arrival per consumer) says every consumer is done with it.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import inspect
import itertools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu  # the Pallas API of jax 0.10.2 to 0.12

from jaxtile._core import HOPPER_SHARED_MEMORY, HOPPER_SMS, Shape, pad_to
from jaxtile.mask import MaskSpec, bounds_at, cdiv, uniform_bounds

# wgmma's rows per warpgroup, and the 128-byte swizzle's width in 2-byte elements: the
# tiles' rows and the head dims are multiples of it (smaller head dims are zero-padded).
WGMMA_ROWS = 64
# Shared memory per block on sm_90 (227 KiB), as Mosaic GPU counts a kernel's
# (`mosaic_bytes`, the forward's model); and the backward's budget for its tiles counted
# unrounded (`BackwardTuning.shared_memory`), less a margin for what Mosaic adds to them
# (2 KiB, 8 bytes a barrier, each tile's rounding up to 1 KiB).
BLOCK_SHARED_MEMORY = HOPPER_SHARED_MEMORY
SHARED_MEMORY = BLOCK_SHARED_MEMORY - 4096
# Consumer warpgroups per program, and registers per thread of a consumer and of the
# producer (65536 per block, 128 threads per warpgroup: two consumers at 240 leave the
# producer 24, as FlashAttention-3 divides them).
CONSUMERS = 2
CONSUMER_REGISTERS, PRODUCER_REGISTERS = 240, 24


def padded(n: int, multiple: int) -> int:
    return cdiv(n, multiple) * multiple


def padded_copies(shape: Shape, q_len: int, kv_len: int, head_dim: int, head_dim_v: int) -> int:
    """Bytes of zero-padded copies of the queries, keys and values at these sizes and of
    the padded results like them (the output; or dO and the gradients), 0 where nothing
    is padded (`jaxtile.analysis`'s model)."""
    if (q_len, kv_len, head_dim, head_dim_v) == (shape.q_len, shape.kv_len, shape.head_dim, shape.head_dim_v):
        return 0
    big = dataclasses.replace(shape, q_len=q_len, kv_len=kv_len, head_dim=head_dim, head_dim_v=head_dim_v)
    return 2 * (big.q_bytes(head_dim) + big.q_bytes(head_dim_v) + big.kv_bytes(head_dim) + big.kv_bytes(head_dim_v))


def along(x, shape: tuple[int, int], axis: int):
    """A ``[n]`` statistic of the rows (``axis=0``) or the columns (``axis=1``) of a
    ``[rows, cols]`` tile, broadcast to the tile."""
    return lax.broadcast_in_dim(x, shape, (axis,))


# The rows of the tiles `smem` lays shared memory out in: a TMA copy into such a tile
# reads whole tiles of rows, so a length it copies along is a multiple of this.
TILE_ROWS = 8


def smem(dtype, *shape):
    """A shared-memory tile whose last dim (a multiple of 128 bytes, or of 64) is swizzled
    for ``wgmma`` and TMA, in tiles of `TILE_ROWS` rows."""
    swizzle = math.gcd(128, shape[-1] * jnp.dtype(dtype).itemsize)
    tiling = plgpu.TilingTransform((TILE_ROWS, swizzle // jnp.dtype(dtype).itemsize))
    return plgpu.SMEM(shape, dtype, transforms=(tiling, plgpu.SwizzleTransform(swizzle)))


def mosaic_bytes(tiles: Sequence[int], barriers: int) -> int:
    """Shared memory as Mosaic GPU counts it for a kernel of these tiles (bytes) and
    barriers: each tile rounded up to 1 KiB, 2 KiB of its own and 8 bytes a barrier (its
    ``smem_bytes``, read with jax 0.10.2 off the GPU: 231544 for 229376 bytes of tiles
    with 15 barriers, 232568 with a 512-byte tile more; and compiled with 0.11.2 on an
    H200)."""
    return sum(padded(t, 1024) for t in tiles) + 2048 + 8 * barriers


def iotas(shape: tuple[int, int], row0, col0):
    """Row and column indices of a ``wgmma``-layout tile whose corner is ``(row0, col0)``."""
    return tuple(
        start + plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)
        for axis, start in ((0, row0), (1, col0))
    )


def _load_takes_index() -> bool:
    return inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty


def load_stat(ref, axis: int):
    """A ``[n]`` float32 vector from shared memory, laid out to broadcast along ``axis`` of
    a ``wgmma`` tile (`along`): 0 for a statistic of rows, 1 of columns. (jax 0.10 takes
    the index separately; later versions take the indexed ref and deprecate the index.)"""
    return _load(ref, plgpu.Layout.WGMMA.reduce(1 - axis))


def load_tile(ref):
    """A ``wgmma``-layout tile from shared memory."""
    return _load(ref, plgpu.Layout.WGMMA)


def _load(ref, layout):
    if _load_takes_index():
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def rows_of(ref, b, rows, h):
    """The tile of ``rows`` (a `pl.ds`) of batch element ``b`` and head ``h`` in ``ref``:
    an operand ``[batch, len, heads, dim]``, a row statistic ``[batch, heads, len]`` or
    segment ids ``[batch, len]`` (which have no head)."""
    return ref.at[{4: (b, rows, h), 3: (b, h, rows), 2: (b, rows)}[ref.ndim]]


def copy_own(sources, tiles, ready, wg):
    """Issues consumer ``wg``'s copies of its own tiles: ``sources[n]`` into
    ``tiles[n].at[wg]``, each under its own barrier ``ready[n].at[wg]`` (one barrier per
    tile, so the launch allocates as many as it declares tiles; `wait_own`)."""
    for source, tile, barrier in zip(sources, tiles, ready, strict=True):
        plgpu.copy_gmem_to_smem(source, tile.at[wg], barrier.at[wg])


def wait_own(ready, wg):
    """Returns once consumer ``wg``'s copies of `copy_own` have landed."""
    for barrier in ready:
        plgpu.barrier_wait(barrier.at[wg])


def segment_tiles(spec: MaskSpec, *shape: int):
    """A ``[*shape]`` int32 tile of segment ids where the call has them: ``(tile,)`` or ()."""
    return (plgpu.SMEM(shape, jnp.int32),) if spec.has_segments else ()


def own_barriers(tiles):
    """A ready barrier per consumer for each of ``tiles`` (`copy_own`)."""
    return tuple(plgpu.Barrier(num_barriers=CONSUMERS) for _ in tiles)


class Stream(NamedTuple):
    """One operand of the ring: ``source(s)`` is the gmem ref view of step ``s``'s tile,
    copied into ``tiles.at[slot]``; ``ready`` and ``free`` hold a barrier per slot.
    ``copies(s)``, where given, says whether step ``s`` copies its tile at all: on the
    steps it does not, the producer arrives on the slot's ready barrier without a copy,
    so that the barriers keep pace with the other operands' (`step_tile`)."""

    source: Callable
    tiles: object
    ready: object
    free: object
    copies: Callable | None = None


def produce(steps, num_stages: int, streams: Sequence[Stream], done=0, each: Callable | None = None):
    """The producer's loop: fill the ring, then refill each slot with the tiles of step
    ``s`` once every consumer has freed that slot's tiles of step ``s - num_stages``.
    ``done``: the steps the ring served before these (a persistent program's earlier
    tiles, `Schedule`); step ``s`` takes slot ``(done + s) % num_stages``. ``each(s)``,
    where given, runs once step ``s``'s copies are issued (work spread over the steps)."""

    def load(s, wait):
        slot = lax.rem(jnp.asarray(done + s, jnp.int32), jnp.int32(num_stages))
        for stream in streams:
            if wait is True:
                plgpu.barrier_wait(stream.free.at[slot])
            elif wait is not False:
                pl.when(wait)(functools.partial(plgpu.barrier_wait, stream.free.at[slot]))
            copy = functools.partial(
                plgpu.copy_gmem_to_smem, stream.source(s), stream.tiles.at[slot], stream.ready.at[slot]
            )
            if stream.copies is None:
                copy()
            else:
                copies = stream.copies(s)
                pl.when(copies)(copy)
                pl.when(jnp.logical_not(copies))(functools.partial(plgpu.barrier_arrive, stream.ready.at[slot]))
        if each is not None:
            each(s)

    if isinstance(done, int) and done == 0:
        for s in range(num_stages):
            pl.when(s < steps)(functools.partial(load, s, False))

        @pl.loop(num_stages, jnp.maximum(steps, num_stages))
        def _(s):
            load(s, True)

    else:

        @pl.loop(0, steps)
        def _(s):
            load(s, done + s >= num_stages)


def query_tile(spec: MaskSpec, q_tiles: int, t):
    """The query tile that grid index ``t`` runs: last to first where they are the
    heaviest (`MaskSpec.heaviest_last`), as the Triton kernels."""
    return q_tiles - 1 - t if spec.heaviest_last else t


def key_spans(spec: MaskSpec, rows: int, block_k: int, t, b, bounds_ref=None, h=0):
    """Query tile ``t``'s (of ``rows`` rows, in batch element ``b`` and head ``h``) spans of
    key tiles (`MaskSpec.kv_spans`, within the runtime ``bounds_ref [1|batch, 1|heads,
    tiles, 4]`` of `MaskSpec.tile_bounds` when given), the first of them and the number
    of steps."""
    spans = spec.kv_spans(t, rows, block_k, bounds_at(bounds_ref, t, b, h))
    return spans, spans[0].start, spans[-1].stop - spans[0].start


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Which tiles of a grid ``tiles`` = (heads, query tiles, batch) each program runs.

    ``programs`` None: one program per tile; the launch grid is ``tiles``, its axes
    ``"heads"``, ``"q_tiles"``, ``"batch"``. Else ``programs`` persistent programs (the
    ``"programs"`` axis) run the tiles in rounds, one tile each per round, in the order
    the hardware launches a grid (heads fastest) or, with ``queries_first``, the query
    tiles fastest (a round takes whole heads' tiles, which read the same K and V: L2 keeps
    them), every other round backwards if ``snake``. A program moves to its next tile
    without a launch, its producer loading that tile's keys while its consumers finish
    the last.

    ``ordered`` (persistent programs only): the places in that order hold the tiles of a
    runtime permutation (`tile_order`, the heaviest first), for masks with runtime bounds
    (by default lengths alone), which make the tiles uneven in ways the host cannot see.

    ``plan`` (persistent programs only, in place of rounds): the places each program runs,
    dealt on the host (`dealt`): program ``p``'s ``i``-th tile is at place
    ``plan[programs + 1 + plan[p] + i]``, for ``i < plan[p + 1] - plan[p]``. The kernels
    read it from their one extra operand (`operands`).
    """

    tiles: tuple[int, int, int]
    programs: int | None = None
    snake: bool = False
    ordered: bool = False
    queries_first: bool = False
    plan: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.programs is not None and not 0 < self.programs <= math.prod(self.tiles):
            raise ValueError(f"programs={self.programs} must be in [1, {math.prod(self.tiles)}] for tiles={self.tiles}")
        if self.ordered and self.programs is None:
            raise ValueError(f"ordered={self.ordered} needs persistent programs, not programs={self.programs}")
        if self.queries_first and (self.programs is None or self.ordered):
            raise ValueError(
                f"queries_first={self.queries_first} needs persistent programs in rounds, not "
                f"programs={self.programs}, ordered={self.ordered}"
            )
        if self.plan is not None and (
            self.programs is None or self.ordered or self.snake or len(self.plan) != self.programs + 1 + self.size
        ):
            raise ValueError(
                f"a plan of {len(self.plan)} entries needs {self.size} tiles dealt to persistent programs, not "
                f"programs={self.programs}, snake={self.snake}, ordered={self.ordered}"
            )

    @classmethod
    def balanced(
        cls,
        tiles: tuple[int, int, int],
        work: Sequence[float],
        most: int,
        queries_first: bool = False,
        dealing: float = 0.0,
    ) -> Schedule:
        """The persistent schedule of at most ``most`` programs (and at least 7/8 of them),
        in rounds or snaking (in the order ``queries_first`` says), or ``most`` programs
        `dealt` their tiles, whose `busiest` program has the least ``work`` (where programs
        keep their own share of uneven tiles, their count and order set how even the shares
        are); the most programs, in rounds, among equals. Dealt programs count ``dealing``
        more work each: what dealing costs that `busiest` does not count, in ``work``'s
        units."""
        most = min(most, math.prod(tiles))
        rounds = min(
            (
                cls(tiles, p, snake, queries_first=queries_first)
                for p in range(most, max(1, most * 7 // 8) - 1, -1)
                for snake in (False, True)
            ),
            key=lambda schedule: schedule.busiest(work),
        )
        dealt = cls.dealt(tiles, work, most, queries_first)
        return dealt if dealt.busiest(work) + dealing < rounds.busiest(work) else rounds

    @classmethod
    def dealt(cls, tiles: tuple[int, int, int], work: Sequence[float], programs: int, queries_first: bool = False):
        """The tiles each dealt to the program that the ``work`` dealt so far frees first
        (the lowest-numbered among equals), as the hardware starts a launch's blocks: list
        scheduling, which a program's tiles of uneven work need not follow round by round.
        They are dealt in place order (``queries_first`` or heads fastest) cut into
        stretches of as many heads' query tiles as one round holds, the heaviest first
        within each stretch (stably): near the even share, as heaviest first over the
        whole grid would be, while a round still reads the K and V of the few heads whose
        tiles place order puts in it."""
        at_place = cls(tiles, programs, queries_first=queries_first)._work(work)
        stretch = max(1, programs // tiles[1]) * tiles[1]
        order = np.lexsort((-at_place, np.arange(at_place.size) // stretch))
        return cls._deal(tiles, at_place, programs, queries_first, order)

    @classmethod
    def _deal(
        cls, tiles: tuple[int, int, int], at_place: np.ndarray, programs: int, queries_first: bool, order: np.ndarray
    ) -> Schedule:
        """Each place of ``order`` in turn dealt to the program that the work dealt so far
        (``at_place``, by place) frees first, the lowest-numbered among equals."""
        load = [(0.0, p) for p in range(programs)]
        places: list[list[int]] = [[] for _ in range(programs)]
        for place in order.tolist():
            done, p = heapq.heappop(load)
            places[p].append(place)
            heapq.heappush(load, (done + at_place[place], p))
        starts = np.cumsum([0] + [len(p) for p in places]).tolist()
        return cls(tiles, programs, queries_first=queries_first, plan=(*starts, *itertools.chain(*places)))

    @property
    def size(self) -> int:
        """The tiles of the grid."""
        return math.prod(self.tiles)

    def _work(self, work: Sequence[float]) -> np.ndarray:
        """``work[t]`` (a tile of grid index ``t`` along the query tiles) at each place."""
        heads, q_tiles, _ = self.tiles
        place = np.arange(self.size)
        return np.asarray(work, np.float64)[place % q_tiles if self.queries_first else place // heads % q_tiles]

    def busiest(self, work: Sequence[float]) -> float:
        """The most work any of the persistent programs does, ``work[t]`` estimating a tile
        of grid index ``t`` along the query tiles."""
        if self.plan is None:
            rounds, column = np.divmod(np.arange(self.size), self.programs)
            program = np.where(self.snake & (rounds % 2 == 1), self.programs - 1 - column, column)
        else:
            program = np.empty(self.size, np.int64)
            program[list(self.plan[self.programs + 1 :])] = np.repeat(
                np.arange(self.programs), np.diff(self.plan[: self.programs + 1])
            )
        return np.bincount(program, self._work(work), self.programs).max()

    def operands(self) -> tuple[jax.Array, ...]:
        """The kernels' operand of a `plan` (int32), or none."""
        return () if self.plan is None else (_constant(self.plan),)

    @property
    def grid(self) -> tuple[int, ...]:
        return self.tiles if self.programs is None else (self.programs,)

    @property
    def names(self) -> tuple[str, ...]:
        return ("heads", "q_tiles", "batch") if self.programs is None else ("programs",)

    def _linear(self, i, operand=None):
        """The place of this program's ``i``-th tile: in the `plan` ref ``operand``, or in
        round ``i`` of the launch order."""
        i, programs, p = jnp.asarray(i, jnp.int32), jnp.int32(self.programs), lax.axis_index("programs")
        if self.plan is not None:
            return operand[programs + 1 + operand[p] + i]
        if not self.snake:
            return i * programs + p
        return i * programs + jnp.where(lax.rem(i, jnp.int32(2)) == 1, programs - 1 - p, p)

    def count(self, operand=None):
        """The number of tiles this program runs (from the `plan` ref ``operand`` if any)."""
        if self.programs is None:
            return 1
        if self.plan is not None:
            p = lax.axis_index("programs")
            return operand[p + 1] - operand[p]
        rounds = self.size // self.programs  # the last, partial round: a tile for some
        partial = self._linear(rounds) < self.size
        return jnp.int32(rounds) + partial.astype(jnp.int32)

    def index(self, i, operand=None):
        """``(head, query tile, batch)`` of this program's ``i``-th tile (through the ref
        ``operand``: the `tile_order` permutation if `ordered`, the `plan` if any)."""
        if self.programs is None:
            return tuple(lax.axis_index(name) for name in self.names)
        heads, q_tiles, _ = (jnp.int32(n) for n in self.tiles)
        linear = self._linear(i, operand)
        if self.queries_first:
            return lax.rem(lax.div(linear, q_tiles), heads), lax.rem(linear, q_tiles), lax.div(linear, heads * q_tiles)
        if not self.ordered:
            return lax.rem(linear, heads), lax.rem(lax.div(linear, heads), q_tiles), lax.div(linear, heads * q_tiles)
        # A unit of the order stands for `repeat` heads (all of them where the bounds are
        # the same for every head): place `linear` is head `r` of unit `order[linear // repeat]`.
        units_heads = operand.shape[0] // (self.tiles[1] * self.tiles[2])
        repeat = jnp.int32(self.tiles[0] // units_heads)
        unit, r = operand[lax.div(linear, repeat)], lax.rem(linear, repeat)
        head_and_batch = lax.div(unit, q_tiles)
        h = lax.rem(head_and_batch, jnp.int32(units_heads)) * repeat + r
        return h, lax.rem(unit, q_tiles), lax.div(head_and_batch, jnp.int32(units_heads))

    def loop(self, body, operand=None):
        """``body(i, done) -> done`` over this program's tiles ``i`` (`count`), ``done``
        counting the steps of the ring before tile ``i`` (a Python 0 with one tile per
        program)."""
        if self.programs is None:
            body(0, 0)
        else:
            lax.fori_loop(jnp.int32(0), self.count(operand), body, jnp.int32(0))


@functools.partial(jax.jit, static_argnums=0)
def _constant(values: tuple[int, ...]) -> jax.Array:
    """``values`` as an int32 array that is a constant of its own ``jit`` alone: the call
    tracing it (`jaxtile.distributed`'s ``custom_partitioning``) takes no constants."""
    return jnp.asarray(values, jnp.int32)


def tile_order(spec: MaskSpec, bounds, batch: int, rows: int, block_k: int) -> jax.Array:
    """An ordered `Schedule`'s permutation: the ``(batch, head, query tile)`` units of the
    runtime ``bounds [1|batch, 1|heads, q_tiles, 4]`` (`MaskSpec.tile_bounds`), flattened
    in that order, sorted by the key tiles each visits (`MaskSpec.kv_spans` of its query
    tile of ``rows`` rows within its bounds), most first (ties keep their order): int32
    ``[batch * (1|heads) * q_tiles]``."""
    bounds = jnp.broadcast_to(bounds, (batch, *bounds.shape[1:]))
    q_tiles = jnp.arange(bounds.shape[-2], dtype=jnp.int32)
    spans = spec.kv_spans(q_tiles, rows, block_k, tuple(bounds[..., i] for i in range(4)))
    steps = jnp.broadcast_to(spans[-1].stop - spans[0].start, bounds.shape[:-1]).reshape(-1)
    return jnp.argsort(steps, descending=True, stable=True).astype(jnp.int32)


@functools.cache
def multiprocessors() -> int:
    """Streaming multiprocessors of this machine's first GPU (Hopper's where no GPU
    answers)."""
    try:
        return jax.devices("gpu")[0].core_count
    except (RuntimeError, AttributeError):
        return HOPPER_SMS


def runtime_operands(inputs, spec: MaskSpec, q_len: int, kv_len: int, rows: int, keys: int, transposed: bool = False):
    """The runtime parts of the mask for a kernel whose tiles are ``rows`` by ``keys``:
    the segment ids of the queries and the keys (padded to ``q_len``, ``kv_len`` with
    ids of no segment), the lengths ``[batch, 2]``, the dense mask as int8 ``[1|batch,
    1|heads, q_len, kv_len]`` (padded with False; TMA copies bytes, not bools), and the
    tile bounds (`MaskSpec.tile_bounds`), each where the call has it (`runtime_refs`
    splits them again). ``transposed``, for loops over query tiles (dK/dV): the mask
    ``[..., kv_len, q_len]``, and the bounds transposed and, for a mask per head, one
    per kv head, the union of its query heads' (`uniform_bounds`)."""
    operands = []
    if spec.has_segments:
        operands += [pad_to(inputs.q_segment_ids, 1, q_len, -1), pad_to(inputs.kv_segment_ids, 1, kv_len, -2)]
    if spec.has_lengths:
        operands.append(inputs.lengths)
    if spec.has_dense_mask:
        dense = inputs.mask
        dense = jnp.broadcast_to(dense, (*dense.shape[:2], spec.q_len, spec.kv_len)).astype(jnp.int8)
        dense = pad_to(pad_to(dense, 2, q_len), 3, kv_len)
        operands.append(jnp.swapaxes(dense, 2, 3) if transposed else dense)
    runtime = dict(q_segment_ids=inputs.q_segment_ids, kv_segment_ids=inputs.kv_segment_ids, dense=inputs.mask)
    bounds = spec.tile_bounds(rows, keys, transposed=transposed, lengths=inputs.lengths, **runtime)
    if transposed and bounds is not None and bounds.shape[1] > 1:
        group = Shape.of(inputs.q, inputs.k, inputs.v).group
        bounds = uniform_bounds(bounds.reshape(bounds.shape[0], -1, group, *bounds.shape[2:]), axis=2)
    return (*operands, *([] if bounds is None else [bounds]))


class RuntimeRefs(NamedTuple):
    """`runtime_operands`' refs: the queries' and the keys' segment ids, or (); the
    lengths, the dense mask and the tile bounds, each None where the call has none."""

    ids: tuple
    lengths: object
    dense: object
    bounds: object


def runtime_refs(spec: MaskSpec, refs) -> RuntimeRefs:
    """`runtime_operands`' refs, split again."""
    refs = list(refs)
    ids = (refs.pop(0), refs.pop(0)) if spec.has_segments else ()
    lengths = refs.pop(0) if spec.has_lengths else None
    dense = refs.pop(0) if spec.has_dense_mask else None
    return RuntimeRefs(ids, lengths, dense, refs.pop(0) if refs else None)


def read_lengths(lengths_ref, b):
    """Batch element ``b``'s ``(q_length, kv_length)`` scalars from ``[batch, 2]`` (None: None)."""
    if lengths_ref is None:
        return None
    return lengths_ref[b, 0], lengths_ref[b, 1]


def step_tile(ring, slot, read=None):
    """``read(tile)`` of this step's tile of a stream of the ring (tiles, ready and free
    barriers), or None without ``read``. Waited for and freed on every step, read or not,
    so that the barriers' phases keep pace with the other operands'."""
    tiles, ready, free = ring
    plgpu.barrier_wait(ready.at[slot])
    value = None if read is None else read(tiles.at[slot])
    plgpu.barrier_arrive(free.at[slot])
    return value


def step_ids(ring, slot, masked: bool):
    """The segment ids ``[n]`` of this step's tile from their ``ring`` (`step_tile`), laid
    along the columns of a ``wgmma`` tile when the step is ``masked``, else None."""
    return step_tile(ring, slot, functools.partial(load_stat, axis=1) if masked else None)


def dense_tiles(spec: MaskSpec, num_stages: int, rows: int, block_k: int):
    """A ring of int8 ``[num_stages, rows, block_k]`` tiles of the dense mask where the call
    has one: ``(tiles,)`` or ()."""
    return (smem(jnp.int8, num_stages, rows, block_k),) if spec.has_dense_mask else ()


def _scores_source(ref, *, b, rows, cols: int, step: Callable, transposed: bool = False) -> Callable:
    """`Stream.source` of an operand laid out as the scores, ``[1|batch, 1|heads, rows,
    cols]`` (a dense mask, transposed or not, or the bias): in batch element ``b``,
    ``rows`` (a `pl.ds`) by ``cols`` columns, step ``s`` taking ``step(s) = (head,
    tile)``, the tile of the loop along the columns. ``transposed``: ``ref`` is laid out
    ``[..., cols, rows]`` (the bias read by dK/dV, whose rows are keys), and the tile
    copied as it lies there."""
    b = b if ref.shape[0] > 1 else 0

    def source(s):
        h, j = step(s)
        tile = (pl.ds(j * cols, cols), rows) if transposed else (rows, pl.ds(j * cols, cols))
        return ref.at[b, h if ref.shape[1] > 1 else 0, *tile]

    return source


def dense_stream(ref, ring, spans, **where) -> tuple[Stream, ...]:
    """The stream of the dense mask's tiles (from `runtime_operands`' ``ref``, where
    `_scores_source` says). A tile is copied on the steps of ``spans`` that are masked
    only (interior tiles are whole, and never read). ``(stream,)``, or () where the call
    has no dense mask (``ring`` None)."""
    if ring is None:
        return ()
    step = where["step"]

    def copies(s):
        _, j = step(s)
        return functools.reduce(
            jnp.logical_or, [(span.start <= j) & (j < span.stop) for span in spans if span.masked], jnp.bool_(False)
        )

    return (Stream(_scores_source(ref, **where), *ring, copies),)


def bias_operand(bias, spec: MaskSpec, q_len: int, kv_len: int):
    """The bias ``[1|batch, 1|heads, 1|q_len, 1|kv_len]`` (`jaxtile._core.Inputs`) over
    every position of ``spec``'s call, zero-padded to ``q_len`` and ``kv_len``, as the
    dense mask is (TMA copies whole tiles)."""
    bias = jnp.broadcast_to(bias, (*bias.shape[:2], spec.q_len, spec.kv_len))
    return pad_to(pad_to(bias, 2, q_len), 3, kv_len)


def bias_tiles(bias, num_stages: int, rows: int, block_k: int):
    """A ring of ``[num_stages, rows, block_k]`` tiles of the bias, in its dtype, where
    the call has one (``bias``, or None): ``(tiles,)`` or ()."""
    return () if bias is None else (smem(bias.dtype, num_stages, rows, block_k),)


def bias_stream(ref, ring, **where) -> tuple[Stream, ...]:
    """The stream of the bias's tiles (`bias_operand`, where `_scores_source` says),
    copied on every step; ``(stream,)``, or () where the call has none (``ring`` None)."""
    return () if ring is None else (Stream(_scores_source(ref, **where), *ring),)


def step_bias(ring, slot, row0, rows: int, transposed: bool = False):
    """Rows ``row0`` to ``row0 + rows - 1`` of this step's tile of the bias from its
    ``ring`` (`step_tile`), a float32 ``wgmma`` tile; None where the call has no bias.
    ``transposed``: the ring's tiles hold queries by keys (`_scores_source`) where the
    consumer's rows are keys, so its columns are read, transposed on the way (a shuffle
    between lane pairs)."""
    if ring is None:
        return None

    def read(tile):
        if not transposed:
            return _load(tile.at[pl.ds(row0, rows)], plgpu.Layout.WGMMA).astype(jnp.float32)
        columns = tile.at[:, pl.ds(row0, rows)].transpose((1, 0))
        return plgpu.layout_cast(_load(columns, plgpu.Layout.WGMMA_TRANSPOSED), plgpu.Layout.WGMMA).astype(jnp.float32)

    return step_tile(ring, slot, read)


def step_dense(ring, slot, masked: bool, row0, rows: int):
    """Rows ``row0`` to ``row0 + rows - 1`` of this step's tile of the dense mask from its
    ``ring`` (`step_tile`), a bool ``wgmma`` tile when the step is ``masked``, else None
    (the ring's tiles hold the consumers' rows, queries or keys, as their scores). None
    where the call has no dense mask (``ring`` None)."""
    if ring is None:
        return None

    def read(tile):
        return _load(tile.at[pl.ds(row0, rows)], plgpu.Layout.WGMMA) != 0

    return step_tile(ring, slot, read if masked else None)


def visible(
    spec: MaskSpec, corner, shape: tuple[int, int], q_axis: int, *, lengths, own_ids=None, step_ids=None, dense=None
):
    """`MaskSpec.visible` of a ``wgmma`` tile of ``shape`` whose corner is ``corner``
    (row, column) and whose axis ``q_axis`` runs over queries (0; 1 in the transposed
    tiles of dK/dV), with the runtime parts of the mask: this program's ``lengths``
    (`read_lengths`), with segment ids its own side's (``own_ids``, loaded once) and
    the step's (``step_ids``, from the ring), and the dense mask's tile (`step_dense`,
    laid out as the scores)."""
    rows, cols = iotas(shape, *corner)
    q_idx, kv_idx = (rows, cols) if q_axis == 0 else (cols, rows)
    runtime = {}
    if lengths is not None:
        runtime["lengths"] = tuple(
            plgpu.layout_cast(jnp.full(shape, n, jnp.int32), plgpu.Layout.WGMMA) for n in lengths
        )
    if spec.has_segments:
        q_ids, kv_ids = (own_ids, step_ids) if q_axis == 0 else (step_ids, own_ids)
        runtime.update(q_segment=along(q_ids, shape, q_axis), kv_segment=along(kv_ids, shape, 1 - q_axis))
    if spec.has_dense_mask:
        runtime["dense"] = dense
    return spec.visible(q_idx, kv_idx, **runtime)


def split_ring(ring_type, refs, tiles, ready, free, spec: MaskSpec):
    """A ``ring_type`` (`KeyRing`, `QueryRing`) of ``refs``' streams, the first of a ring's
    ``tiles`` and barriers, and the dense mask's stream after them (tiles, ready, free;
    None where the call has no dense mask)."""
    n = len(refs)
    dense = (tiles[n], ready[n], free[n]) if spec.has_dense_mask else None
    return ring_type(refs, tiles[:n], ready[:n], free[:n]), dense


class KeyRing(NamedTuple):
    """The ring of a kernel whose consumers visit key tiles (the forward and dQ): the
    streams of K, V and, when the call has segment ids, the keys' ids ``[batch,
    kv_len]``; ``refs`` in global memory, ``tiles`` their slots in shared memory,
    ``ready`` and ``free`` their barriers (`ring_barriers`)."""

    refs: tuple
    tiles: tuple
    ready: tuple
    free: tuple

    def produce(self, *, b, h_kv, first, steps, block_k: int, num_stages: int, done=0, extra=(), each=None):
        """The producer's part (`produce`, which ``done`` and ``each`` are passed to): key
        tiles ``first`` to ``first + steps - 1`` of batch element ``b`` and kv head ``h_kv``,
        and the ``extra`` streams (`dense_stream`)."""

        def source(ref):
            return lambda s: rows_of(ref, b, pl.ds((first + s) * block_k, block_k), h_kv)

        streams = [Stream(source(ref), *ring) for ref, *ring in zip(*self, strict=True)]
        produce(steps, num_stages, [*streams, *extra], done, each)

    def step_ids(self, slot, masked: bool):
        """`step_ids` of the keys' stream (None without segment ids)."""
        return _last_ids(self, 2, slot, masked)


class QueryRing(NamedTuple):
    """The ring of the dK/dV kernel, whose consumers visit query tiles: the streams of Q
    and dO ``[batch, q_len, heads, dim]``, the base-2 lse and D ``[batch, heads,
    q_len]`` and, when the call has segment ids, the queries' ids ``[batch, q_len]``;
    as `KeyRing`."""

    refs: tuple
    tiles: tuple
    ready: tuple
    free: tuple

    def produce(self, *, step: Callable, steps, block_q: int, num_stages: int, extra=()):
        """The producer's part: ``steps`` query tiles in this program's batch element, step
        ``s`` taking ``step(s) = (head, tile)`` (`query_step`), and the ``extra`` streams
        (`dense_stream`)."""
        b = lax.axis_index("batch")

        def source(ref):
            def tile(s):
                h, i = step(s)
                return rows_of(ref, b, pl.ds(i * block_q, block_q), h)

            return tile

        streams = [Stream(source(ref), *ring) for ref, *ring in zip(*self, strict=True)]
        produce(steps, num_stages, [*streams, *extra])

    def step_ids(self, slot, masked: bool):
        """`step_ids` of the queries' stream (None without segment ids)."""
        return _last_ids(self, 4, slot, masked)


def query_step(s, *, first, per_head, head0):
    """``(head, query tile)`` of step ``s`` of a dK/dV program that visits query tiles
    ``first`` to ``first + per_head - 1`` of each head from ``head0`` in turn."""
    g = lax.div(jnp.asarray(s, jnp.int32), per_head)
    return head0 + g, first + s - g * per_head


def _last_ids(ring, operands: int, slot, masked: bool):
    """`step_ids` of a ring whose stream after its ``operands`` is the segment ids, laid
    along the columns (None where the ring has no such stream)."""
    if len(ring.refs) == operands:
        return None
    return step_ids((ring.tiles[operands], ring.ready[operands], ring.free[operands]), slot, masked)


def ring_barriers(tiles, consumers: int = CONSUMERS):
    """The ready barriers and the free barriers (one arrival per consumer) of a ring's
    streams, ``tiles`` being their ``[num_stages, ...]`` slots."""
    ready = tuple(plgpu.Barrier(num_barriers=t.shape[0]) for t in tiles)
    free = tuple(plgpu.Barrier(num_arrivals=consumers, num_barriers=t.shape[0]) for t in tiles)
    return ready, free


def launch(kernel, operands, out_type, grid, grid_names, scratch):
    """Runs ``kernel(*operands, *outputs, scoped)`` on ``grid`` with `CONSUMERS` consumer
    warpgroups and a producer (the ``"wg"`` axis), ``scoped`` being the shared-memory
    ``scratch`` (a tuple of `pl.run_scoped`'s arguments)."""

    def entry(*refs):
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), *scratch, collective_axes="wg")

    return plgpu.kernel(
        entry,
        out_type=out_type,
        grid=grid,
        grid_names=grid_names,
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(*operands)
