"""``implementation="pallas_decode"``: split-KV decoding (flash-decoding) with the
FlashAttention-2 forward kernel, for queries of up to `MAX_Q_LEN` rows against a cache.

A decode step has too few query tiles to fill a GPU: one program per (query tile,
sequence, kv head) leaves most SMs idle while each reads a long cache. Here the key
tiles of each program are cut into equal shares, one program per share (Dao et al.,
"Flash-Decoding for long-context inference", 2023): each computes a partial output and
lse over its share, with the query heads of a GQA group packed into its rows so that
every K/V tile is read once per group, and XLA merges the shares by their lse
(`jaxtile._softmax.merge`, as ring attention does). The shares cut the key tiles each
query tile sees at run time (`MaskSpec` lengths and masks), so a cache filled short
leaves no program idle; a share with nothing to see merges as empty.

The backward pass is pallas_v2's, from the merged output and lse, so decode-time calls
stay differentiable.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxtile import _softmax as sm
from jaxtile import registry
from jaxtile._core import AUTOTUNE, HOPPER_SMS, Config, Inputs, Shape
from jaxtile.mask import cdiv
from jaxtile.triton import _kernel as pk
from jaxtile.triton import tuning as tn
from jaxtile.triton import v2

MAX_Q_LEN = 16
# Fewest key tiles per share: below this, merging costs more than the parallelism gains
# (one query, 4096 keys in 32 tiles, batch 2 to 20 on an H100: shares of 4 or 5 tiles ran
# 0.89-0.96x as fast as fewer shares in four shapes, of 7 or 8 tiles 0.91-1.03x in five;
# bench/results/h100/decode_shares/).
_MIN_TILES = 8
# A wave of programs with at least this fraction of the SMs busy reads at the full HBM
# bandwidth (and a wave with fewer takes as long as one with this many). On an H100, one
# query against 32768 or 131072 keys at batch 1 to 20: shares that fill the last wave to
# 0.95 of the SMs ran 0.995-1.071x as fast as the fewest that fill it to 0.7 (geomean
# 1.032x, 22 shapes); at batch 1, 16 shares (128 programs) ran 3-5% faster than 12 (96)
# in 7 of 8 comparisons, and 13 to 15 (104 to 120) within 2% of 12
# (bench/results/h100/decode_shares/). On an H200, 16 shares against 12 at batch 1 were
# 0-1% slower in two runs and 4-8% faster in a third (decode_a00ffe3.log,
# decode_splits_ff464b4.log, decode_splits_cac0d9b.log). A second wave took 9-11% longer
# than none with 28 programs in it (H100), 20% with 60 (H200).
_SATURATING = 0.95
# Shares within this factor of the fewest waves' time count as equal: the fewest win.
_TOLERANCE = 1.02
# Programs per SM to aim for when reading pages: with a contiguous cache's one per SM,
# pages read at 0.57-0.78x its speed with 1 or 16 queries at batch 8 and 1 (0.91-0.93x at
# batch 64; bench/results/h200/decode_a00ffe3.log, before the page ids were read a step
# ahead; after, 16 queries still read pages faster with these).
_PAGED_PROGRAMS_PER_SM = 4
# The forward kernel's launch parameters for 16-bit and float32 inputs (16-bit: measured
# with ``python -m bench.decode --tiles`` on an H200, bench/results/h200/decode_tiles_*.log).
DEFAULTS = {2: tn.KernelTuning(64, 128, 4, 3), 4: tn.KernelTuning(64, 32, 4, 2)}
# Keys per tile read from pages for more than one query: for 16 queries, pages read in
# 128-key tiles ran at 0.78-0.79x the contiguous cache, in 64-key tiles at 0.88x (one
# query: 128 keys were faster; bench/results/h200/decode_tiles_f1bb95f.log, decode.log).
_PAGED_BLOCK_K = 64
# Pages read for one query look up each tile's page ids at its own step, for several
# queries one step ahead (`pk.Pages.ids_ahead`): for one query, pages of 16 ran 0.128-0.134
# ms at its own step against 0.136-0.140 ahead at batch 1 (0.233-0.235 against
# 0.238-0.242 at batch 64, level at batch 8); for 16 queries, 0.273-0.277 against 0.244-0.247
# (bench/results/h200/paged_reads/README.md).
_IDS_AHEAD_FROM_Q_LEN = 2
# What ``tuning="autotune"`` (and ``bench.decode --tiles``) tries.
CANDIDATES = tuple(tn.KernelTuning(64, bk, 4, stages) for bk in (32, 64, 128) for stages in (2, 3, 4))


@dataclasses.dataclass(frozen=True)
class Tuning(tn.Tuning):
    """pallas_decode's launch parameters: `jaxtile.triton.Tuning`'s (``forward`` tunes
    the decode kernel, ``dkdv`` and ``dq`` the backward) and ``num_splits``, the shares
    of each program's key tiles (None: `num_splits`' choice for the GPU)."""

    num_splits: int | None = None

    def __post_init__(self):
        if self.num_splits is not None and (not isinstance(self.num_splits, int) or self.num_splits < 1):
            raise ValueError(f"num_splits={self.num_splits!r} must be None or a positive int")


def _waves(programs: int, sms: int) -> float:
    """The time of ``programs`` equal, memory-bound programs run one per SM, in units of
    one full wave: a last wave with fewer than `_SATURATING` of the SMs busy is no
    faster than one with that many."""
    full, rest = divmod(programs, sms)
    return full + (max(rest / sms, _SATURATING) if rest else 0.0)


def num_splits(dims: Shape, tiles: pk.Tiles, sms: int, *, paged: bool = False) -> int:
    """`_shares` of the key tiles for the programs of ``dims`` in ``tiles``: one per
    query tile and packed head group of each sequence."""
    programs = tiles.num_q_tiles(dims) * dims.batch * (dims.num_heads // tiles.pack)
    return _shares(programs, tiles.num_kv_tiles(dims), sms, paged=paged)


def _shares(programs: int, kv_tiles: int, sms: int, *, paged: bool) -> int:
    """Shares of each of ``programs``' ``kv_tiles`` key tiles, each at least
    `_MIN_TILES` tiles: the fewest whose ``programs * shares`` programs finish soonest in
    waves over the GPU's ``sms`` SMs (`_waves`, each program doing 1/shares of the
    work); from ``paged`` caches, enough for `_PAGED_PROGRAMS_PER_SM` programs per SM."""
    most = max(1, kv_tiles // _MIN_TILES)
    if paged:
        return min(cdiv(_PAGED_PROGRAMS_PER_SM * sms, programs), most)
    shares = range(1, most + 1)
    time = {s: _waves(programs * s, sms) / s for s in shares}
    best = min(time.values())
    return next(s for s in shares if time[s] <= best * _TOLERANCE)


def _tuning(inputs: Inputs, config: Config, paged=None) -> tn.KernelTuning:
    """The forward kernel's launch parameters: the user's, autotuned (reading ``paged``,
    `_paged_forward`'s pages, if given), or the default (for pages and several queries,
    with `_PAGED_BLOCK_K` keys per tile at most)."""
    if isinstance(config.tuning, tn.Tuning):
        tuning = config.tuning.forward
    elif config.tuning == AUTOTUNE and config.platform == "gpu":
        return _autotuned(inputs, config, paged)
    else:
        tuning = DEFAULTS[min(jnp.dtype(inputs.q.dtype).itemsize, 4)]
        if paged is not None and inputs.q.shape[1] > 1:
            tuning = dataclasses.replace(tuning, block_k=min(tuning.block_k, _PAGED_BLOCK_K))
    return dataclasses.replace(
        tuning, block_q=config.block_q or tuning.block_q, block_k=config.block_k or tuning.block_k
    )


def _autotuned(inputs: Inputs, config: Config, paged=None) -> tn.KernelTuning:
    """The fastest of `CANDIDATES` for this shape (and page size, reading ``paged``),
    timed once per process."""
    dims = Shape.of(inputs.q, inputs.k, inputs.v)
    page_size = None if paged is None else paged[0].shape[2]
    key = ("decode", dims, inputs.q.dtype, config.mask, config.logits, config.block_q, config.block_k, page_size)
    default = tn.default_tuning(pk.next_pow2(max(dims.head_dim, dims.head_dim_v)), inputs.q.dtype, "full")
    options = tuple(
        dataclasses.replace(default, forward=c).with_blocks(config.block_q, config.block_k) for c in CANDIDATES
    )

    def measure(tuning: tn.Tuning) -> tuple[float, float]:
        # Closes over the inputs: from pages, inputs.k and inputs.v are shapes, not arrays.
        run = jax.jit(lambda: _merged(inputs, config, tuning.forward, paged))
        return tn.median_seconds(lambda: jax.block_until_ready(run())), 0.0

    return tn.autotuned(key, options, measure).forward


def _splits(config: Config, paged: bool) -> Callable[[Shape, pk.Tiles], int]:
    """The shares of a call: the user's `Tuning.num_splits`, or `num_splits`'."""
    requested = getattr(config.tuning, "num_splits", None)
    if requested is not None:
        return lambda dims, tiles: requested
    return functools.partial(num_splits, sms=pk.sm_count(config.platform), paged=paged)


def _merged(inputs: Inputs, config: Config, tuning: tn.KernelTuning, paged=None):
    splits = _splits(config, paged is not None)
    ahead = inputs.q.shape[1] >= _IDS_AHEAD_FROM_Q_LEN
    out, lse = v2.forward_pass(inputs, config, tuning, splits=splits, paged=paged, ids_ahead=ahead)
    if out.shape[0] == 1:
        return out[0], lse[0]
    out, lse = sm.merge(out, lse)
    return out.astype(inputs.q.dtype), lse


def _forward(inputs: Inputs, config: Config):
    out, lse = _merged(inputs, config, _tuning(inputs, config))
    return out, lse, lse


def _paged_forward(inputs: Inputs, config: Config, paged: tuple[jax.Array, jax.Array, jax.Array]):
    """`_forward` reading K and V from pages (`v2.forward_pass`)."""
    return _merged(inputs, config, _tuning(inputs, config, paged), paged)


def _memory(shape: Shape, block_q, block_k, backward: bool) -> tuple[int, int]:
    """pallas_v2's, plus the float32 partial outputs and lse of the shares `_shares`
    takes for one program per (sequence, kv head) on Hopper, from pages (the most), in
    key tiles of ``block_k`` (16, the fewest keys, if None)."""
    residuals, temporaries = pk.memory(shape, fa1=False, backward=backward)
    kv_tiles = cdiv(shape.kv_len, block_k or pk.MIN_BLOCK)
    shares = _shares(shape.batch * shape.num_kv_heads, kv_tiles, HOPPER_SMS, paged=True)
    partial = shape.q_bytes(shape.head_dim_v, 4) + shape.batch * shape.num_heads * shape.q_len * 4
    return residuals, max(temporaries, (shares + 1) * partial if shares > 1 else 0)


IMPLEMENTATION = registry.register(
    registry.Implementation(
        name="pallas_decode",
        summary=f"split-KV decoding (q_len <= {MAX_Q_LEN}) with the FlashAttention-2 Pallas/Triton kernel",
        family="triton",
        algorithm="Flash-Decoding",
        forward=_forward,
        backward=v2.IMPLEMENTATION.backward,
        memory=_memory,
        paged_forward=_paged_forward,
        platforms=frozenset({"gpu"}),
        interprets=frozenset({"cpu"}),
        max_head_dim=pk.MAX_HEAD_DIM,
        max_q_len=MAX_Q_LEN,
        power_of_two_blocks=True,
        lse_backward=True,
        tuning=Tuning,
        speed=60,
    )
)
