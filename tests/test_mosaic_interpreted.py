"""mosaic_v3's kernels run on the CPU through jax's Mosaic GPU interpreter
(`mosaic_interpreter`), against the float64 reference: outputs, lse and the three
gradients (four with a bias), each case through the forward kernel, the dK/dV and dQ
kernels and their warpgroups' barriers as they run on the GPU (a call that fell back to
the Triton kernels would fail here: the interpreter does not take their loads). The
shapes are small (the interpreter runs every warpgroup of every program as a host
thread); the GPU tests (`test_mosaic.py`, the shared test base on a Hopper GPU) take the
same masks at scale."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from mosaic_interpreter import UNAVAILABLE, interpreted, races_found
from test_mosaic import assert_exact
from test_numerics import test_float16_gradients_do_not_overflow as float16_gradients_do_not_overflow

import jaxtile
from jaxtile import registry
from jaxtile.mosaic import _ring, v3
from jaxtile.mosaic.backward import BackwardTuning
from parity.case import Case

pytestmark = [pytest.mark.interpreted, pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))]

# The interpreter's time is per program, so a second batch element doubles a case's: the
# cases take one, but for `causal_d64` and `persistent_gqa_window`, which keep the batch
# axis of the grid and of the persistent schedule covered, and `sinks_empty_rows_fp16`,
# whose two `dsinks` sum the rows of both elements: over one element's rows, those of
# this draw nearly cancel: there the lax loops and both kernel families read 4e-3 to 1e-2
# of relative error against the float64 reference, the float16 reference 1.9e-3 (the
# tolerance is 2e-3; `bench/NOTES.md`).
_case = functools.partial(Case, batch=(1,))

# Every mask kind the kernels read, in each dtype they take; lengths that are not tile
# multiples (the kernels' tiles are 128 query rows by 64 or 128 keys), head dims that
# are not powers of two, fewer queries than keys (bottom-right) and more.
CASES = [
    _case("causal_d64", batch=(2,), q_len=200, num_heads=2, head_dim=64, dtype="bfloat16", causal=True),
    _case("full_fp16_d128_lse_grad", q_len=150, kv_len=260, num_heads=2, head_dim=128, dtype="float16", lse_grad=True),
    _case(
        "gqa_window_fp16_d80",
        q_len=150,
        kv_len=260,
        num_heads=4,
        num_kv_heads=2,
        head_dim=80,
        dtype="float16",
        causal=True,
        window=(40, 0),
    ),
    _case(
        "mqa_two_sided_window_soft_cap_d96",
        q_len=190,
        num_heads=3,
        num_kv_heads=1,
        head_dim=96,
        dtype="bfloat16",
        window=(30, 20),
        logits_soft_cap=5.0,
    ),
    _case("segments_d128", q_len=200, num_heads=2, head_dim=128, dtype="bfloat16", segments=3),
    _case(
        "ragged_lengths_causal", q_len=130, num_heads=2, head_dim=64, dtype="bfloat16", causal=True, lengths="ragged"
    ),
    _case("dense_random", q_len=140, num_heads=2, head_dim=64, dtype="bfloat16", mask="random"),
    _case("empty_rows_fp16", q_len=140, num_heads=2, head_dim=64, dtype="float16", mask="empty_rows"),
    _case("d256_causal", q_len=130, num_heads=2, head_dim=256, dtype="bfloat16", causal=True),
    _case("bias_soft_cap", q_len=150, num_heads=2, head_dim=64, dtype="bfloat16", logits_soft_cap=20.0, bias="full"),
    _case("decode_gqa", q_len=1, kv_len=300, num_heads=4, num_kv_heads=2, head_dim=128, dtype="bfloat16"),
    _case("q_longer_than_kv_causal", q_len=200, kv_len=70, num_heads=2, head_dim=64, dtype="float16", causal=True),
    # Sinks as the rows' first logit (`v3.takes_sinks`): GQA with lse's gradient, and rows
    # that see no key, whose output stays 0 and whose lse is the sink.
    _case(
        "sinks_gqa_causal_lse_grad",
        q_len=150,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        dtype="bfloat16",
        causal=True,
        sinks=True,
        lse_grad=True,
    ),
    _case(
        "sinks_empty_rows_fp16",
        batch=(2,),
        q_len=140,
        num_heads=2,
        head_dim=64,
        dtype="float16",
        mask="empty_rows",
        sinks=True,
    ),
]

# Persistent programs, few of them so that each runs several tiles and the rings' slots
# carry over from tile to tile, each case beside its programs and the schedule it takes:
# heads fastest (a window), and more keys than `v3._PERSISTENT_KEYS` with no left bound,
# where the query tiles go fastest (`v3._queries_first`), in rounds, or, causal, dealt on
# the host (`_ring.Schedule.dealt`: 6 tiles to 4 programs, one or two each); the test
# lowers that threshold from 2048 to 256, since the interpreter's time grows with the keys,
# and what dealing costs (`v3._DEALING`) to nothing, since so few tiles save little.
PERSISTENT_CASES = [
    (
        _case(
            "persistent_gqa_window",
            batch=(2,),
            q_len=300,
            num_heads=4,
            num_kv_heads=2,
            head_dim=64,
            dtype="bfloat16",
            causal=True,
            window=(100, 0),
        ),
        3,
        dict(queries_first=False, dealt=False),
    ),
    (
        _case("persistent_queries_first", q_len=260, kv_len=400, num_heads=2, head_dim=64, dtype="bfloat16"),
        3,
        dict(queries_first=True, dealt=False),
    ),
    (
        _case("persistent_dealt_causal", q_len=260, num_heads=2, head_dim=64, dtype="bfloat16", causal=True),
        4,
        dict(queries_first=True, dealt=True),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_the_kernels_are_exact(case, monkeypatch):
    with interpreted(monkeypatch):
        assert_exact(case)


@pytest.mark.parametrize("case,programs,schedule", PERSISTENT_CASES, ids=[case.name for case, *_ in PERSISTENT_CASES])
def test_persistent_programs_are_exact(case, programs, schedule, monkeypatch):
    monkeypatch.setattr(_ring, "multiprocessors", lambda: programs)
    monkeypatch.setattr(v3, "_PERSISTENT_KEYS", 256)
    monkeypatch.setattr(v3, "_DEALING", 0)
    taken, chosen = [], v3._schedule

    def recorded(*args):  # the schedules the forward takes, as it is traced
        taken.append(chosen(*args))
        return taken[-1]

    monkeypatch.setattr(v3, "_schedule", recorded)
    with interpreted(monkeypatch):
        assert_exact(case, v3.Tuning(persistent=True))
    assert {(s.queries_first, s.plan is not None) for s, _ in taken} == {(schedule["queries_first"], schedule["dealt"])}


# Persistent programs whose output leaves through slots (`v3.Tuning.output_slots`), 3 of
# them over 6 tiles: MQA at head dim 256, 4 slot copies a tile (the slots in turn, tile
# after tile), and a window at head dims 200 and 136 (padded to 256 and 192: 3 copies a
# tile, whose first waits for every copy before it).
SLOT_CASES = [
    _case("slots_mqa_causal_d256", q_len=300, num_heads=2, num_kv_heads=1, head_dim=256, dtype="bfloat16", causal=True),
    _case(
        "slots_window_d200_v136",
        q_len=300,
        kv_len=330,
        num_heads=2,
        head_dim=200,
        head_dim_v=136,
        dtype="float16",
        window=(40, 10),
    ),
]


@pytest.mark.parametrize("case", SLOT_CASES, ids=lambda case: case.name)
def test_output_slots_are_exact(case, monkeypatch):
    tuning = v3.Tuning(block_k=64, persistent=True, output_slots=True)
    assert tuning.fit(256, _ring.padded(case.dim_v, 64), 2) == tuning
    monkeypatch.setattr(_ring, "multiprocessors", lambda: 3)
    with interpreted(monkeypatch):
        assert_exact(case, tuning)


def test_a_swept_backward_tiling_is_exact(monkeypatch):
    """A tiling the sweep may pick (`bench.tune`) beside the defaults the cases take: three
    stages, and dQ's ring tiles of 128 keys apart from dK/dV's 64. (A tiling that does not
    fit would send the call to the Triton backward, which this interpreter refuses.)"""
    backward = BackwardTuning(block_q=64, block_k=64, num_stages=3, dq_block_k=128)
    assert backward.fits(64, 64, 2)
    case = _case("swept_tiling", q_len=300, kv_len=330, num_heads=2, head_dim=64, dtype="bfloat16", causal=True)
    with interpreted(monkeypatch):
        assert_exact(case, v3.Tuning(backward=backward))


def test_float16_gradients_do_not_overflow(monkeypatch):
    """`test_numerics`' case whose ``dS`` exceeds float16's range, on the Mosaic kernels:
    each row of it is scaled down before its products and their results back up
    (`backward._rounded`), and the gradients stay finite."""
    with interpreted(monkeypatch):
        float16_gradients_do_not_overflow(registry.get("mosaic_v3"))


def test_the_kernels_have_no_races(monkeypatch):
    """The forward, dK/dV (its query heads shared out over programs) and dQ kernels under
    the interpreter's race detector: no read or write of shared or global memory that the
    barriers do not order after the write it could see."""
    case = _case("gqa_causal", q_len=130, num_heads=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", causal=True)
    with interpreted(monkeypatch, detect_races=True):
        assert_exact(case)
        assert not races_found()


def test_the_race_detector_sees_a_missing_wait(monkeypatch):
    """The detector that finds no race above finds one in the forward once its consumers
    no longer wait for their queries' copy (`_ring.wait_own` made a no-op): their first
    `Q Kᵀ` then reads a tile with nothing ordering the read after the copy's writes."""
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 130, 2, 64), jnp.bfloat16) for i in range(3))
    monkeypatch.setattr(_ring, "wait_own", lambda ready, wg: None)
    with interpreted(monkeypatch, detect_races=True):
        jax.block_until_ready(jaxtile.flash_attention(q, k, v, causal=True, implementation="mosaic_v3"))
        assert races_found()
