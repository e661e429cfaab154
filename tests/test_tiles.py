"""The Pallas kernels' tiles: what each kernel stages in shared memory, the tiles and stages
`Tiles.fit` picks so that every supported call fits, GQA packing of query heads, and
pallas_decode's split-KV shares and their memory."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import pytest

from jaxtile._core import Shape
from jaxtile.triton import _kernel as pk
from jaxtile.triton import decode
from jaxtile.triton import tuning as tn
from jaxtile.triton import v1 as pallas_v1
from jaxtile.triton import v2 as pallas_v2
from jaxtile.triton.tuning import MASK_KINDS, KernelTuning, default_tuning

# (staging, whether its query tiles may pack heads), per kernel.
KERNELS = {
    "pallas_v2.forward": (pallas_v2._FORWARD, True),
    "pallas_v2.dkdv": (pallas_v2._DKDV, False),
    "pallas_v2.dq": (pallas_v2._DQ, True),
    "pallas_v1.forward": (pallas_v1._FORWARD, False),
    "pallas_v1.backward": (pallas_v1._BACKWARD, False),
}
# ... and each with a dense mask's tiles streaming beside its own.
KERNELS |= {f"{name}+mask": (dataclasses.replace(s, dense_mask=True), p) for name, (s, p) in KERNELS.items()}
LIMITS = {"sm90": 232448, "sm80": 166912, "sm89": 101376}
HEAD_DIMS = (16, 40, 64, 80, 128, 160, 256)
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _dims(q_len=4096, kv_len=4096, group=1, head_dim=128, head_dim_v=None):
    return Shape(2, q_len, kv_len, 2 * group, 2, head_dim, head_dim_v or head_dim, 2)


def _tunings(head_dim: int, dtype) -> list[KernelTuning]:
    """The table's launch parameters for this head dim and dtype, and the largest any
    candidate asks for (128-row tiles, 4 stages)."""
    table = [default_tuning(pk.next_pow2(head_dim), dtype, kind) for kind in MASK_KINDS]
    return [*{t for entry in table for t in (entry.forward, entry.dkdv, entry.dq)}, KernelTuning(128, 128, 8, 4)]


@pytest.mark.parametrize("limit", LIMITS.values(), ids=LIMITS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_every_kernel_fits_shared_memory(head_dim, dtype, limit):
    """For every kernel, tuning, GQA group and sequence length, the fitted tiles are
    powers of two >= 16 whose modelled shared memory is within the limit; packed tiles
    hold whole positions of heads of one group. On Hopper everything fits; on GPUs with
    less shared memory a kernel whose smallest tiles do not fit says so."""
    lengths = ((1, 77), (64, 800), (4096, 4096), (300, 17))
    for (name, (staging, packable)), tuning, group, (q_len, kv_len), head_dim_v in itertools.product(
        KERNELS.items(), _tunings(head_dim, dtype), (1, 2, 6, 16), lengths, (head_dim, 16)
    ):
        dims = _dims(q_len, kv_len, group, head_dim, head_dim_v)
        itemsize = jnp.dtype(dtype).itemsize
        if staging.bytes(pk.MIN_BLOCK, pk.MIN_BLOCK, dims, itemsize, 1) > limit:
            assert limit < LIMITS["sm90"], f"{name} cannot run {dims} on Hopper"
            with pytest.raises(NotImplementedError, match="scan_v2"):
                pk.Tiles.fit(tuning, dims, dtype, staging, limit, packable=packable)
            continue
        tiles = pk.Tiles.fit(tuning, dims, dtype, staging, limit, packable=packable)
        where = f"{name} {tuning} {dims} -> {tiles}"
        for block in (tiles.block_q, tiles.block_k):
            assert block >= pk.MIN_BLOCK and block & (block - 1) == 0, where
        assert staging.bytes(tiles.block_q, tiles.block_k, dims, itemsize, tiles.num_stages) <= limit, where
        assert 1 <= tiles.num_stages <= tuning.num_stages, where
        assert dims.group % tiles.pack == 0 and tiles.positions * tiles.pack == tiles.block_q, where
        if not packable:
            assert tiles.pack == 1, where


@pytest.mark.parametrize(
    "q_len,group,rows,expected",
    [
        (1, 16, 128, (16, 16, 1)),  # a decode step: one row per head of the group
        (1, 32, 128, (32, 32, 1)),
        (3, 8, 128, (32, 8, 4)),
        (16, 16, 128, (128, 8, 16)),  # speculative decoding: 16 queries of 8 heads
        (64, 4, 128, (128, 2, 64)),
        (20, 6, 128, (64, 2, 32)),  # the power of two in a group of 6
        (4096, 4, 128, (128, 1, 128)),  # prefill fills its tiles with one head
        (20, 1, 128, (32, 1, 32)),
        (5, 1, 64, (16, 1, 16)),
    ],
)
def test_query_heads_of_a_group_share_a_tile(q_len, group, rows, expected):
    """``(block_q, pack, positions)``: queries too short to fill a tile share it with
    the other heads of their group."""
    tiles = pk.Tiles.fit(
        KernelTuning(rows, 64, 4, 2),
        _dims(q_len, 4096, group),
        jnp.bfloat16,
        pallas_v2._FORWARD,
        LIMITS["sm90"],
        packable=True,
    )
    assert (tiles.block_q, tiles.pack, tiles.positions) == expected


def test_fit_drops_stages_before_tiles():
    dims = _dims(head_dim=128)
    tiles = pk.Tiles.fit(KernelTuning(128, 128, 8, 4), dims, jnp.bfloat16, pallas_v2._FORWARD, LIMITS["sm90"])
    assert (tiles.block_q, tiles.block_k, tiles.num_stages) == (128, 128, 3)
    tiles = pk.Tiles.fit(KernelTuning(128, 128, 8, 4), dims, jnp.bfloat16, pallas_v2._FORWARD, LIMITS["sm89"])
    assert (tiles.block_q, tiles.block_k, tiles.num_stages) == (128, 64, 2)


def test_float32_tiles_leave_room_for_the_low_parts():
    """The parity case that asked XLA for 256 KiB (float32, head dim 64, 128x128 tiles,
    two stages) is fitted to tiles the model puts within Hopper's shared memory."""
    dims = _dims(1021, 1021, head_dim=64)
    assert pallas_v2._FORWARD.bytes(128, 128, dims, 4, 2) >= 262144
    tiles = pk.Tiles.fit(KernelTuning(128, 128, 4, 2), dims, jnp.float32, pallas_v2._FORWARD, LIMITS["sm90"])
    assert pallas_v2._FORWARD.bytes(tiles.block_q, tiles.block_k, dims, 4, tiles.num_stages) <= LIMITS["sm90"]
    assert tiles.block_q * tiles.block_k < 128 * 128


