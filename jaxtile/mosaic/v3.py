"""``implementation="mosaic_v3"``: FlashAttention-3 as Pallas Mosaic GPU kernels.

Shah et al. (2024), Algorithm 1 (forward with warp specialisation and ping-pong
scheduling), for Hopper GPUs (sm_90). A program runs one (query tile, batch, head), or
with persistent programs (`Tuning.persistent`, `_ring.Schedule`) several in turn, on
three warpgroups:

* a producer, which issues TMA copies of the key tiles ``K_j`` and value tiles ``V_j``
  the mask lets the query tile see (`MaskSpec.kv_spans`) into a ring of
  ``num_stages`` shared-memory slots, each guarded by a "ready" and a "free" barrier;
* two consumers, each owning ``block_q`` rows of the tile (the 64-row multiple that one
  ``wgmma`` computes), which form ``S = Q Kᵀ`` and ``O += P V`` with ``wgmma`` and take
  turns on the tensor cores: one's softmax runs while the other's products do (the
  "turn" barrier, Algorithm 1's ping-pong). Both visit the same key tiles, those of
  their union, so the producer's ring serves them in one order.

The online softmax is base 2, as in the Triton kernels (`jaxtile._softmax`); only the
tiles that `kv_spans` marks masked pay for the element-wise mask (`MaskSpec.visible`).
With segment ids (packed documents), lengths or a dense mask the spans come from the
tile bounds they give (`MaskSpec.tile_bounds`); the rows' ids are loaded once and the
keys' ride the ring, the lengths are read once, and the dense mask's tiles (int8) ride
the ring on the masked steps alone; a bias's tiles ride it on every step. A dense mask
that reads as causal (Flax's) runs as ``causal=True``
(`registry.Implementation.recognises_masks`). Rows that see no key give an output of 0
and an lse of ``-inf``.

The backward pass recomputes attention from the lse this forward saves, in the two
kernels of `jaxtile.mosaic.backward` where their tiles fit (every head dim up to 256 at
the default tiles; up to 128 with a bias, `_backward_tuning`), else in the Triton
family's (`jaxtile.triton.v2`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu  # the Pallas API of jax 0.10.2 to 0.12

from jaxtile import _softmax as sm
from jaxtile import registry
from jaxtile._core import Config, Inputs, Shape, bias_grad_dtype, pad_to
from jaxtile.mask import MaskSpec
from jaxtile.mosaic import _ring
from jaxtile.mosaic._ring import BLOCK_SHARED_MEMORY, CONSUMERS, WGMMA_ROWS, along, padded, smem
from jaxtile.mosaic.backward import BackwardTuning, backward_pass, backward_temporaries, default_backward_tuning
from jaxtile.triton import v2 as triton_v2

# The output through slots (`Tuning.output_slots`): two per consumer, of 64 columns (128
# bytes of 16-bit elements, one swizzle's width), as tokamax 0.0.17's epilogue has them:
# at head dim 256 a quarter of the output's whole tile, which leaves a persistent
# program room for a two-stage ring of 64-key tiles (936 bytes to spare).
OUTPUT_SLOTS, OUTPUT_COLUMNS = 2, 64


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Launch parameters of the kernels.

    block_q: query rows per consumer warpgroup (a program covers ``2 * block_q``).
    block_k: keys per tile of the producer's ring.
    num_stages: slots of the ring (key/value tiles in flight).
    persistent: one program per multiprocessor, each running query tiles in turn
      (`_ring.Schedule`), rather than one program per query tile; its output takes a
      tile of shared memory of its own.
    output_slots: the output leaves through `OUTPUT_SLOTS` tiles of `OUTPUT_COLUMNS`
      columns per consumer, each reused once its copy out has been read, rather than
      through one tile of the whole head dim (`output_tile`): room for persistent
      programs where that tile leaves none (head dim 256).
    backward: the backward kernels' (`jaxtile.mosaic.backward`); None for
      `default_backward_tuning` of the call's head dims.
    """

    block_q: int = 64
    block_k: int = 128
    num_stages: int = 2
    persistent: bool = False
    output_slots: bool = False
    backward: BackwardTuning | None = None

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            block = getattr(self, name)
            if not isinstance(block, int) or block <= 0 or block % WGMMA_ROWS:
                raise ValueError(f"{name}={block!r} must be a positive multiple of {WGMMA_ROWS}")
        if not isinstance(self.num_stages, int) or self.num_stages < 2:
            raise ValueError(f"num_stages={self.num_stages!r} must be an int >= 2")
        for name in ("persistent", "output_slots"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")

    def backward_for(self, head_dim: int, head_dim_v: int, masks_elements: bool = False) -> BackwardTuning:
        """`backward`, or `default_backward_tuning` of these (padded) head dims and mask
        (`MaskSpec.masks_elements`)."""
        return self.backward or default_backward_tuning(head_dim, head_dim_v, masks_elements)

    def shared_memory(self, head_dim: int, head_dim_v: int, itemsize: int, beside: Beside | None = None) -> int:
        """The forward's shared memory as Mosaic GPU counts it (`_ring.mosaic_bytes`): the
        query (and output) tiles, the ring of K, V and the tiles ``beside`` them (at most
        two of scores: a dense mask's, a bias's), the queries' own segment ids, and the
        barriers of all of them."""
        beside = beside or Beside()
        rows, stages, block_k = CONSUMERS * self.block_q, self.num_stages, self.block_k
        tiles = [
            rows * head_dim * itemsize,
            stages * block_k * head_dim * itemsize,
            stages * block_k * head_dim_v * itemsize,
        ]
        if self.own_output(head_dim, head_dim_v):
            tiles.append(CONSUMERS * math.prod(self.output_tile(head_dim_v)) * itemsize)
        tiles += [
            stages * rows * block_k * beside.score_bytes,
            stages * block_k * beside.key_bytes,
            rows * beside.key_bytes,
        ]
        # Streams of scores: a bias alone counts as two (32 bytes over, at two stages).
        own, streams = 1 + (beside.key_bytes > 0), 2 + (beside.key_bytes > 0) + min(beside.score_bytes, 2)
        return _ring.mosaic_bytes([t for t in tiles if t], CONSUMERS * own + 2 * stages * streams + 1)

    def own_output(self, head_dim: int, head_dim_v: int) -> bool:
        """Whether the output has a tile (or slots) of its own rather than the queries'."""
        return self.persistent or self.output_slots or head_dim_v != head_dim

    def output_tile(self, head_dim_v: int) -> tuple[int, ...]:
        """A consumer's own output tile: ``[slots, block_q, OUTPUT_COLUMNS]`` with
        `output_slots` (as many slots as the head dim has columns for, at most
        `OUTPUT_SLOTS`), else ``[block_q, head_dim_v]``."""
        if self.output_slots:
            return min(OUTPUT_SLOTS, head_dim_v // OUTPUT_COLUMNS), self.block_q, OUTPUT_COLUMNS
        return self.block_q, head_dim_v

    def fit(self, head_dim: int, head_dim_v: int, itemsize: int, beside: Beside | None = None) -> Tuning:
        """This tuning, or, where it does not fit in shared memory (`shared_memory`), the
        nearest that does: fewer stages first (down to 2), then the persistent output
        through slots, then not persistent (nor slots), then halved key tiles, then query
        tiles (down to 64)."""
        tuning = self
        while tuning.shared_memory(head_dim, head_dim_v, itemsize, beside) > BLOCK_SHARED_MEMORY:
            if tuning.num_stages > 2:
                tuning = dataclasses.replace(tuning, num_stages=tuning.num_stages - 1)
            elif tuning.persistent and not tuning.output_slots:
                tuning = dataclasses.replace(tuning, output_slots=True)
            elif tuning.persistent or tuning.output_slots:
                tuning = dataclasses.replace(tuning, persistent=False, output_slots=False)
            elif tuning.block_k > WGMMA_ROWS:
                tuning = dataclasses.replace(tuning, block_k=padded(tuning.block_k // 2, WGMMA_ROWS))
            elif tuning.block_q > WGMMA_ROWS:
                tuning = dataclasses.replace(tuning, block_q=padded(tuning.block_q // 2, WGMMA_ROWS))
            else:
                break  # the smallest tiles: head dims up to 256 fit
        return tuning


# Causal masks over at most this many keys take key tiles of at most 128 where 256 would
# fit: a query tile sees too few of a 256-key tile's keys (head dim 64 on an H100,
# `bench/results/h100/tune_d64_causal/`: 1K 218 -> 248 TFLOP/s, 4K 385 -> 390; at 16K
# the 256-key tiles win, 485 against 467).
_SHORT_CAUSAL = 4096

# Head dim 128 with nothing bounding the keys a query sees (no causal mask, window, lengths
# or element masks) takes 192-key tiles from this many keys on: one program per query tile
# (a 192-key ring leaves no room for the persistent output's tile), the keys padded to a
# multiple of 192; no spills (ptxas: 168 registers). H100, against the persistent 128-key
# default, beside cuDNN (`bench/results/fwd_block_k/`): 8K 1.02x (cuDNN 0.99x -> 1.00x),
# 16K 1.04-1.06x, 32K 1.07-1.08x, GQA 32:8 at 16K 1.06-1.07x; 4K 0.90x.
_WIDE_KEYS = 8192


# Persistent programs where every query tile visits at most this many keys and no runtime
# part of the mask decides single elements (H100, `bench/results/h100/persistent/`,
# against one program per tile: causal 1K and 2K 1.04-1.12x, the (1023, 0) window 1.06x,
# the (256, 256) window 1.05-1.08x, non-causal 1K and 2K 0.99-1.03x; causal 4K
# 0.97-1.01x, causal 16K 0.95x, non-causal 4K and 16K 0.94-0.97x, packed documents
# 0.75x). With lengths the programs take the tiles heaviest first (H200,
# `bench/results/h200/lengths/`: ragged lengths over 1K and 2K keys 1.11-1.28x, over 4K
# 1.14-1.16x, over 16K 0.95x; lengths that are the whole sequences, 2K 0.86-0.91x, 4K
# 0.93x; batch element by batch element, 0.73-0.99x). Over more keys, masks with no left
# bound (none, causal) and no lengths take persistent programs too, in rounds of whole
# heads' query tiles (`_queries_first`; H200, head dim 128, 4K and 8K keys,
# `bench/results/h200/tile_costs/`: 1.03x one program per tile, where rounds of every
# head's tiles ran 0.98x; causal, `bench/results/h200/causal_order/`: 4K 1.06x, 16K
# 1.00-1.01x, where rounds of every head's tiles ran 0.97x at 16K; against 15a5c27,
# `bench/results/h200/persistent_order/`: 0.99-1.04x, and head dim 128, causal 4K 0.94x
# and then 1.04x, within that row's spread between runs).
_PERSISTENT_KEYS = 2048


# Persistent programs are dealt their tiles on the host (`_ring.Schedule.dealt`) only
# where that leaves the busiest program more than this many key tiles (`_key_tiles`) fewer
# than rounds would: dealing costs about that much that the count misses (H100, forward,
# dealt against rounds in one process, `bench/results/dealt/`: causal 16K, head dim 64
# and 128, 32 and 27 key tiles fewer, 1.07x and 1.01x; sinks, GQA 64:8, causal 8K, 17
# fewer, 1.05x; causal 1K, 4 and 1 fewer, 0.98-0.99x; dealt heaviest first within
# stretches, 821fbf3: head dim 128 causal 4K, 8 fewer, 1.03x).
_DEALING = 6


def _persistent(spec: MaskSpec | None, rows: int) -> bool:
    """Whether ``spec``'s query tiles of ``rows`` rows each visit at most
    `_PERSISTENT_KEYS` keys, or take persistent programs over more (`_queries_first`),
    the mask having no segment ids and no dense mask (with lengths, the programs take the
    tiles heaviest first: `_schedule`)."""
    if spec is None or spec.masks_elements:
        return False
    return _keys(spec, rows) <= _PERSISTENT_KEYS or _queries_first(spec, rows)


def _keys(spec: MaskSpec, rows: int) -> int:
    """The most keys one of ``spec``'s query tiles of ``rows`` rows visits."""
    if spec.left is None or spec.right is None:
        return spec.kv_len
    return min(spec.kv_len, spec.left + spec.right + rows)


def _queries_first(spec: MaskSpec, rows: int) -> bool:
    """Whether ``spec``'s persistent programs take the query tiles fastest (a round holds
    whole heads' tiles, which read the same K and V): where its query tiles of ``rows``
    rows visit more than `_PERSISTENT_KEYS` keys with no left bound and no lengths."""
    return spec.left is None and not spec.has_lengths and _keys(spec, rows) > _PERSISTENT_KEYS


class Beside(NamedTuple):
    """What rides the forward's ring beside K and V: bytes per score (a dense mask's int8
    and a bias's) and per key (a segment id's int32, which the queries' own rows hold
    too)."""

    score_bytes: int = 0
    key_bytes: int = 0

    @classmethod
    def of(cls, spec: MaskSpec | None, bias_itemsize: int = 0) -> Beside:
        """Of ``spec``'s mask and a bias of ``bias_itemsize`` bytes (0: none)."""
        has = spec is not None
        return cls(int(has and spec.has_dense_mask) + bias_itemsize, 4 * int(has and spec.has_segments))


def default_tuning(
    head_dim: int,
    head_dim_v: int,
    itemsize: int,
    spec: MaskSpec | None = None,
    bias_itemsize: int = 0,
    group: int = 1,
) -> Tuning:
    """The largest key tile (256, 128 or 64; at most 128 for causal masks over at most
    `_SHORT_CAUSAL` keys, where `MaskSpec.masks_elements` and with a bias of
    ``bias_itemsize`` bytes) whose two-stage ring fits beside the queries (and the
    backward's default, `Tuning.backward_for`); persistent programs where `_persistent`
    says and they fit, through output slots where they need them, except in rounds of
    whole heads (`_queries_first`) whose query heads do not share K and V (``group``
    query heads per kv head of 1)."""
    short_causal = spec is not None and spec.right == 0 and spec.kv_len <= _SHORT_CAUSAL
    # A consumer holds its part of a masked tile's mask beside its scores: with 256-key
    # tiles that spills (752 bytes at head dim 64, none at 128; H100, Flax's causal mask
    # at head dim 64, 4K: 0.73x cuDNN against 0.89x, `bench/results/h100/dense_mask/`).
    # Segment ids too (H200, head dim 64, `bench/results/h200/documents/`): in 128-key
    # tiles packed causal documents ran at 0.72-0.94x the same documents as separate
    # sequences against 0.28-0.89x in 256, uneven ones 1.06-2.8x as fast; only documents
    # on tile edges without a causal mask, which mask no tile, lost (0.93x against 1.02x).
    # A bias tile is held beside the scores as the mask is.
    beside = Beside.of(spec, bias_itemsize)
    narrow = short_causal or (spec is not None and spec.masks_elements) or bias_itemsize > 0
    if (
        not narrow
        and head_dim == head_dim_v == 128
        and spec is not None
        and spec.sees_every_key
        and spec.kv_len >= _WIDE_KEYS
    ):
        return Tuning(block_k=192).fit(head_dim, head_dim_v, itemsize, beside)
    tuning = Tuning(block_k=64)
    for block_k in (128, 64) if narrow else (256, 128, 64):
        tuning = Tuning(block_k=block_k)
        if (
            block_k * (head_dim + head_dim_v) <= 256 * 128
            and tuning.shared_memory(head_dim, head_dim_v, itemsize, beside) <= BLOCK_SHARED_MEMORY
        ):
            break
    rows = CONSUMERS * tuning.block_q
    tuning = dataclasses.replace(tuning, persistent=_persistent(spec, rows)).fit(head_dim, head_dim_v, itemsize, beside)
    # Persistent programs whose output takes slots (head dim 256, H100, forward, against
    # one program per tile in one process, `bench/results/output_slots/`): MQA 16:1
    # causal 4K 1.23x, GQA 16:4 causal 8K 1.09x, causal 1K 1.16-1.18x, the (256, 256)
    # window at 16K 1.01-1.02x, non-causal MQA 16:1 and GQA 16:4 0.97-1.01x; but in
    # rounds of whole heads of their own K and V, causal 8K 0.98-1.00x (16K 0.97-0.98x,
    # non-causal 4K and 16K 0.99-1.00x on the first build, NOTES.md).
    if tuning.output_slots and group == 1 and _queries_first(spec, rows):
        return dataclasses.replace(tuning, persistent=False, output_slots=False)
    return tuning


@functools.cache
def _hopper() -> bool:
    """Whether this machine's GPUs are all Hopper (sm_90), whose ``wgmma`` and TMA the
    kernel issues."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:  # no GPU backend
        return False
    return all(getattr(d, "compute_capability", None) == "9.0" for d in devices)


def _head_dims(head_dim: int, head_dim_v: int, itemsize: int, beside: Beside | None = None) -> tuple[int, int]:
    """The forward's head dims: padded to multiples of 64, and both to the larger where
    the output's tile of its own (`Tuning.own_output`) leaves no room for the smallest
    ring (256 and 192, either way round, beside tiles of a mask or a bias), so that the
    output goes through the queries' tile; the padded columns are zeros, which add
    nothing to the scores and are dropped from the output."""
    head_dim, head_dim_v = padded(head_dim, WGMMA_ROWS), padded(head_dim_v, WGMMA_ROWS)
    if Tuning(block_k=WGMMA_ROWS).shared_memory(head_dim, head_dim_v, itemsize, beside) > BLOCK_SHARED_MEMORY:
        head_dim = head_dim_v = max(head_dim, head_dim_v)
    return head_dim, head_dim_v


def _requires(platform: str) -> str | None:
    return None if _hopper() else f"needs Hopper GPUs (sm_90) on {platform}"


def _kernel(
    *refs, spec: MaskSpec, logits: sm.Logits, dims: Shape, tuning: Tuning, schedule: _ring.Schedule, sinks: bool
):
    """Algorithm 1 for the (query tile, batch, head) tiles of this program (`Schedule`):
    the producer's and both consumers' parts, chosen by the warpgroup index. ``refs``: q,
    k, v, the bias (`_ring.bias_operand`), the sinks in base 2 (``[heads]``), the runtime
    parts of the mask (`_ring.runtime_operands`), each where the call has it, the
    schedule's operand (`_schedule`) where it has one, out, lse and the shared memory."""
    q_ref, k_ref, v_ref, *runtime, o_ref, lse_ref, scoped = refs
    bias_ref = runtime.pop(0) if logits.bias else None
    sinks_ref = runtime.pop(0) if sinks else None
    schedule_ref = runtime.pop() if schedule.ordered or schedule.plan is not None else None
    ids, lengths_ref, dense_ref, bounds_ref = _ring.runtime_refs(spec, runtime)
    (own, ring, o_smem), (own_ready, ready, free), turn = scoped
    bias_ring = (ring[-1], ready[-1], free[-1]) if logits.bias else None
    (k_smem, v_smem, *_), (k_ready, v_ready, *_), (k_free, v_free, *_) = ring, ready, free
    keys, dense_ring = _ring.split_ring(_ring.KeyRing, (k_ref, v_ref, *ids[1:]), ring, ready, free, spec)
    bq, bk, stages = tuning.block_q, tuning.block_k, tuning.num_stages
    rows = CONSUMERS * bq
    wg = lax.axis_index("wg")
    persistent = schedule.programs is not None

    def tile(i):
        """``(head, query tile, batch)`` of this program's ``i``-th tile, and its key spans."""
        h, t, b = schedule.index(i, schedule_ref)
        if not schedule.ordered:
            t = _ring.query_tile(spec, schedule.tiles[1], t)
        return (h, t, b), *_ring.key_spans(spec, rows, bk, t, b, bounds_ref, h)

    def take_turn():
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(_ring.CONSUMER_REGISTERS, action="increase")

        def load_q(i):
            # Line 4 (consumer): load Q_i (and the rows' segment ids).
            (h, t, b), *_ = tile(i)
            sources = [_ring.rows_of(ref, b, pl.ds(t * rows + wg * bq, bq), h) for ref in (q_ref, *ids[:1])]
            _ring.copy_own(sources, own, own_ready, wg)

        def run(i, done):
            (h, t, b), spans, first, steps = tile(i)
            row0 = t * rows + wg * bq

            def load_next():
                pl.when(i + 1 < schedule.count(schedule_ref))(functools.partial(load_q, i + 1))

            if not persistent:
                load_q(i)
            _ring.wait_own(own_ready, wg)
            q_tile = own[0].at[wg]
            q_segment = _ring.load_stat(own[1].at[wg], 0) if spec.has_segments else None
            lengths = _ring.read_lengths(lengths_ref, b)
            # Line 4: O_i = 0, l_i = 0, m_i = -inf; a sink is the rows' first logit, with
            # value 0 (m_i = sink, l_i = 1; l_i = 0 for a sink of -inf).
            m_0, l_0 = -jnp.inf, 0.0
            if sinks_ref is not None:
                m_0 = sinks_ref[h]
                l_0 = jnp.where(m_0 == -jnp.inf, 0.0, 1.0)
            row_layout = plgpu.Layout.WGMMA.reduce(1)
            carry = (
                plgpu.layout_cast(jnp.zeros((bq, dims.head_dim_v), jnp.float32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((bq,), m_0, jnp.float32), row_layout),
                plgpu.layout_cast(jnp.full((bq,), l_0, jnp.float32), row_layout),
            )

            def slot_of(s):
                return lax.rem(jnp.asarray(done + s, jnp.int32), jnp.int32(stages))

            @pl.when(steps > 0)
            def _():
                plgpu.barrier_wait(k_ready.at[slot_of(0)])

            pl.when(wg == 1)(take_turn)  # the second consumer starts half a step behind

            def step(masked: bool, j, carry):
                acc, m_i, l_i = carry
                s = j - first
                slot = slot_of(s)

                # Lines 7-8: S_ij = Q_i K_jᵀ; hand the tensor cores to the other consumer.
                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_tile, k_smem.at[slot].transpose((1, 0)))
                    take_turn()
                    return acc_ref[...]

                scores = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
                if persistent:  # Q_i is read no more: load the next tile's under this step
                    pl.when(s + 1 == steps)(load_next)
                pre = logits.pre(scores, _ring.step_bias(bias_ring, slot, wg * bq, bq))  # the bias rides the ring
                plgpu.barrier_arrive(k_free.at[slot])
                kv_segment = keys.step_ids(slot, masked)  # the keys' ids ride the ring, as the dense mask
                dense = _ring.step_dense(dense_ring, slot, masked, wg * bq, bq)
                if masked:
                    runtime = dict(lengths=lengths, own_ids=q_segment, step_ids=kv_segment, dense=dense)
                    pre = jnp.where(_ring.visible(spec, (row0, j * bk), pre.shape, 0, **runtime), pre, -jnp.inf)
                # Lines 9-10: online softmax in base 2 (a row that has seen nothing, masked
                # or by a bias of -inf, keeps m_i = -inf; its base is 0 so that no -inf -
                # -inf is formed).
                m_new = jnp.maximum(m_i, pre.max(axis=1) * logits.factor)
                m_base = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked or logits.bias else m_new
                p = jnp.exp2(pre * logits.factor - along(m_base, pre.shape, 0))
                alpha = jnp.exp2(m_i - m_base)
                acc = acc * along(alpha, acc.shape, 0)
                l_i = l_i * alpha + p.sum(axis=1)
                p = p.astype(q_ref.dtype)
                acc, l_i, m_new, p = lax.optimization_barrier((acc, l_i, m_new, p))
                plgpu.barrier_arrive(turn)  # softmax done
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_wait(turn)  # the tensor cores are ours again

                # Line 10: O_i += P_ij V_j; meanwhile wait for the next key tile.
                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p, v_smem.at[slot])

                    @pl.when(s + 1 < steps)
                    def _():
                        plgpu.barrier_wait(k_ready.at[slot_of(s + 1)])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            for span in spans:
                carry = lax.fori_loop(span.start, span.stop, functools.partial(step, span.masked), carry)
            pl.when(wg == 0)(take_turn)
            if persistent:  # a tile with no steps loads the next one's queries here
                pl.when(steps == 0)(load_next)
            acc, m_i, l_i = carry
            # Lines 12-13: O_i = diag(l_i)^-1 O_i, L_i = m_i + log2(l_i) (natural log out);
            # one reciprocal a row, where a division an element costs several instructions.
            empty = l_i == 0.0
            l_i = jnp.where(empty, 1.0, l_i)
            out = acc * along(1.0 / l_i, acc.shape, 0)
            lse = jnp.where(empty, -jnp.inf, (m_i + jnp.log2(l_i)) * sm.LN2)
            lse_ref.at[b, h, pl.ds(row0, bq)][...] = lse  # from registers: no tile of its own
            o_rows = o_ref.at[b, pl.ds(row0, bq), h]
            if tuning.output_slots:
                _through_slots(out, o_smem.at[wg], o_rows)
                return done + steps
            if persistent:  # the last tile's output has left shared memory
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_tile = q_tile if o_smem is None else o_smem.at[wg]  # the queries' tile, when it fits
            o_tile[...] = out.astype(o_ref.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_tile, o_rows)
            return done + steps

        if persistent:
            load_q(0)
        schedule.loop(run, schedule_ref)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(_ring.PRODUCER_REGISTERS, action="decrease")

        def run(i, done):
            (h, t, b), spans, first, steps = tile(i)
            h_kv = lax.div(h, jnp.int32(dims.group))
            where = dict(b=b, rows=pl.ds(t * rows, rows), cols=bk, step=lambda s: (h, first + s))
            extra = _ring.dense_stream(dense_ref, dense_ring, spans, **where)
            extra += _ring.bias_stream(bias_ref, bias_ring, **where)
            keys.produce(
                b=b, h_kv=h_kv, first=first, steps=steps, block_k=bk, num_stages=stages, done=done, extra=extra
            )
            return done + steps

        schedule.loop(run, schedule_ref)


def _through_slots(out, slots, o_rows):
    """Line 12's ``O_i`` (float32 ``[block_q, head_dim_v]``) to ``o_rows`` in global memory,
    `OUTPUT_COLUMNS` at a time through ``slots`` ``[slots, block_q, OUTPUT_COLUMNS]``
    (`Tuning.output_slots`). Slot ``c % slots`` takes columns ``c`` once its last copy
    out has been read: the copy ``slots`` copies back, in the order this consumer issues
    them, tile after tile where a tile's columns fill the slots evenly; elsewhere a tile's
    first waits for every copy."""
    count, _, columns = slots.shape
    chunks = out.shape[1] // columns
    for c in range(chunks):
        plgpu.wait_smem_to_gmem(count - 1 if c or chunks % count == 0 else 0, wait_read_only=True)
        slot = slots.at[c % count]
        slot[...] = out[:, c * columns : (c + 1) * columns].astype(o_rows.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(slot, o_rows.at[:, c * columns : (c + 1) * columns])


def _tuning(
    tuning,
    block_q: int | None,
    block_k: int | None,
    head_dim: int,
    head_dim_v: int,
    itemsize: int,
    spec: MaskSpec | None = None,
    bias_itemsize: int = 0,
    group: int = 1,
) -> Tuning:
    """``tuning`` (the user's, if it is a `Tuning`) or the default (of ``spec``'s mask, the
    bias and the query heads per kv head, where given), with the call's
    ``block_q``/``block_k`` rounded up to multiples of 64 (``block_q`` counts the rows of
    one consumer), made to fit in shared memory (`Tuning.fit`)."""
    if not isinstance(tuning, Tuning):
        tuning = default_tuning(head_dim, head_dim_v, itemsize, spec, bias_itemsize, group)
    blocks = {name: padded(b, WGMMA_ROWS) for name, b in (("block_q", block_q), ("block_k", block_k)) if b is not None}
    return dataclasses.replace(tuning, **blocks).fit(head_dim, head_dim_v, itemsize, Beside.of(spec, bias_itemsize))


def _key_tiles(spec: MaskSpec, q_tiles: int, rows: int, block_k: int) -> np.ndarray:
    """A tile's work for `Schedule.balanced`, by its grid index along the query tiles: the
    key tiles it visits where only positions mask them (`MaskSpec.kv_spans` of every
    query tile at once; segments and lengths visit fewer), plus one for what a tile costs
    besides its steps."""
    with jax.ensure_compile_time_eval():
        spans = spec.kv_spans(_ring.query_tile(spec, q_tiles, np.arange(q_tiles)), rows, block_k)
        return np.broadcast_to(np.asarray(spans[-1].stop) - np.asarray(spans[0].start) + 1, (q_tiles,))


def _schedule(spec: MaskSpec, tuning: Tuning, tiles: tuple[int, int, int], rows: int, bounds):
    """The forward's `_ring.Schedule` of ``tiles`` and its extra operands: one program per
    tile, or persistent programs; these balanced on the host (`_key_tiles`) where the mask
    has no runtime ``bounds`` (the query tiles fastest where `_queries_first`; where they
    are dealt, `_DEALING`, the plan is the one operand), else taking the tiles heaviest
    first in snaking rounds (`_ring.tile_order`, the one operand)."""
    if not tuning.persistent:
        return _ring.Schedule(tiles), ()
    if bounds is None:
        work = _key_tiles(spec, tiles[1], rows, tuning.block_k)
        schedule = _ring.Schedule.balanced(
            tiles, work, _ring.multiprocessors(), _queries_first(spec, rows), dealing=_DEALING
        )
        return schedule, schedule.operands()
    programs = min(_ring.multiprocessors(), math.prod(tiles))
    order = _ring.tile_order(spec, bounds, tiles[2], rows, tuning.block_k)
    return _ring.Schedule(tiles, programs, snake=True, ordered=True), (order,)


def _plan(inputs: Inputs, config: Config) -> tuple[int, int, Tuning, Beside]:
    """The forward's padded head dims (`_head_dims`), its `Tuning` and what rides its ring
    beside K and V (`Beside`)."""
    dims = Shape.of(inputs.q, inputs.k, inputs.v)
    bias_itemsize = 0 if inputs.bias is None else jnp.dtype(inputs.bias.dtype).itemsize
    beside = Beside.of(config.mask, bias_itemsize)
    head_dim, head_dim_v = _head_dims(dims.head_dim, dims.head_dim_v, dims.itemsize, beside)
    tuning = _tuning(
        config.tuning,
        config.block_q,
        config.block_k,
        head_dim,
        head_dim_v,
        dims.itemsize,
        config.mask,
        bias_itemsize,
        dims.group,
    )
    return head_dim, head_dim_v, tuning, beside


def forward_pass(inputs: Inputs, config: Config):
    """The forward kernel: ``out [batch, q_len, heads, head_dim_v]`` in the query's dtype
    and the natural-log ``lse [batch, heads, q_len]``. Head dims are zero-padded to
    multiples of 64, the queries to multiples of the tiles (the padded rows are dropped)
    and the keys only to multiples of `_ring.TILE_ROWS`: the last key tile's copy reads
    past them, and TMA fills what lies past the end with zeros (keys the mask hides), so
    any structured call runs. ``inputs.sinks`` are each row's first logit."""
    dims = Shape.of(inputs.q, inputs.k, inputs.v)
    head_dim, head_dim_v, tuning, _ = _plan(inputs, config)
    rows = CONSUMERS * tuning.block_q
    q_len, kv_len = padded(dims.q_len, rows), padded(dims.kv_len, tuning.block_k)
    q = pad_to(pad_to(inputs.q, 3, head_dim), 1, q_len)
    kv_rows = padded(dims.kv_len, _ring.TILE_ROWS)
    k = pad_to(pad_to(inputs.k, 3, head_dim), 1, kv_rows)
    v = pad_to(pad_to(inputs.v, 3, head_dim_v), 1, kv_rows)
    dims_p = dataclasses.replace(dims, q_len=q_len, kv_len=kv_len, head_dim=head_dim, head_dim_v=head_dim_v)
    tiles = (dims.num_heads, q_len // rows, dims.batch)
    runtime = _ring.runtime_operands(inputs, config.mask, q_len, kv_len, rows, tuning.block_k)
    schedule, scheduled = _schedule(config.mask, tuning, tiles, rows, _ring.runtime_refs(config.mask, runtime).bounds)
    bias = () if inputs.bias is None else (_ring.bias_operand(inputs.bias, config.mask, q_len, kv_len),)
    sinks = () if inputs.sinks is None else (inputs.sinks * sm.LOG2E,)
    kernel = functools.partial(
        _kernel,
        spec=config.mask,
        logits=config.logits,
        dims=dims_p,
        tuning=tuning,
        schedule=schedule,
        sinks=inputs.sinks is not None,
    )
    dtype = inputs.q.dtype
    bq, bk, stages = tuning.block_q, tuning.block_k, tuning.num_stages
    own = (smem(dtype, CONSUMERS, bq, head_dim), *_ring.segment_tiles(config.mask, CONSUMERS, bq))
    ring = (smem(dtype, stages, bk, head_dim), smem(dtype, stages, bk, head_dim_v))
    ring += _ring.segment_tiles(config.mask, stages, bk) + _ring.dense_tiles(config.mask, stages, rows, bk)
    ring += _ring.bias_tiles(inputs.bias, stages, rows, bk)
    out, lse = _ring.launch(
        kernel,
        (q, k, v, *bias, *sinks, *runtime, *scheduled),
        (
            jax.ShapeDtypeStruct((dims.batch, q_len, dims.num_heads, head_dim_v), dtype),
            jax.ShapeDtypeStruct((dims.batch, dims.num_heads, q_len), jnp.float32),
        ),
        schedule.grid,
        schedule.names,
        (
            (
                own,
                ring,
                smem(dtype, CONSUMERS, *tuning.output_tile(head_dim_v))
                if tuning.own_output(head_dim, head_dim_v)
                else None,
            ),
            (_ring.own_barriers(own), *_ring.ring_barriers(ring)),
            plgpu.Barrier(num_arrivals=CONSUMERS),
        ),
    )
    return out[:, : dims.q_len, :, : dims.head_dim_v], lse[:, :, : dims.q_len]


def _memory(shape: Shape, block_q: int | None, block_k: int | None, backward: bool) -> tuple[int, int]:
    """Residuals (the output and lse) and temporaries: padded copies (`_ring.padded_copies`),
    and in the backward pass the rows of D and the base-2 lse and, with shares of the
    query heads (`jaxtile.mosaic.backward`), the float32 parts of dK and dV. Tiles the
    backward kernels do not take send it to the Triton family's backward, and its model.
    The forward pads the queries to its tiles and the keys only to `_ring.TILE_ROWS`
    (`forward_pass`); the model has no mask, so it takes the tiles a call without one
    takes."""
    head_dim, head_dim_v = _head_dims(shape.head_dim, shape.head_dim_v, shape.itemsize)
    unmasked = MaskSpec.create(shape.q_len, shape.kv_len)
    tuning = _tuning(None, block_q, block_k, head_dim, head_dim_v, shape.itemsize, unmasked)
    q_len = padded(shape.q_len, CONSUMERS * tuning.block_q)
    forward = _ring.padded_copies(shape, q_len, padded(shape.kv_len, _ring.TILE_ROWS), head_dim, head_dim_v)
    if not backward:
        return 0, forward
    head_dim, head_dim_v = padded(shape.head_dim, WGMMA_ROWS), padded(shape.head_dim_v, WGMMA_ROWS)
    backward_tuning = tuning.backward_for(head_dim, head_dim_v)
    if not backward_tuning.fits(head_dim, head_dim_v, shape.itemsize):
        residuals, temporaries = triton_v2.IMPLEMENTATION.memory(shape, None, None, True)
        return residuals, max(forward, temporaries)
    residuals = shape.q_bytes(shape.head_dim_v) + shape.batch * shape.num_heads * shape.q_len * 4
    return residuals, max(forward, backward_temporaries(shape, backward_tuning))


def _triton(config: Config) -> Config:
    """``config`` for the Triton family's kernels: a tuning of this family's dropped (they
    take their table's), ``"autotune"`` kept."""
    return dataclasses.replace(config, tuning=None) if isinstance(config.tuning, Tuning) else config


def _bias_everywhere(inputs: Inputs) -> bool:
    """Whether the call's bias is given at every query and key (`_ring.bias_operand` would
    materialise one broadcast over either, which the Triton kernels read in place)."""
    dims = Shape.of(inputs.q, inputs.k, inputs.v)
    return inputs.bias.shape[2:] == (dims.q_len, dims.kv_len)


def _takes_bias(inputs: Inputs, config: Config) -> bool:
    """Whether the forward's ring takes the call's bias: one given everywhere
    (`_bias_everywhere`) whose ring fits beside the smallest tiles (at head dim 256, a
    16-bit bias alone)."""
    dims = Shape.of(inputs.q, inputs.k, inputs.v)
    if not _bias_everywhere(inputs):
        return False
    head_dim, head_dim_v, tuning, beside = _plan(inputs, config)
    return tuning.shared_memory(head_dim, head_dim_v, dims.itemsize, beside) <= BLOCK_SHARED_MEMORY


def _forward(inputs: Inputs, config: Config):
    """`forward_pass`, or the Triton family's forward (which takes the sinks too) for a
    bias it does not take (`_takes_bias`)."""
    if inputs.bias is not None and not _takes_bias(inputs, config):
        out, lse, _ = triton_v2.IMPLEMENTATION.forward(inputs, _triton(config))
    else:
        out, lse = forward_pass(inputs, config)
    return out, lse, lse


def _backward_tuning(inputs: Inputs, config: Config) -> BackwardTuning | None:
    """The Mosaic backward kernels' tuning for the call (the config's, or the default
    for its head dims and mask, `Tuning.backward_for`), or None where their tiles do not
    fit (`BackwardTuning.fits`: at the default tiles, every head dim up to 256, and up
    to 128 with a bias) or the bias is not given everywhere (`_bias_everywhere`)."""
    dims = Shape.of(inputs.q, inputs.k, inputs.v)
    head_dim, head_dim_v = padded(dims.head_dim, WGMMA_ROWS), padded(dims.head_dim_v, WGMMA_ROWS)
    bias = inputs.bias is not None
    tuning = (config.tuning if isinstance(config.tuning, Tuning) else Tuning()).backward_for(
        head_dim, head_dim_v, config.mask.masks_elements or bias
    )
    scores = {}
    if bias:
        if not _bias_everywhere(inputs):
            return None
        scores = dict(bias=jnp.dtype(inputs.bias.dtype).itemsize, bias_grad=jnp.dtype(bias_grad_dtype(inputs)).itemsize)
    return tuning if tuning.fits(head_dim, head_dim_v, dims.itemsize, config.mask.has_dense_mask, **scores) else None


def _backward(inputs: Inputs, out, lse, dout, dlse, config: Config):
    """The Mosaic backward kernels where they take the call (`_backward_tuning`), else the
    Triton family's (`_triton`); ``(dq, dk, dv, dbias)``."""
    tuning = _backward_tuning(inputs, config)
    if tuning is None:
        return triton_v2.IMPLEMENTATION.backward(inputs, out, lse, dout, dlse, _triton(config))
    return backward_pass(inputs, out, lse, dout, dlse, config, tuning)


IMPLEMENTATION = registry.register(
    registry.Implementation(
        name="mosaic_v3",
        summary="FlashAttention-3 as Pallas Mosaic GPU kernels (Hopper): forward, dK/dV, dQ",
        family="mosaic",
        algorithm="FlashAttention-3",
        forward=_forward,
        backward=_backward,
        memory=_memory,
        platforms=frozenset({"gpu"}),
        requires=_requires,
        dtypes=frozenset({"bfloat16", "float16"}),
        features=frozenset({"causal", "window", "segments", "dense_mask", "lengths", "gqa", "soft_cap", "bias"}),
        max_head_dim=256,
        power_of_two_blocks=True,
        # Flax's causal mask runs as causal=True, faster than read as a dense mask (H100,
        # head dim 64, 4K: forward+backward 0.92x cuDNN against 0.86x, with the dense
        # backward on the Mosaic kernels too; forward 0.94x against 0.91x;
        # `bench/results/h100/dense_mask/`).
        recognises_masks=True,
        lse_backward=True,
        # The sinks as each row's first logit, where after the kernel they cost a pass over
        # the output: 4.5% of the forward (H200, GQA 64:8, head dim 64, causal 8K;
        # bench/results/h200/sinks/).
        takes_sinks=True,
        tuning=Tuning,
        speed=55,
    )
)
