"""FlashAttention's backward pass as two Pallas Mosaic GPU kernels, for Hopper GPUs.

FlashAttention-2, Algorithm 2, split as FlashAttention-3 (Shah et al. 2024, §3.3) and
the Triton family (`jaxtile.triton.v2`) split it, so that nothing is accumulated across
programs (no atomics: bitwise deterministic):

* a dK/dV kernel: one program per (key tile, batch, kv head) holds ``K_j`` and ``V_j``
  and visits the query tiles that see them (`MaskSpec.q_spans`) of every query head of
  its group, accumulating ``dV_j += Pᵀ dO_i`` and ``dK_j += dSᵀ Q_i``;
* a dQ kernel: one program per (query tile, batch, head) visits the key tiles its rows
  see (`MaskSpec.kv_spans`), accumulating ``dQ_i += dS K_j``.

Each runs two consumer warpgroups (64 rows of the program's tile each, the rows one
``wgmma`` computes) fed by a producer warpgroup's ring of TMA copies (`_ring`). Past
head dim 128 the consumers divide the work by role instead (`_roles`). ``P`` is
recomputed from the forward's lse (base 2), ``D = rowsum(dO ∘ O)`` comes in
precomputed (line 4), and ``dS`` is taken to the logit, the scale multiplying dQ_i and
dK_j once when they are written. Only the spans marked masked pay for
``MaskSpec.visible``, and only they load a dense mask's tiles (dK/dV reads a transposed
copy; with a mask per head, a program visits the union of its group's spans).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu  # the Pallas API of jax 0.10.2 to 0.12

from jaxtile import _softmax as sm
from jaxtile._core import Config, Inputs, Shape, bias_grad_dtype, pad_to
from jaxtile.mask import MaskSpec, bounds_at
from jaxtile.mosaic import _ring
from jaxtile.mosaic._ring import CONSUMERS, SHARED_MEMORY, WGMMA_ROWS, along, padded, smem

# A consumer's float32 accumulators (dK_j and dV_j; dQ_i) and its two score tiles (S and
# dP, or their transposes), in registers per thread of 128: tiles past this spilled and
# lost 24-40% (128-row query tiles in dK/dV at head dim 128, 128-key tiles at head dim
# 64; `default_backward_tuning`'s measurements), while 192 ran at full speed.
_REGISTERS = 192
# The dK/dV kernel splits a kv head's query heads over programs below this many programs
# (four per SM of an H100: one runs per SM at a time, and causal masks make them uneven).
_MIN_PROGRAMS = 528


def _roles(head_dim: int, head_dim_v: int) -> bool:
    """Whether the kernels divide their work by role: past head dim 128, where a consumer
    cannot hold both ``dK_j`` and ``dV_j`` (256 registers at 256), the dK/dV kernel's two
    consumers share one key tile, the first accumulating ``dV_j`` and the second ``dK_j``
    (both form ``Sᵀ``: five products per pair of tiles, against four), and the dQ kernel
    shares its query tile between its two consumers, which take every other key tile (two
    query tiles would hold 256 KiB of ``Q_i``, ``dO_i`` and the ring)."""
    return max(head_dim, head_dim_v) > 2 * WGMMA_ROWS


def _tiles(roles: bool) -> int:
    """Tiles of rows per program of either kernel: one per consumer, or one with roles."""
    return 1 if roles else CONSUMERS


@dataclasses.dataclass(frozen=True)
class BackwardTuning:
    """Launch parameters of the backward kernels.

    block_q: query rows per consumer in the dQ kernel, and per ring tile in dK/dV.
    block_k: keys per consumer in dK/dV, and per ring tile in dQ unless ``dq_block_k``.
    num_stages: slots of each kernel's ring.
    dq_block_k: keys per ring tile in the dQ kernel (None: ``block_k``).
    """

    block_q: int = 64
    block_k: int = 64
    num_stages: int = 2
    dq_block_k: int | None = None

    def __post_init__(self):
        for name in ("block_q", "block_k", "dq_block_k"):
            block = getattr(self, name)
            if block is None and name == "dq_block_k":
                continue
            if not isinstance(block, int) or block <= 0 or block % WGMMA_ROWS:
                raise ValueError(f"{name}={block!r} must be a positive multiple of {WGMMA_ROWS}")
        if not isinstance(self.num_stages, int) or self.num_stages < 2:
            raise ValueError(f"num_stages={self.num_stages!r} must be an int >= 2")

    @property
    def dq_keys(self) -> int:
        """Keys per ring tile of the dQ kernel."""
        return self.dq_block_k or self.block_k

    def padded_lengths(self, q_len: int, kv_len: int) -> tuple[int, int]:
        """The sequence lengths padded to whole tiles of both kernels."""
        return padded(q_len, CONSUMERS * self.block_q), padded(kv_len, math.lcm(CONSUMERS * self.block_k, self.dq_keys))

    def shared_memory(
        self, head_dim: int, head_dim_v: int, itemsize: int, dense: bool = False, bias: int = 0, bias_grad: int = 0
    ) -> int:
        """Bytes of the larger kernel's tiles: the rows its programs own and its ring (with
        a ``dense`` mask, its int8 tiles of all the program's rows too, and with a bias its
        tiles of ``bias`` bytes a score); in dK/dV, the float32 parts of dK, dV of a share
        reuse the memory of both; in dQ, with a bias, two tiles of its gradient
        (``bias_grad`` bytes a score): the one each consumer writes from, and zeros."""
        roles = _roles(head_dim, head_dim_v)
        width = (head_dim + head_dim_v) * itemsize
        stats = 3 * 4  # L_i, D_i and a segment id per query row
        scores = int(dense) + bias
        keys = _tiles(roles) * self.block_k
        tiles = keys * width + self.num_stages * self.block_q * (width + stats + keys * scores)
        dkdv = max(tiles, keys * (head_dim + head_dim_v) * 4) + keys * 4  # the parts reuse the tiles
        own_rows = _tiles(roles) * self.block_q
        dq = own_rows * (width + stats + 2 * self.dq_keys * bias_grad)
        dq += self.num_stages * self.dq_keys * (width + 4 + own_rows * scores)
        return max(dkdv, dq)

    def registers(self, head_dim: int, head_dim_v: int) -> int:
        """Registers per consumer thread of the larger kernel's accumulators and score
        tiles (`_REGISTERS`); with roles, of the dK consumer (``dK_j``, ``Sᵀ``, ``dPᵀ``)
        or the dV consumer (``dV_j``, ``Sᵀ``)."""
        if _roles(head_dim, head_dim_v):
            dkdv = self.block_k * max(head_dim + 2 * self.block_q, head_dim_v + self.block_q)
        else:
            dkdv = self.block_k * (head_dim + head_dim_v + 2 * self.block_q)
        dq = self.block_q * (head_dim + 2 * self.dq_keys)
        return max(dkdv, dq) // 128

    def fits(
        self, head_dim: int, head_dim_v: int, itemsize: int, dense: bool = False, bias: int = 0, bias_grad: int = 0
    ) -> bool:
        """Whether both kernels' tiles fit in shared memory (`shared_memory`) and their
        accumulators and scores in `_REGISTERS`; with roles, whether each slot of the dQ
        kernel's ring serves one consumer (an even number of stages), and that the call
        has no bias (whose gradient the dQ kernel writes by rows, which roles share)."""
        roles = _roles(head_dim, head_dim_v)
        return (
            (not roles or (self.num_stages % CONSUMERS == 0 and not bias))
            and self.registers(head_dim, head_dim_v) <= _REGISTERS
            and self.shared_memory(head_dim, head_dim_v, itemsize, dense, bias, bias_grad) <= SHARED_MEMORY
        )


def default_backward_tuning(head_dim: int, head_dim_v: int, masks_elements: bool = False) -> BackwardTuning:
    """Query tiles of 128 rows where both head dims are at most 64 and no runtime array
    masks single elements (`MaskSpec.masks_elements`) and no bias is added to them (its
    callers pass ``masks_elements`` for either), else of 64, and the dQ kernel's
    key tiles as dK/dV's (measured by ``python -m bench.tune --impl mosaic_v3`` at 4K,
    fwd+bwd: at head dim 64, 128 rows are 5% faster non-causal on an H100 and 6% on an
    H200, causal 2% slower and 1% faster; at head dim 128 they are 24-40% slower on the
    H100; 128-key dQ tiles are 1-2% slower at head dims 64 and 128 on the H200;
    `bench/results/h100/tune_mosaic_1a4c1c8_dirty.json`,
    `bench/results/h200/tune_mosaic_3e15e08.json`, `tune_mosaic_ec9f9f7.json`). With a
    dense mask, each consumer holds its part of the mask's tile beside its scores: at
    head dim 64, 128-row tiles spilled 552 and 648 bytes (dK/dV, dQ) and 64-row ones
    none, and ran 1% slower (H100, `bench/results/h100/dense_mask/`). With segment ids
    at head dim 64, 64-row tiles ran packed documents' forward+backward 1.01-1.08x as
    fast (H200, `bench/results/h200/documents/docs_bwd_d64_63aa264.log`)."""
    wide = max(head_dim, head_dim_v) <= 64 and not masks_elements
    return BackwardTuning(block_q=128 if wide else 64)


def _scores_grad(p, dp, delta, pre, logits: sm.Logits, visible, axis: int):
    """Line 14: ``dS = P ∘ (dP - D)`` taken back to the logit ``scale · q·k (+ bias)``
    (`jaxtile._softmax.score_grad`; with a bias, its gradient), not to ``q·k``: the
    kernels multiply dQ_i and dK_j by the scale once, when they write them, instead of
    every score of every step. ``axis`` is the one ``D`` runs along (0: rows are
    queries, 1: columns are)."""
    return sm.score_grad(p, dp, along(delta, dp.shape, axis), pre, logits, visible, of_logit=True)


def _products(*products, meanwhile: Callable | None = None):
    """``acc + a @ b`` for each ``(acc, a, b)`` (``acc`` None: from zero), issued as one
    group of ``wgmma``s that is waited for once, after ``meanwhile()`` where given."""

    def issue(refs):
        for ref, (_, a, b) in zip(refs, products):
            plgpu.wgmma(ref, a, b)
        if meanwhile is not None:
            meanwhile()

    accs = []
    for acc, a, b in products:
        if acc is None:
            acc = plgpu.layout_cast(jnp.zeros((a.shape[0], b.shape[1]), jnp.float32), plgpu.Layout.WGMMA)
        accs.append(plgpu.ACC.init(acc))
    return pl.run_state(issue)(tuple(accs))


def _rounded(ds, dtype):
    """``dS`` rounded to ``dtype`` for ``wgmma`` (lines 15-16), and the factor per row its
    product must be multiplied by (None: 1). In float16, each row whose magnitude exceeds
    ``2**15`` is scaled to exactly that peak first (``|dS|`` can exceed float16's 65504
    where dQ and dK do not; the Triton kernels scale such rows by a power of two). Only
    the rows' factors are divided: a division per element costs several instructions
    where a product costs one."""
    if dtype != jnp.float16:
        return ds.astype(dtype), None
    peak = jnp.max(jnp.abs(ds), axis=1)
    scale = jnp.where(peak > 2.0**15, peak * 2.0**-15, 1.0)
    return (ds * along(1.0 / scale, ds.shape, 0)).astype(dtype), scale


def _accumulator(acc, scale):
    """What `_products` accumulates ``dS @ x`` into: ``acc`` itself, or with a scaled
    ``dS`` a fresh one (`_unscaled` adds it)."""
    return acc if scale is None else None


def _unscaled(acc, product, scale):
    return product if scale is None else acc + product * along(scale, product.shape, 0)


def _dq_kernel(*refs, spec: MaskSpec, logits, dims, tuning, roles: bool):
    """Line 15 for one (query tile of ``2 * block_q`` rows, or ``block_q`` with
    ``roles``, batch, head): ``dQ_i = Σ_j dS_ij K_j``, the producer streaming ``K_j`` and
    ``V_j`` (and with segment ids, the keys' ids; with a dense mask, its tiles on masked
    steps). With ``roles`` both consumers take the same rows and every other key tile
    (the ring's slots alternate between them), each summing its part of ``dQ_i``; the
    second's part reaches the first through shared memory once both are done, and is
    added in that order (deterministic).

    With a bias (never with ``roles``), its tiles ride the ring and the kernel writes
    its gradient, ``dS`` before the scale (`Logits.logit_grad`), tile by tile through
    shared memory; the producer writes zeros on the key tiles hidden from the rows of
    the mirror query tile (``q_tiles - 1 - t``: under a causal mask, about as many as
    this tile's steps), from a tile the consumers zero. ``refs``: the operands, the
    bias, the runtime parts of the mask the call has (`_ring.runtime_operands`), dq, the
    bias's gradient and the shared memory."""
    *refs, scoped = refs
    dbias_ref = refs.pop() if logits.bias else None
    q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, *runtime, dq_ref = refs
    bias_ref = runtime.pop(0) if logits.bias else None
    ids, lengths_ref, dense_ref, bounds_ref = _ring.runtime_refs(spec, runtime)
    (own, ring, grad), (own_ready, ready, free, done, handed, zeroed) = scoped
    ring, (part,) = ring if roles else (ring, (None,))
    bias_ring = (ring[-1], ready[-1], free[-1]) if logits.bias else None
    (k_smem, v_smem, *_), (k_ready, v_ready, *_), (k_free, v_free, *_) = ring, ready, free
    keys, dense_ring = _ring.split_ring(_ring.KeyRing, (k_ref, v_ref, *ids[1:]), ring, ready, free, spec)
    bq, bk, stages = tuning.block_q, tuning.dq_keys, tuning.num_stages
    rows = _tiles(roles) * bq
    q_tiles = dims.q_len // rows
    h, b, wg = lax.axis_index("heads"), lax.axis_index("batch"), lax.axis_index("wg")
    t = _ring.query_tile(spec, q_tiles, lax.axis_index("q_tiles"))
    spans, first, steps = _ring.key_spans(spec, rows, bk, t, b, bounds_ref, h)

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(_ring.CONSUMER_REGISTERS, action="increase")
        tile = lax.div(wg, jnp.int32(CONSUMERS // _tiles(roles)))  # with roles, both consumers' tile 0
        row0 = t * rows + tile * bq
        # Q_i, dO_i, L_i, D_i (and the rows' segment ids), loaded once.
        sources = (q_ref, do_ref, lse2_ref, delta_ref, *ids[:1])
        sources = [_ring.rows_of(ref, b, pl.ds(row0, bq), h) for ref in sources]
        copy = functools.partial(_ring.copy_own, sources, own, own_ready, tile)
        if roles:
            pl.when(wg == 0)(copy)
        else:
            copy()
        _ring.wait_own(own_ready, tile)
        q_i, do_i = own[0].at[tile], own[1].at[tile]
        lse2, delta = _ring.load_stat(own[2].at[tile], 0), _ring.load_stat(own[3].at[tile], 0)
        q_segment = _ring.load_stat(own[4].at[tile], 0) if spec.has_segments else None
        lengths = _ring.read_lengths(lengths_ref, b)
        if logits.bias:  # this consumer's rows of the producer's tile of zeros
            zeros = grad[1].at[pl.ds(tile * bq, bq)]
            zeros[...] = plgpu.layout_cast(jnp.zeros((bq, bk), zeros.dtype), plgpu.Layout.WGMMA)
            plgpu.commit_smem()
            plgpu.barrier_arrive(zeroed)

        def store_bias_grad(dlogit, j):
            """The bias's gradient of this step's tile, written through shared memory once
            the previous step's has been read out of it."""
            staging = grad[0].at[tile]
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            staging[...] = dlogit.astype(staging.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(staging, dbias_ref.at[b, h, pl.ds(row0, bq), pl.ds(j * bk, bk)])

        def step(masked: bool, j, dq_i):
            slot = lax.rem(j - first, jnp.int32(stages))
            k_j, v_j = k_smem.at[slot], v_smem.at[slot]
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_wait(v_ready.at[slot])
            # Lines 9-13: S_ij = Q_i K_jᵀ, dP_ij = dO_i V_jᵀ; P_ij = exp2(S_ij - L_i).
            scores, dp = _products((None, q_i, k_j.transpose((1, 0))), (None, do_i, v_j.transpose((1, 0))))
            plgpu.barrier_arrive(v_free.at[slot])
            pre = logits.pre(scores, _ring.step_bias(bias_ring, slot, tile * bq, bq))  # the bias rides the ring
            kv_segment = keys.step_ids(slot, masked)  # the keys' ids ride the ring, as the dense mask
            dense = _ring.step_dense(dense_ring, slot, masked, tile * bq, bq)
            p = jnp.exp2(pre * logits.factor - along(lse2, pre.shape, 0))
            visible = None
            if masked:
                runtime = dict(lengths=lengths, own_ids=q_segment, step_ids=kv_segment, dense=dense)
                visible = _ring.visible(spec, (row0, j * bk), pre.shape, 0, **runtime)
                p = jnp.where(visible, p, 0.0)
            ds = _scores_grad(p, dp, delta, pre, logits, visible, 0)
            # With a bias, dS is its gradient, written while the tensor cores take dQ's product.
            store = functools.partial(store_bias_grad, ds, j) if logits.bias else None
            ds, scale = _rounded(ds, k_ref.dtype)
            # Line 15: dQ_i += dS_ij K_j.
            (product,) = _products((_accumulator(dq_i, scale), ds, k_j), meanwhile=store)
            plgpu.barrier_arrive(k_free.at[slot])
            return _unscaled(dq_i, product, scale)

        def span_steps(span, dq_i):
            if not roles:
                return lax.fori_loop(span.start, span.stop, functools.partial(step, span.masked), dq_i)
            # This consumer's key tiles of the span: every other step from its own.
            start = span.start + lax.rem(wg + 2 - lax.rem(span.start - first, 2), 2)
            count = lax.div(jnp.maximum(span.stop - start + 1, 0), 2)
            return lax.fori_loop(0, count, lambda n, dq_i: step(span.masked, start + 2 * n, dq_i), dq_i)

        dq_i = plgpu.layout_cast(jnp.zeros((bq, dims.head_dim), jnp.float32), plgpu.Layout.WGMMA)
        for span in spans:
            dq_i = span_steps(span, dq_i)
        if roles:  # the ring is read no more: the second's part goes through its memory
            plgpu.barrier_arrive(done)
            plgpu.barrier_wait(done)

            @pl.when(wg == 1)
            def _hand_over():
                part[...] = dq_i
                plgpu.commit_smem()
                plgpu.barrier_arrive(handed)

        def write(dq_i):
            if roles:
                plgpu.barrier_wait(handed)
                dq_i = dq_i + _ring.load_tile(part)
            q_i[...] = (dq_i * logits.scale).astype(dq_ref.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_i, dq_ref.at[b, pl.ds(row0, bq), h])
            plgpu.wait_smem_to_gmem(0)

        if roles:
            pl.when(wg == 0)(functools.partial(write, dq_i))
        else:
            write(dq_i)

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(_ring.PRODUCER_REGISTERS, action="decrease")
        h_kv = lax.div(h, jnp.int32(dims.group))
        where = dict(b=b, rows=pl.ds(t * rows, rows), cols=bk, step=lambda s: (h, first + s))
        extra = _ring.dense_stream(dense_ref, dense_ring, spans, **where)
        extra += _ring.bias_stream(bias_ref, bias_ring, **where)
        if not logits.bias:
            keys.produce(b=b, h_kv=h_kv, first=first, steps=steps, block_k=bk, num_stages=stages, extra=extra)
            return
        # The mirror tile's hidden key tiles lie before and after its spans (contiguous).
        mirror = q_tiles - 1 - t
        _, mirror_first, mirror_steps = _ring.key_spans(spec, rows, bk, mirror, b, bounds_ref, h)
        hidden = dims.kv_len // bk - mirror_steps

        def zero(n):
            pl.when(jnp.asarray(n) == 0)(functools.partial(plgpu.barrier_wait, zeroed))
            j = jnp.where(n < mirror_first, n, n + mirror_steps)
            plgpu.copy_smem_to_gmem(grad[1], dbias_ref.at[b, h, pl.ds(mirror * rows, rows), pl.ds(j * bk, bk)])

        def each(s):  # one tile of zeros a step, the rest after the last
            pl.when(s < hidden)(functools.partial(zero, s))

        keys.produce(b=b, h_kv=h_kv, first=first, steps=steps, block_k=bk, num_stages=stages, extra=extra, each=each)
        pl.loop(steps, hidden)(zero)
        plgpu.wait_smem_to_gmem(0)


def _dkdv_kernel(*refs, spec: MaskSpec, logits, dims, tuning, splits: int, roles: bool):
    """Lines 6-18 for one (key tile of ``2 * block_k`` keys, or ``block_k`` with
    ``roles``, batch, kv head, share of its query heads), transposed: the producer
    streams ``Q_i``, ``dO_i``, ``L_i`` and ``D_i`` of each (head of the share, query
    tile) in turn. With several shares, each writes its float32 part of dK_j, dV_j
    through tiles that reuse the memory of K_j, V_j and the ring. ``refs``: the operands,
    the bias (whose tiles ride the ring as they lie, queries by keys, read transposed),
    the runtime parts of the mask the call has (`_ring.runtime_operands`, transposed; the
    queries' segment ids ride the ring, as the dense mask's tiles on masked steps, whose
    spans are those of every head of the group), dk, dv and the shared memory."""
    q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, *runtime, dk_ref, dv_ref, scoped = refs
    bias_ref = runtime.pop(0) if logits.bias else None
    ids, lengths_ref, dense_ref, bounds_ref = _ring.runtime_refs(spec, runtime)
    (memory, own_ids), (own_ready, consumed, ready, free) = scoped
    ((k_smem, v_smem), ring), (dk_smem, dv_smem) = memory if splits > 1 else (memory, memory[0])
    bias_ring = (ring[-1], ready[-1], free[-1]) if logits.bias else None
    (q_smem, do_smem, lse_smem, delta_smem, *_) = ring
    (q_ready, do_ready, lse_ready, delta_ready, *_), (q_free, do_free, lse_free, delta_free, *_) = ready, free
    streams = (q_ref, do_ref, lse2_ref, delta_ref, *ids[:1])
    queries, dense_ring = _ring.split_ring(_ring.QueryRing, streams, ring, ready, free, spec)
    bq, bk, stages = tuning.block_q, tuning.block_k, tuning.num_stages
    keys = _tiles(roles) * bk
    share, b, wg = lax.axis_index("shares"), lax.axis_index("batch"), lax.axis_index("wg")
    h_kv = lax.div(share, jnp.int32(splits))
    j = lax.axis_index("kv_tiles")
    spans = spec.q_spans(j, bq, keys, bounds_at(bounds_ref, j, b, h_kv))
    first, per_head = spans[0].start, jnp.int32(spans[-1].stop - spans[0].start)
    group = dims.group // splits
    query_step = functools.partial(_ring.query_step, first=first, per_head=per_head, head0=share * group)

    def consumer(role: str | None):
        """A consumer accumulating ``role`` ("dk", "dv"; None: both) of its key tile."""
        plgpu.set_max_registers(_ring.CONSUMER_REGISTERS, action="increase")
        tile = lax.div(wg, jnp.int32(CONSUMERS // _tiles(roles)))  # with roles, both consumers' tile 0
        key0 = j * keys + tile * bk
        # Lines 6-7: load K_j, V_j (and the keys' segment ids); dK_j = dV_j = 0.
        sources = [_ring.rows_of(ref, b, pl.ds(key0, bk), h_kv) for ref in (k_ref, v_ref, *ids[1:])]
        copy = functools.partial(_ring.copy_own, sources, (k_smem, v_smem, *own_ids), own_ready, tile)
        if roles:
            pl.when(wg == 0)(copy)
        else:
            copy()
        _ring.wait_own(own_ready, tile)
        k_j, v_j = k_smem.at[tile], v_smem.at[tile]
        kv_segment = _ring.load_stat(own_ids[0].at[tile], 0) if spec.has_segments else None
        lengths = _ring.read_lengths(lengths_ref, b)

        def step(g, masked: bool, i, carry):
            dk_j, dv_j = carry
            slot = lax.rem(g * per_head + i - first, jnp.int32(stages))
            q_i, do_i = q_smem.at[slot], do_smem.at[slot]
            plgpu.barrier_wait(q_ready.at[slot])
            plgpu.barrier_wait(do_ready.at[slot])
            # Lines 8-13, transposed: Sᵀ = K_j Q_iᵀ, dPᵀ = V_j dO_iᵀ; Pᵀ = exp2(Sᵀ - L_i).
            products = [(None, k_j, q_i.transpose((1, 0)))]
            if role != "dv":
                products.append((None, v_j, do_i.transpose((1, 0))))
            scores_t, *dp_t = _products(*products)
            pre_t = logits.pre(scores_t, _ring.step_bias(bias_ring, slot, tile * bk, bk, transposed=True))
            plgpu.barrier_wait(lse_ready.at[slot])
            lse2 = _ring.load_stat(lse_smem.at[slot], 1)
            plgpu.barrier_arrive(lse_free.at[slot])
            p_t = jnp.exp2(pre_t * logits.factor - along(lse2, pre_t.shape, 1))
            visible = None
            q_segment = queries.step_ids(slot, masked)  # the queries' ids ride the ring, as the dense mask
            dense = _ring.step_dense(dense_ring, slot, masked, tile * bk, bk)
            if masked:
                runtime = dict(lengths=lengths, own_ids=kv_segment, step_ids=q_segment, dense=dense)
                visible = _ring.visible(spec, (key0, i * bq), pre_t.shape, 1, **runtime)
                p_t = jnp.where(visible, p_t, 0.0)
            # The dV consumer waits for D_i too before freeing it: an arrival ahead of the
            # copy could complete the slot's phase for the dK consumer.
            plgpu.barrier_wait(delta_ready.at[slot])
            delta = None if role == "dv" else _ring.load_stat(delta_smem.at[slot], 1)
            plgpu.barrier_arrive(delta_free.at[slot])
            # Lines 12 and 16: dV_j += Pᵀ dO_i, dK_j += dSᵀ Q_i.
            products, scale = [], None
            if role != "dk":
                products.append((dv_j, p_t.astype(q_ref.dtype), do_i))
            if role != "dv":
                ds_t, scale = _rounded(_scores_grad(p_t, *dp_t, delta, pre_t, logits, visible, 1), q_ref.dtype)
                products.append((_accumulator(dk_j, scale), ds_t, q_i))
            results = _products(*products)
            plgpu.barrier_arrive(do_free.at[slot])
            plgpu.barrier_arrive(q_free.at[slot])
            dv_j = dv_j if role == "dk" else results[0]
            dk_j = dk_j if role == "dv" else _unscaled(dk_j, results[-1], scale)
            return dk_j, dv_j

        def one_head(g, carry):
            for span in spans:
                carry = lax.fori_loop(span.start, span.stop, functools.partial(step, g, span.masked), carry)
            return carry

        def zeros(head_dim, needed: bool):
            shape = (bk, head_dim)
            return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA) if needed else None

        init = (zeros(dims.head_dim, role != "dv"), zeros(dims.head_dim_v, role != "dk"))
        dk_j, dv_j = lax.fori_loop(jnp.int32(0), jnp.int32(group), one_head, init)
        # Line 18: write dK_j, dV_j once neither consumer reads K_j, V_j or the ring, where
        # the tiles they go through span both consumers' (a share's float32 parts; roles).
        if splits > 1 or roles:
            plgpu.barrier_arrive(consumed)
            plgpu.barrier_wait(consumed)
        dk_j = None if dk_j is None else dk_j * logits.scale  # dSᵀ was taken to the logit
        results = [(acc, out.at[tile], ref) for acc, out, ref in ((dk_j, dk_smem, dk_ref), (dv_j, dv_smem, dv_ref))]
        results = [result for result in results if result[0] is not None]
        for acc, out, ref in results:
            out[...] = acc.astype(ref.dtype)
        plgpu.commit_smem()
        for _, out, ref in results:
            plgpu.copy_smem_to_gmem(out, ref.at[b, pl.ds(key0, bk), share])
        plgpu.wait_smem_to_gmem(0)

    if roles:
        pl.when(wg == 0)(functools.partial(consumer, "dv"))
        pl.when(wg == 1)(functools.partial(consumer, "dk"))
    else:
        pl.when(wg < CONSUMERS)(functools.partial(consumer, None))

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(_ring.PRODUCER_REGISTERS, action="decrease")
        where = dict(b=b, rows=pl.ds(j * keys, keys), cols=bq, step=query_step)
        extra = _ring.dense_stream(dense_ref, dense_ring, spans, **where)
        extra += _ring.bias_stream(bias_ref, bias_ring, transposed=True, **where)
        queries.produce(step=query_step, steps=group * per_head, block_q=bq, num_stages=stages, extra=extra)


def _splits(dims: Shape, tuning: BackwardTuning) -> int:
    """Shares of a kv head's query heads in the dK/dV kernel (`Shape.head_shares`) at the
    padded ``dims``."""
    keys = _tiles(_roles(dims.head_dim, dims.head_dim_v)) * tuning.block_k
    return dims.head_shares(dims.kv_len // keys, _MIN_PROGRAMS)


def backward_temporaries(shape: Shape, tuning: BackwardTuning) -> int:
    """Bytes `backward_pass` holds besides its inputs and results: D and the base-2 lse (a
    float32 row each), zero-padded copies of the operands and gradients where the
    sequences or head dims are not multiples of the tiles, and with shares of the query
    heads (`Shape.head_shares`) the float32 parts of dK and dV."""
    head_dim, head_dim_v = padded(shape.head_dim, WGMMA_ROWS), padded(shape.head_dim_v, WGMMA_ROWS)
    q_len, kv_len = tuning.padded_lengths(shape.q_len, shape.kv_len)
    rows = 2 * shape.batch * shape.num_heads * q_len * 4
    copies = _ring.padded_copies(shape, q_len, kv_len, head_dim, head_dim_v)
    big = dataclasses.replace(shape, kv_len=kv_len, head_dim=head_dim, head_dim_v=head_dim_v)
    splits = _splits(big, tuning)
    parts = 0 if splits == 1 else splits * (big.kv_bytes(head_dim, 4) + big.kv_bytes(head_dim_v, 4))
    return rows + copies + parts


def backward_pass(inputs: Inputs, out, lse, dout, dlse, config: Config, tuning: BackwardTuning):
    """``(dq, dk, dv, dbias)`` of the structured call (`_core.Backward`; dbias None without
    a bias), from the forward's ``out`` and natural-log ``lse [batch, heads, q_len]`` and
    the cotangents of both. Head dims are zero-padded to multiples of 64 and sequences
    (and the bias) to the tiles; padded rows get an lse of ``+inf`` (no probability) and
    padded keys are masked."""
    dims = Shape.of(inputs.q, inputs.k, inputs.v)
    head_dim, head_dim_v = padded(dims.head_dim, WGMMA_ROWS), padded(dims.head_dim_v, WGMMA_ROWS)
    bq, bk, stages = tuning.block_q, tuning.block_k, tuning.num_stages
    q_len, kv_len = tuning.padded_lengths(dims.q_len, dims.kv_len)
    # Line 4: D_i = rowsum(dO_i ∘ O_i), less the lse's cotangent; L_i in base 2.
    delta = jnp.einsum("bthd,bthd->bht", dout.astype(jnp.float32), out.astype(jnp.float32)) - dlse
    lse2 = pad_to(sm.lse_base2(lse), 2, q_len, jnp.inf)
    delta = pad_to(delta, 2, q_len)
    q = pad_to(pad_to(inputs.q, 3, head_dim), 1, q_len)
    do = pad_to(pad_to(dout, 3, head_dim_v), 1, q_len)
    k = pad_to(pad_to(inputs.k, 3, head_dim), 1, kv_len)
    v = pad_to(pad_to(inputs.v, 3, head_dim_v), 1, kv_len)
    dims_p = dataclasses.replace(dims, q_len=q_len, kv_len=kv_len, head_dim=head_dim, head_dim_v=head_dim_v)
    statics = dict(spec=config.mask, logits=config.logits, dims=dims_p, tuning=tuning)
    dtype, mask = q.dtype, config.mask
    operands = (q, k, v, do, lse2, delta)
    if inputs.bias is not None:
        operands += (_ring.bias_operand(inputs.bias, mask, q_len, kv_len),)

    roles = _roles(head_dim, head_dim_v)
    tiles = _tiles(roles)

    def own_tiles(rows):  # the program's tiles of its rows: 2 dims (or heads)
        return (smem(dtype, tiles, rows, head_dim), smem(dtype, tiles, rows, head_dim_v))

    # dK/dV: the consumers' K_j, V_j (and the keys' ids); a ring of Q_i, dO_i, L_i, D_i
    # (and the queries' ids, the dense mask's tiles).
    splits = _splits(dims_p, tuning)
    shares = dims.num_kv_heads * splits
    own, own_ids = own_tiles(bk), _ring.segment_tiles(mask, tiles, bk)
    ring = (smem(dtype, stages, bq, head_dim), smem(dtype, stages, bq, head_dim_v))
    ring += (plgpu.SMEM((stages, bq), jnp.float32), plgpu.SMEM((stages, bq), jnp.float32))
    ring += _ring.segment_tiles(mask, stages, bq) + _ring.dense_tiles(mask, stages, tiles * bk, bq)
    ring += _ring.bias_tiles(inputs.bias, stages, bq, tiles * bk)
    memory = (own, ring)
    if splits > 1:  # float32 parts of dK, dV, summed below in a fixed order (deterministic)
        parts = (smem(jnp.float32, tiles, bk, head_dim), smem(jnp.float32, tiles, bk, head_dim_v))
        memory = plgpu.RefUnion(memory, parts)
    part = jnp.float32 if splits > 1 else dtype
    dk, dv = _ring.launch(
        functools.partial(_dkdv_kernel, splits=splits, roles=roles, **statics),
        (*operands, *_ring.runtime_operands(inputs, mask, q_len, kv_len, bq, tiles * bk, True)),
        tuple(jax.ShapeDtypeStruct((dims.batch, kv_len, shares, x.shape[-1]), part) for x in (k, v)),
        (shares, kv_len // (tiles * bk), dims.batch),  # heads fastest, as the forward's
        ("shares", "kv_tiles", "batch"),
        (
            (memory, own_ids),
            (
                _ring.own_barriers((*own, *own_ids)),
                plgpu.Barrier(num_arrivals=CONSUMERS) if splits > 1 or roles else None,
                *_ring.ring_barriers(ring),
            ),
        ),
    )
    if splits > 1:
        dk, dv = (
            jnp.sum(x.reshape(*x.shape[:2], dims.num_kv_heads, splits, x.shape[-1]), axis=3).astype(dtype)
            for x in (dk, dv)
        )
    # dQ: each consumer's Q_i, dO_i, L_i, D_i (and the rows' ids); a ring of K_j, V_j (and
    # the keys' ids, the dense mask's and the bias's tiles); with a bias, the tiles of its
    # gradient (`_dq_kernel`).
    dq_bk = tuning.dq_keys
    own = (*own_tiles(bq), plgpu.SMEM((tiles, bq), jnp.float32), plgpu.SMEM((tiles, bq), jnp.float32))
    own += _ring.segment_tiles(mask, tiles, bq)
    ring = (smem(dtype, stages, dq_bk, head_dim), smem(dtype, stages, dq_bk, head_dim_v))
    ring += _ring.segment_tiles(mask, stages, dq_bk) + _ring.dense_tiles(mask, stages, tiles * bq, dq_bk)
    ring += _ring.bias_tiles(inputs.bias, stages, tiles * bq, dq_bk)
    barriers = (_ring.own_barriers(own), *_ring.ring_barriers(ring, 1 if roles else CONSUMERS))
    if roles:  # one consumer frees each slot; the second's float32 part of dQ_i reuses the ring
        barriers += (plgpu.Barrier(num_arrivals=CONSUMERS), plgpu.Barrier(num_arrivals=1))
        ring = plgpu.RefUnion(ring, (smem(jnp.float32, bq, head_dim),))
    else:
        barriers += (None, None)
    out_type, grad = (jax.ShapeDtypeStruct(q.shape, dtype),), None
    if inputs.bias is not None:
        grad_dtype = bias_grad_dtype(inputs)
        out_type += (jax.ShapeDtypeStruct((dims.batch, dims.num_heads, q_len, kv_len), grad_dtype),)
        grad = (smem(grad_dtype, tiles, bq, dq_bk), smem(grad_dtype, tiles * bq, dq_bk))
    dq, *dbias = _ring.launch(
        functools.partial(_dq_kernel, roles=roles, **statics),
        (*operands, *_ring.runtime_operands(inputs, mask, q_len, kv_len, tiles * bq, dq_bk)),
        out_type,
        (dims.num_heads, q_len // (tiles * bq), dims.batch),
        ("heads", "q_tiles", "batch"),
        ((own, ring, grad), (*barriers, None if grad is None else plgpu.Barrier(num_arrivals=CONSUMERS))),
    )
    crop = (slice(None), slice(None, dims.q_len), slice(None))
    keys = (slice(None), slice(None, dims.kv_len), slice(None))
    return (
        dq[(*crop, slice(None, dims.head_dim))],
        dk[(*keys, slice(None, dims.head_dim))],
        dv[(*keys, slice(None, dims.head_dim_v))],
        dbias[0][:, :, : dims.q_len, : dims.kv_len] if dbias else None,
    )