def test_staging_counts_resident_and_pipelined_tiles():
    """The forward kernel keeps Q and pipelines K and V: at 128x64 tiles, head dim 128,
    bf16 and 3 stages that is 32 KiB + 3 x 32 KiB, what Triton 3.6 allocates for it
    (``python -m bench.kernels``), plus the scratch margin."""
    dims = _dims(head_dim=128)
    assert pallas_v2._FORWARD.bytes(128, 64, dims, 2, 3) == 131072 + pk._SCRATCH


@pytest.mark.parametrize("min_programs", [1, 1 << 30], ids=["whole_groups", "split_groups"])
def test_dkdv_splits_a_group_over_programs_exactly(monkeypatch, min_programs):
    """The dK/dV kernel sums a kv head's query heads in one program, or splits them over
    programs and sums their float32 parts (MQA with few kv heads): both are exact."""
    from parity.case import Case
    from parity.run import run_case

    monkeypatch.setattr(pallas_v2, "_MIN_PROGRAMS", min_programs)
    jax.clear_caches()
    case = Case("gqa4_dkdv", num_heads=8, num_kv_heads=2, q_len=40, causal=True, block_q=16, block_k=16)
    try:
        result = run_case(case, "pallas_v2")
    finally:
        jax.clear_caches()
    assert result.ok, result.describe()


@pytest.mark.parametrize(
    "batch,q_len,kv_len,shares",
    [(1, 1, 131072, 16), (2, 1, 131072, 8), (8, 1, 32768, 2), (64, 1, 4096, 1), (8, 16, 32768, 2), (2, 1, 100, 1)],
)
def test_decode_shares_the_cache_out_in_whole_waves(batch, q_len, kv_len, shares):
    """Split-KV decoding (GQA 32:8, 128-key tiles) on Hopper's 132 SMs: the fewest
    shares whose programs fill the waves they run in (at batch 1, 16 shares' 128 programs
    rather than the 96 to 120 of 12 to 15 shares, as measured on an H100,
    bench/results/h100/decode_shares/), none under the fewest key tiles worth merging;
    from pages, more."""
    dims = Shape(batch, q_len, kv_len, 32, 8, 128, 128, 2)
    tiles = pk.Tiles.fit(
        KernelTuning(64, 128, 4, 3), dims, jnp.bfloat16, pallas_v2._FORWARD, LIMITS["sm90"], packable=True
    )
    assert tiles.pack == 4, "the four query heads of a group share each K/V tile"
    splits = decode.num_splits(dims, tiles, sms=132)
    assert splits == shares
    assert -(-tiles.num_kv_tiles(dims) // splits) >= decode._MIN_TILES or splits == 1
    # From pages, enough shares for four programs per SM (or the fewest key tiles).
    paged = decode.num_splits(dims, tiles, sms=132, paged=True)
    per_share = -(-tiles.num_kv_tiles(dims) // paged)
    assert batch * dims.num_kv_heads * paged >= 4 * 132 or per_share < 2 * decode._MIN_TILES
    assert per_share >= decode._MIN_TILES or paged == 1


def test_decode_memory_holds_the_partial_results_of_the_most_shares():
    """pallas_decode's memory model: pallas_v2's residuals, and as temporaries the
    float32 partial outputs and lse of the shares pages take for one program per
    (sequence, kv head) on Hopper's 132 SMs, ``min(ceil(4 * 132 / programs), key tiles
    // 4)`` (16-key tiles unless ``block_k`` is given), and of their merge."""
    # Batch 1, one query, 128K keys, GQA 32:8, head dim 128, bf16: 8 programs of 8192
    # tiles, min(ceil(528 / 8), 8192 // 4) = 66 shares, each a float32 output
    # [1, 1, 32, 128] (16384 bytes) and lse [1, 32, 1] (128 bytes).
    shape = Shape(1, 1, 131072, 32, 8, 128, 128, 2)
    assert decode._memory(shape, None, None, backward=False) == (0, 67 * (16384 + 128))
    # The backward keeps out (bf16) and lse: 8192 + 128 bytes; its two float32 rows are fewer.
    assert decode._memory(shape, None, None, backward=True) == (8192 + 128, 67 * (16384 + 128))
    # Batch 8, 32K keys in 128-key tiles: 64 programs of 256 tiles, min(9, 64) = 9 shares.
    shape = Shape(8, 1, 32768, 32, 8, 128, 128, 2)
    assert decode._memory(shape, None, 128, backward=False) == (0, 10 * (8 * 32 * 128 * 4 + 8 * 32 * 4))
    # 64 keys are 4 tiles, one share: pallas_v2's out and lse, and two float32 rows.
    shape = Shape(2, 1, 64, 4, 2, 16, 16, 4)
    assert decode._memory(shape, None, None, backward=True) == (2 * 4 * 16 * 4 + 2 * 4 * 4, 2 * (2 * 4 * 4))


def test_a_dense_mask_streams_its_tiles_with_the_keys():
    """A dense mask's ``block_q × block_k`` tile (a byte an element) streams with K and V:
    at head dim 128 the forward's three stages of 128×128 tiles fit without it and not
    with it (XLA asked 256 KiB on an H100), so the mask takes the third stage away."""
    dims, tuning, limit = _dims(head_dim=128), KernelTuning(128, 128, 8, 3), LIMITS["sm90"]
    masked = dataclasses.replace(pallas_v2._FORWARD, dense_mask=True)
    assert masked.bytes(128, 128, dims, 2, 3) == pallas_v2._FORWARD.bytes(128, 128, dims, 2, 3) + 3 * 128 * 128
    assert pk.Tiles.fit(tuning, dims, jnp.bfloat16, pallas_v2._FORWARD, limit) == pk.Tiles(128, 128, 3)
    assert pk.Tiles.fit(tuning, dims, jnp.bfloat16, masked, limit) == pk.Tiles(128, 128, 2)


def test_autotuning_skips_candidates_that_fail_and_raises_when_all_do():
    """A candidate whose measurement raises loses; the fastest of the rest is taken, the
    forward and the backward each on its own; when none runs, the error is the caller's."""
    options = tuple(tn.Tuning(t, t, t) for t in _tunings(64, jnp.bfloat16)[:3])
    times = {options[1]: (2.0, 1.0), options[2]: (1.0, 3.0)}

    def measure(tuning):
        if tuning not in times:
            raise ValueError("does not fit")
        return times[tuning]

    chosen = tn.autotuned(("test", "some fail"), options, measure)
    assert chosen == tn.Tuning(options[2].forward, options[1].dkdv, options[1].dq) != options[1]

    def failing(tuning):
        raise ValueError(f"no room for {tuning.forward}")

    with pytest.raises(RuntimeError, match="none of 3 candidates ran") as raised:
        tn.autotuned(("test", "all fail"), options, failing)
    assert isinstance(raised.value.__cause__, ValueError)
