"""The Mosaic GPU family (`jaxtile.mosaic`) off the GPU: its kernels traced and lowered
for CUDA (every shape, layout and barrier the kernel declares is checked then; ``ptxas``
and the speed need the GPU, where the shared test base runs it), and its dispatch and
tuning. Their numbers on the CPU, through jax's Mosaic GPU interpreter, are
`test_mosaic_interpreted`'s."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import core as mosaic_gpu_core
from jax_settings import SETTINGS

import jaxtile
from bench import tune
from jaxtile import registry
from jaxtile._core import Config, Inputs, Shape, bias_grad_dtype
from jaxtile._softmax import Logits
from jaxtile.mask import MaskSpec, TileSpan
from jaxtile.mosaic import _ring, v3
from jaxtile.mosaic import backward as mosaic_backward
from jaxtile.mosaic.backward import backward_pass as mosaic_backward_pass
from parity.case import Case
from parity.run import run_case

# (q [batch, q_len, heads, dim], kv_len, kv_heads, head_dim_v, causal, window, soft_cap, dtype)
CALLS = {
    "causal": ((2, 1024, 4, 128), 1024, 4, 128, True, None, None, jnp.bfloat16),
    "full_d64": ((1, 512, 4, 64), 512, 4, 64, False, None, None, jnp.float16),
    "window_gqa_ragged_d80_v48": ((1, 300, 8, 80), 1000, 2, 48, True, (100, 0), None, jnp.bfloat16),
    "two_sided_window_soft_cap": ((1, 512, 4, 64), 512, 4, 64, False, (50, 70), 5.0, jnp.bfloat16),
    "d256_causal": ((1, 512, 4, 256), 512, 4, 256, True, None, None, jnp.bfloat16),
    "window_mqa_d200_v136": ((1, 260, 4, 200), 330, 1, 136, False, (40, 10), None, jnp.bfloat16),
    "decode_mqa": ((4, 1, 8, 128), 4096, 1, 128, True, None, None, jnp.bfloat16),
    "q_longer_than_kv": ((1, 200, 2, 64), 60, 2, 64, True, (10, 0), None, jnp.float16),
}


def _call(q_shape, kv_len, kv_heads, head_dim_v, causal, window, soft_cap, dtype, runtime="", **config):
    """Abstract inputs and the config of a call; ``runtime`` names the runtime parts of
    its mask: ``"segments"`` (ids of the queries and the keys), ``"lengths"``, ``"dense"``
    (a mask per head, ``"dense1"`` one broadcast over batch and heads) or several; and
    ``"bias"`` a bias per head in the call's dtype (``"bias32"`` a float32 one broadcast
    over batch and heads, ``"bias_keys"`` one broadcast over the queries too); ``"sinks"``
    a sink per head."""
    batch, q_len, heads, head_dim = q_shape
    q = jax.ShapeDtypeStruct(q_shape, dtype)
    k = jax.ShapeDtypeStruct((batch, kv_len, kv_heads, head_dim), dtype)
    v = jax.ShapeDtypeStruct((batch, kv_len, kv_heads, head_dim_v), dtype)
    segments, lengths, dense = "segments" in runtime, "lengths" in runtime, "dense" in runtime
    ids = [jax.ShapeDtypeStruct((batch, n), jnp.int32) if segments else None for n in (q_len, kv_len)]
    lengths_array = jax.ShapeDtypeStruct((batch, 2), jnp.int32) if lengths else None
    mask_shape = (1, 1, q_len, kv_len) if "dense1" in runtime else (batch, heads, q_len, kv_len)
    mask = jax.ShapeDtypeStruct(mask_shape, jnp.bool_) if dense else None
    bias = None
    if "bias" in runtime:
        rows = 1 if "bias_keys" in runtime else q_len
        shape = (1, 1, rows, kv_len) if "bias32" in runtime or rows == 1 else (1, heads, q_len, kv_len)
        bias = jax.ShapeDtypeStruct(shape, jnp.float32 if "bias32" in runtime else dtype)
    spec = MaskSpec.create(
        q_len, kv_len, causal=causal, window=window, has_segments=segments, has_lengths=lengths, has_dense_mask=dense
    )
    config = Config(spec, Logits(head_dim**-0.5, soft_cap, bias=bias is not None), platform="gpu", **config)
    sinks = jax.ShapeDtypeStruct((heads,), jnp.float32) if "sinks" in runtime else None
    return Inputs(q, k, v, *ids, mask=mask, lengths=lengths_array, bias=bias, sinks=sinks), config


def _as_asked(name: str, runtime: str, tunings: dict[str, v3.Tuning]) -> list:
    """``(name, runtime, tuning)`` params of ``CALLS[name]`` with each of ``tunings`` that
    `Tuning.fit` leaves its schedule and output (persistence, slots): elsewhere it falls
    back to one program per tile, and the param would lower the first again."""
    params = []
    for label, tuning in tunings.items():
        planned = v3._plan(*_call(*CALLS[name], runtime=runtime, tuning=tuning))[2]
        if (planned.persistent, planned.output_slots) == (tuning.persistent, tuning.output_slots):
            params.append(pytest.param(name, runtime, tuning, id="-".join(filter(None, (name, runtime, label)))))
    return params


SCHEDULES = {"tiles": v3.Tuning(), "persistent": v3.Tuning(persistent=True)}
OUTPUTS = SCHEDULES | {"slots": v3.Tuning(block_k=64, persistent=True, output_slots=True)}


@pytest.mark.parametrize("name, runtime, tuning", [p for name in CALLS for p in _as_asked(name, "", OUTPUTS)])
def test_the_forward_kernel_lowers_for_cuda(name, runtime, tuning):
    """Traced and lowered to Mosaic GPU's LLVM module (with its ``wgmma``), with the output
    and lse of the call's shapes, with one program per query tile or persistent programs,
    their output through a tile of its own or slots."""
    inputs, config = _call(*CALLS[name], runtime=runtime, tuning=tuning)
    lowered = jax.jit(lambda q, k, v: v3.forward_pass(Inputs(q, k, v), config)).trace(*inputs[:3])
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "wgmma.mma_async" in text
    out, lse = lowered.out_info
    batch, q_len, heads, _ = inputs.q.shape
    assert out.shape == (batch, q_len, heads, inputs.v.shape[-1]) and out.dtype == inputs.q.dtype
    assert lse.shape == (batch, heads, q_len) and lse.dtype == jnp.float32


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("setting", SETTINGS)
def test_the_forward_kernel_lowers_under_every_jax_setting(setting, persistent):
    """64-bit types by default and strict promotion leave the kernel's indices int32."""
    with SETTINGS[setting]():
        inputs, config = _call(*CALLS["window_gqa_ragged_d80_v48"], tuning=v3.Tuning(persistent=persistent))
        lowered = jax.jit(lambda q, k, v: v3.forward_pass(Inputs(q, k, v), config)).trace(*inputs[:3])
        assert "wgmma.mma_async" in lowered.lower(lowering_platforms=("cuda",)).as_text()


RUNTIME = ["segments", "lengths", "segments+lengths"]


@pytest.mark.parametrize(
    "name, runtime, tuning",
    [
        p
        for name in ("causal", "window_gqa_ragged_d80_v48", "two_sided_window_soft_cap")
        for runtime in (
            *RUNTIME,
            *("dense", "dense1+lengths", "dense+segments", "bias", "bias32+dense", "bias+segments", "sinks+lengths"),
        )
        for p in _as_asked(name, runtime, SCHEDULES)
    ],
)
def test_the_forward_kernel_lowers_with_runtime_masks(name, runtime, tuning):
    """With segment ids, lengths or a dense mask the kernel also reads the tile bounds
    they give (`MaskSpec.tile_bounds`), and the rows' ids and a ring of the keys' ids, the
    lengths, or a ring of the dense mask's tiles (in 64-key tiles too: the d80 call's);
    with a bias, a ring of its tiles (bf16, or float32 beside a dense mask's); with sinks,
    each tile's head's sink."""
    inputs, config = _call(*CALLS[name], runtime=runtime, tuning=tuning)

    def forward(inputs):
        return v3.forward_pass(inputs, config)

    lowered = jax.jit(forward).trace(inputs)
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "wgmma.mma_async" in text
    out, lse = lowered.out_info
    assert out.shape[:3] == inputs.q.shape[:3] and lse.shape == (
        inputs.q.shape[0],
        inputs.q.shape[2],
        inputs.q.shape[1],
    )


@pytest.mark.parametrize(
    "name, runtime, tuning",
    [
        ("causal", "bias", v3.Tuning(block_k=128)),  # the default at head dim 128: 872 bytes to spare
        ("causal", "", v3.Tuning(block_k=128, num_stages=3)),
        ("causal", "bias+segments", v3.Tuning(block_k=64)),
        ("full_d64", "dense+segments", v3.Tuning(block_k=128, persistent=True)),
        ("window_gqa_ragged_d80_v48", "bias32+dense", v3.Tuning(block_k=64)),
        ("d256_causal", "bias", v3.Tuning(block_k=64)),
        ("d256_causal", "", v3.Tuning(block_k=64, persistent=True, output_slots=True)),  # 936 bytes to spare
        ("window_mqa_d200_v136", "", v3.Tuning(block_k=64, persistent=True, output_slots=True)),
    ],
)
def test_the_forward_s_shared_memory_is_what_mosaic_counts(name, runtime, tuning, monkeypatch):
    """`Tuning.shared_memory` is Mosaic GPU's own count for the forward kernel (its tiles
    rounded up to 1 KiB, 2 KiB of its own, 8 bytes a barrier: `_ring.mosaic_bytes`), at
    most 48 bytes over (a bias alone is counted as two streams of scores); read off the
    error Mosaic raises past a bound made small."""
    monkeypatch.setattr(mosaic_gpu_core, "_SMEM_SIZE_BOUND", 1024)
    inputs, config = _call(*CALLS[name], runtime=runtime, tuning=tuning)
    head_dim, head_dim_v, planned, beside = v3._plan(inputs, config)
    assert planned == tuning  # fits as it is
    with pytest.raises(Exception, match=r"smem_bytes=\d+") as raised:
        jax.jit(lambda i: v3.forward_pass(i, config)).trace(inputs).lower(lowering_platforms=("cuda",))
    counted = int(re.search(r"smem_bytes=(\d+)", str(raised.value)).group(1))
    assert 0 <= planned.shared_memory(head_dim, head_dim_v, 2, beside) - counted <= 48


def test_a_dense_mask_rides_the_ring_on_masked_steps_only():
    """The producer copies a dense mask's tile on the steps of masked spans alone (an
    interior tile is whole, and its mask never read); on the others it arrives on the
    slot's ready barrier without a copy, so the consumers, who wait on every step, keep
    pace. A mask broadcast over batch and heads is read at batch element and head 0."""
    spans = (TileSpan(2, 4, True), TileSpan(4, 9, False), TileSpan(9, 10, True))
    ref = types.SimpleNamespace(shape=(1, 1, 256, 2048))
    where = dict(b=3, rows=pl.ds(128, 128), cols=128, step=lambda s: (5, 2 + s))
    (stream,) = _ring.dense_stream(ref, (None, None, None), spans, **where)
    copies = [bool(stream.copies(jnp.int32(s))) for s in range(8)]
    assert copies == [True, True, False, False, False, False, False, True]
    assert _ring.dense_stream(ref, None, spans, **where) == ()


def test_the_dkdv_kernel_reads_a_transposed_mask_within_its_groups_union_of_bounds():
    """For dK/dV (``transposed``) the dense mask comes as int8 ``[..., kv_len, q_len]``, and
    a mask per head gives each kv head the bounds of all its query heads: the union of
    the tiles they visit, the intersection of their interiors (`uniform_bounds`), which
    hold every (query tile, key tile) pair any of them sees."""
    batch, q_len, kv_len, heads, kv_heads = 2, 200, 256, 4, 2
    rng = np.random.default_rng(0)
    mask = rng.random((batch, heads, q_len, kv_len)) < 0.02  # sparse: many tiles hidden for some heads
    mask[:, :, :64, :128] = True  # a tile every head sees whole
    q = jnp.zeros((batch, q_len, heads, 64), jnp.bfloat16)
    k = jnp.zeros((batch, kv_len, kv_heads, 64), jnp.bfloat16)
    inputs = Inputs(q, k, k, mask=jnp.asarray(mask))
    spec = MaskSpec.create(q_len, kv_len, has_dense_mask=True)
    dense_t, bounds = _ring.runtime_operands(inputs, spec, 256, 256, 64, 128, transposed=True)
    assert dense_t.dtype == jnp.int8 and dense_t.shape == (batch, heads, 256, 256)
    np.testing.assert_array_equal(np.asarray(dense_t)[:, :, :kv_len, :q_len], np.swapaxes(mask, 2, 3))
    assert bounds.shape == (batch, kv_heads, 2, 4)
    per_head = np.asarray(spec.tile_bounds(64, 128, transposed=True, dense=jnp.asarray(mask)))
    for b in range(batch):
        for h in range(heads):
            lo, full_lo, full_hi, hi = np.asarray(bounds)[b, h // 2].T
            h_lo, h_full_lo, h_full_hi, h_hi = per_head[b, h].T
            assert np.all(lo <= h_lo) and np.all(hi >= h_hi)  # every tile a head visits
            assert np.all((full_lo >= h_full_lo) | (full_lo == full_hi))  # interiors whole for every head
            assert np.all((full_hi <= h_full_hi) | (full_lo == full_hi))
    assert np.asarray(bounds)[0, 0, 0, 1] == 0 and np.asarray(bounds)[0, 0, 0, 2] == 1  # the tile all see whole


def test_the_dkdv_kernel_steps_through_the_query_tiles_of_each_head():
    """A dK/dV program visits its span of query tiles for each head of its share in turn
    (`_ring.query_step`), and copies the transposed dense mask's tile of a step where
    that tile is in a masked span, whichever head it belongs to."""
    step = functools.partial(_ring.query_step, first=jnp.int32(3), per_head=jnp.int32(4), head0=jnp.int32(8))
    steps = [tuple(int(x) for x in step(jnp.int32(s))) for s in range(8)]
    assert steps == [(head, tile) for head in (8, 9) for tile in range(3, 7)]
    spans = (TileSpan(3, 4, True), TileSpan(4, 6, False), TileSpan(6, 7, True))
    ref = types.SimpleNamespace(shape=(2, 16, 2048, 1024))
    (stream,) = _ring.dense_stream(ref, (None, None, None), spans, b=1, rows=pl.ds(0, 128), cols=64, step=step)
    assert [bool(stream.copies(jnp.int32(s))) for s in range(8)] == [True, False, False, True] * 2


def test_the_warpgroups_registers_are_what_setmaxnreg_can_give():
    """`setmaxnreg` takes multiples of 8 in [24, 256], and a warpgroup can only increase
    its registers by what the others release: the consumers' and the producer's together
    fit in what the block is launched with (65536 per block over its threads, in
    multiples of 8: 168 each for three warpgroups)."""
    for registers in (_ring.CONSUMER_REGISTERS, _ring.PRODUCER_REGISTERS):
        assert registers % 8 == 0 and 24 <= registers <= 256, registers
    warpgroups = _ring.CONSUMERS + 1
    at_launch = 65536 // (128 * warpgroups) // 8 * 8
    asked = _ring.CONSUMERS * _ring.CONSUMER_REGISTERS + _ring.PRODUCER_REGISTERS
    assert asked <= warpgroups * at_launch, (asked, at_launch)


def _backward_call(name: str, runtime: str, dq_block_k: int | None):
    """A call of `_call` whose config asks for the dQ kernel's key tiles ``dq_block_k``."""
    backward = mosaic_backward.BackwardTuning(dq_block_k=dq_block_k)
    return _call(*CALLS[name], runtime=runtime, tuning=v3.Tuning(backward=backward))


def _backward_lowerings():
    """(call, runtime mask or bias, dq_block_k) of every call the Mosaic backward takes
    (`v3._backward_tuning`; else the Triton backward runs, as `_backward` is tested to
    choose)."""
    params = []
    for name in CALLS:
        for runtime in ["", *RUNTIME, "dense", "dense1+lengths", "dense+segments", "bias", "bias32", "bias+lengths"]:
            for dq_block_k in (None, 128):
                if v3._backward_tuning(*_backward_call(name, runtime, dq_block_k)) is not None:
                    params.append(pytest.param(name, runtime, dq_block_k, id=f"{name}-{runtime}-{dq_block_k}"))
    return params


@pytest.mark.parametrize("name, runtime, dq_block_k", _backward_lowerings())
def test_the_backward_kernels_lower_for_cuda(name, runtime, dq_block_k):
    """The dK/dV and dQ kernels of every call they take (head dim 256 with roles), with
    and without runtime masks (a dense mask per head over GQA groups too) or a bias (in
    the call's dtype per head, or float32 shared by the heads; whose gradient is
    written as `_core.bias_grad_dtype` says), and with the dQ kernel's key tiles as
    dK/dV's or twice them, traced and lowered to Mosaic GPU, with gradients of the
    inputs' shapes and dtypes."""
    inputs, config = _backward_call(name, runtime, dq_block_k)
    tuning = v3._backward_tuning(inputs, config)
    batch, q_len, heads, _ = inputs.q.shape
    out = jax.ShapeDtypeStruct((batch, q_len, heads, inputs.v.shape[-1]), inputs.q.dtype)
    lse = jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32)

    def backward(out, lse, dout, dlse, inputs):
        return mosaic_backward.backward_pass(inputs, out, lse, dout, dlse, config, tuning)

    lowered = jax.jit(backward).trace(out, lse, out, lse, inputs)
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 2 and "wgmma.mma_async" in text
    *grads, dbias = lowered.out_info
    for grad, x in zip(grads, inputs[:3], strict=True):
        assert grad.shape == x.shape and grad.dtype == x.dtype
    if inputs.bias is None:
        assert dbias is None
    else:
        assert dbias.shape == (batch, heads, q_len, inputs.k.shape[1]) and dbias.dtype == bias_grad_dtype(inputs)


def test_the_backward_takes_the_triton_kernels_where_its_tiles_do_not_fit(monkeypatch):
    """Tiles that do not fit (128-key tiles at head dim 256, whose dK consumer would hold
    384 registers; 128-key dQ tiles beside a dense mask's ring at head dim 128) send the
    backward to the Triton family's kernels, with the call's tuning dropped where it is
    Mosaic's; head dim 256 (with roles) and dense masks stay with the Mosaic kernels."""
    calls = []
    monkeypatch.setattr(v3, "backward_pass", lambda *args: calls.append("mosaic") or (None,) * 4)
    triton = types.SimpleNamespace(backward=lambda *args: calls.append(("triton", args[-1].tuning)) or (None,) * 4)
    monkeypatch.setattr(v3, "triton_v2", types.SimpleNamespace(IMPLEMENTATION=triton))
    for name, tuning, runtime in (
        ("causal", v3.Tuning(), ""),
        ("d256_causal", v3.Tuning(), ""),
        ("d256_causal", "autotune", "dense"),
        ("d256_causal", v3.Tuning(backward=mosaic_backward.BackwardTuning(block_k=128)), ""),
        ("causal", v3.Tuning(), "dense"),
        ("causal", v3.Tuning(backward=mosaic_backward.BackwardTuning(dq_block_k=128)), ""),
        ("causal", v3.Tuning(backward=mosaic_backward.BackwardTuning(dq_block_k=128)), "dense"),
    ):
        inputs, config = _call(*CALLS[name], runtime=runtime, tuning=tuning)
        v3._backward(inputs, None, None, None, None, config)
    assert calls == ["mosaic", "mosaic", "mosaic", ("triton", None), "mosaic", "mosaic", ("triton", None)]


def test_backward_tiles_fit_as_measured():
    """`BackwardTuning.fits` admits the tiles that ran at full speed and refuses those
    that spilled registers on the GPU (`backward._REGISTERS`) or overflow shared memory;
    ``dq_block_k`` sets the dQ kernel's key tiles alone, and the sequences pad to whole
    tiles of both kernels."""
    tuning = mosaic_backward.BackwardTuning
    assert tuning().fits(128, 128, 2) and tuning(block_q=128).fits(64, 64, 2)
    assert tuning(dq_block_k=128).fits(128, 128, 2) and tuning(dq_block_k=128).fits(64, 64, 2)
    assert tuning().fits(256, 256, 2) and tuning().fits(192, 256, 2)  # with roles: one accumulator each
    assert tuning().registers(256, 256) == 192 and tuning().registers(128, 128) == 192
    assert not tuning(block_k=128).fits(256, 256, 2)  # the dK consumer: dK_j, Sᵀ, dPᵀ in 384
    # A bias: its rings, in its dtype, and the dQ kernel's two tiles of its gradient.
    with_bias = tuning().shared_memory(128, 128, 2) + 2 * 64 * 128 * 2 + 2 * 128 * 64 * 4  # dQ's: 2 stages of 64 keys
    assert tuning().shared_memory(128, 128, 2, bias=2, bias_grad=4) == with_bias
    assert tuning().fits(128, 128, 2, bias=2, bias_grad=2) and tuning().fits(64, 64, 2, True, bias=4, bias_grad=4)
    assert not tuning().fits(128, 128, 2, bias=2, bias_grad=4) and not tuning().fits(256, 256, 2, bias=2, bias_grad=2)
    assert not tuning(dq_block_k=128).fits(256, 256, 2)  # dQ_i, S, dP in 256
    assert not tuning(block_k=128).fits(128, 128, 2)  # spilled: 25-40% slower
    assert not tuning(block_q=128).fits(128, 128, 2)  # spilled
    assert not tuning(block_k=128).fits(64, 64, 2)  # spilled: 268 against 389 TFLOP/s
    assert not tuning(block_q=128, dq_block_k=128).fits(64, 64, 2)  # dQ's S and dP: 256
    assert not tuning(num_stages=3, dq_block_k=128).fits(128, 128, 2)  # shared memory
    assert tuning().dq_keys == 64 and tuning(dq_block_k=128).dq_keys == 128
    assert tuning(dq_block_k=128).padded_lengths(100, 130) == (128, 256)
    assert tuning(block_q=128, dq_block_k=64).padded_lengths(300, 129) == (512, 256)
    with pytest.raises(ValueError, match=r"block_k=96 must be a positive multiple of 64"):
        tuning(block_k=96)
    with pytest.raises(ValueError, match=r"dq_block_k=32 must be a positive multiple of 64"):
        tuning(dq_block_k=32)


def test_the_dkdv_kernel_shares_a_kv_heads_query_heads_when_programs_are_few():
    """MQA's one kv head would leave most SMs idle: its query heads are split into shares
    (powers of two dividing the group) until the kernel has `_MIN_PROGRAMS` programs, of
    128 keys each, or of 64 with roles (head dims past 128)."""

    def splits(heads, kv_heads, kv_len, batch=1, head_dim=128):
        dims = Shape(batch, kv_len, kv_len, heads, kv_heads, head_dim, head_dim, 2)
        return mosaic_backward._splits(dims, mosaic_backward.BackwardTuning())

    assert splits(16, 1, 8192, batch=2) == 8  # 128 programs; 4 shares would give 512
    assert splits(32, 8, 8192, batch=2) == 1  # 1024 programs
    assert splits(8, 2, 1024) == 4  # 16 programs: as far as the group of 4 goes
    assert splits(12, 4, 1024) == 1  # a group of 3 has no power-of-two share
    assert splits(16, 1, 4096, head_dim=256) == 16  # 64 programs of 64 keys; 8 shares would give 512
    assert splits(16, 1, 8192, batch=2, head_dim=256) == 4  # 256 programs
    assert splits(8, 8, 8192, head_dim=256) == 1  # no group to share


def test_it_is_the_default_on_hopper_for_the_calls_it_supports(monkeypatch):
    """On Hopper, the calls its record declares (segment ids, lengths and dense masks
    among them); split-KV decoding keeps short queries, and everything else (float32,
    other GPUs) falls back to the Triton family."""
    monkeypatch.setattr(v3, "_hopper", lambda: True)

    def chosen(q_len=1024, dtype=jnp.bfloat16, **spec):
        inputs, config = _call((2, q_len, 8, 128), 1024, 2, 128, True, None, None, dtype)
        config = dataclasses.replace(config, mask=dataclasses.replace(config.mask, **spec))
        return registry.choose(inputs, config).name

    assert chosen() == "mosaic_v3"
    assert chosen(dtype=jnp.float16) == "mosaic_v3"
    assert chosen(q_len=1) == "pallas_decode"
    assert chosen(dtype=jnp.float32) == "pallas_v2"
    assert chosen(has_segments=True) == "mosaic_v3"
    assert chosen(has_dense_mask=True) == "mosaic_v3"
    assert chosen(has_lengths=True) == "mosaic_v3"
    monkeypatch.setattr(v3, "_hopper", lambda: False)
    assert chosen() == "pallas_v2"
    with pytest.raises(registry.Unsupported, match=r"mosaic_v3 needs Hopper GPUs \(sm_90\) on gpu.*'pallas_v2'"):
        registry.check(v3.IMPLEMENTATION, *_call(*CALLS["causal"]))


def test_tiles_are_multiples_of_wgmma_s_rows():
    """`Tuning` refuses tiles wgmma cannot take, naming them; the call's ``block_q`` and
    ``block_k`` round up to 64; the default ring fits in shared memory for every head dim."""
    with pytest.raises(ValueError, match=r"block_q=32 must be a positive multiple of 64"):
        v3.Tuning(block_q=32)
    with pytest.raises(ValueError, match=r"num_stages=1 must be an int >= 2"):
        v3.Tuning(num_stages=1)
    assert v3._tuning(None, 16, 96, 128, 128, 2) == v3.Tuning(block_q=64, block_k=128)
    for head_dim, block_k in ((64, 256), (128, 128), (256, 64)):
        tuning = v3.default_tuning(head_dim, head_dim, 2)
        assert tuning.block_k == block_k and tuning.shared_memory(head_dim, head_dim, 2) <= _ring.BLOCK_SHARED_MEMORY
        # The backward's query tiles: 128 rows at head dim 64 (measured), 64 beyond or with
        # a dense mask (128 spilled); the same for a user's tuning that names none.
        for user in (tuning, v3.Tuning(block_q=128), v3.Tuning(num_stages=3)):
            backward = user.backward_for(head_dim, head_dim)
            assert backward == mosaic_backward.BackwardTuning(block_q=128 if head_dim == 64 else 64)
            assert backward.fits(head_dim, head_dim, 2)
            dense = user.backward_for(head_dim, head_dim, masks_elements=True)
            assert dense == mosaic_backward.BackwardTuning(block_q=64)
            assert dense.fits(head_dim, head_dim, 2, dense=True)
        named = mosaic_backward.BackwardTuning(block_q=64, block_k=64)
        assert v3.Tuning(backward=named).backward_for(head_dim, head_dim) == named
    # Head dims of 256 and 192 leave the output's own tile room for a ring of 64-key tiles
    # (936 bytes to spare), but none beside a dense mask's, a bias's or segment ids': the
    # forward then pads both to 256, the output going through the queries' tile.
    assert v3._head_dims(200, 136, 2) == (256, 192) and v3._head_dims(136, 256, 2) == (192, 256)
    for beside in (v3.Beside(1), v3.Beside(2), v3.Beside(0, 4)):
        assert v3._head_dims(200, 136, 2, beside) == (256, 256) and v3._head_dims(136, 256, 2, beside) == (256, 256)
    assert v3._head_dims(192, 128, 2) == (192, 128) and v3._head_dims(80, 48, 2) == (128, 64)
    # Tiles asked for that do not fit shrink: stages, then key tiles, then query tiles.
    assert v3.Tuning(64, 128, 4).fit(128, 128, 2) == v3.Tuning(64, 128, 3)
    assert v3.Tuning(64, 256, 2).fit(128, 128, 2) == v3.Tuning(64, 128, 2)
    assert v3.Tuning(256, 256, 4).fit(256, 256, 2) == v3.Tuning(64, 64, 2)
    assert v3._tuning(None, 128, 256, 256, 256, 2) == v3.Tuning(block_q=64, block_k=64)
    assert v3._tuning(v3.Tuning(num_stages=3), None, None, 64, 64, 2) == v3.Tuning(num_stages=3)
    # Persistent programs give the output a tile of its own; they stop being persistent
    # before their tiles shrink.
    with pytest.raises(ValueError, match=r"persistent=1 must be a bool"):
        v3.Tuning(persistent=1)
    with pytest.raises(ValueError, match=r"output_slots=None must be a bool"):
        v3.Tuning(output_slots=None)
    output = 2 * 64 * 128 * 2
    assert v3.Tuning(persistent=True).shared_memory(128, 128, 2) == v3.Tuning().shared_memory(128, 128, 2) + output
    assert v3.Tuning(64, 128, 3, persistent=True).fit(128, 128, 2) == v3.Tuning(64, 128, 2, persistent=True)
    # Where the output's own tile leaves no room, it goes through two slots of 64 columns a
    # consumer (a quarter of the tile at head dim 256), and persistence goes only after.
    slots = v3.Tuning(64, 64, 2, persistent=True, output_slots=True)
    assert slots.output_tile(256) == (2, 64, 64) and slots.output_tile(64) == (1, 64, 64)
    assert v3.Tuning(64, 64, 2, persistent=True).output_tile(256) == (64, 256)
    assert slots.shared_memory(256, 256, 2) == v3.Tuning(64, 64).shared_memory(256, 256, 2) + output
    assert v3.Tuning(64, 64, 3, persistent=True).fit(256, 256, 2) == slots
    assert slots.fit(256, 256, 2, v3.Beside(1)) == v3.Tuning(64, 64, 2)
    assert v3.Tuning(64, 128, 2, persistent=True).fit(256, 256, 2) == v3.Tuning(64, 64, 2)
    # A dense mask's ring of int8 tiles, 128 rows by the key tile, takes its room too, and
    # its ready and free barriers of two stages.
    dense_ring = 2 * 128 * 128 + 2 * 2 * 8
    assert v3.Tuning().shared_memory(128, 128, 2, v3.Beside(1)) == v3.Tuning().shared_memory(128, 128, 2) + dense_ring
    assert v3.Tuning(64, 256, 3).fit(64, 64, 2) == v3.Tuning(64, 256, 3)
    assert v3.Tuning(64, 256, 3).fit(64, 64, 2, v3.Beside(1)) == v3.Tuning(64, 256, 2)
    for head_dim in (64, 128, 256):
        dense = MaskSpec.create(4096, 4096, has_dense_mask=True)
        tuning = v3._tuning(None, None, None, head_dim, head_dim, 2, dense)
        assert tuning.shared_memory(head_dim, head_dim, 2, v3.Beside(1)) <= _ring.BLOCK_SHARED_MEMORY
        assert tuning.block_k == (64 if head_dim == 256 else 128)  # 256-key tiles spill their mask
    # A bias's ring, in the bias's dtype (beside a dense mask's): key tiles of at most 128,
    # and as many as fit (at head dim 128 with a bf16 bias, 128: Mosaic GPU counts 231576
    # bytes of the block's 232448).
    segments = MaskSpec.create(4096, 4096, has_segments=True)
    assert v3.Beside.of(dense, 4) == v3.Beside(5, 0) and v3.Beside.of(segments, 2) == v3.Beside(2, 4)
    cases = ((64, None, 2, 128), (128, None, 2, 128), (128, dense, 4, 64), (128, segments, 2, 64))
    for head_dim, spec, bias_itemsize, block_k in cases:
        tuning = v3._tuning(None, None, None, head_dim, head_dim, 2, spec, bias_itemsize)
        assert tuning.block_k == block_k
        beside = v3.Beside.of(spec, bias_itemsize)
        assert tuning.shared_memory(head_dim, head_dim, 2, beside) <= _ring.BLOCK_SHARED_MEMORY


def test_a_bias_runs_on_the_triton_kernels_where_its_ring_does_not_fit(monkeypatch):
    """The forward takes a bias given at every query and key whose ring fits beside the
    smallest tiles (at head dim 256 a 16-bit one alone; not one broadcast over the
    queries, which it would materialise), and the backward one whose rings and
    gradient's tiles fit (not at head dim 256, where the dQ kernel's consumers share
    their rows; not a float32 gradient beside a bias's ring at head dim 128); both hand
    the others to the Triton family with this family's tuning dropped, and the sinks to
    its forward, which takes them."""
    calls = []
    monkeypatch.setattr(v3, "forward_pass", lambda *args: calls.append("mosaic") or (None, None))
    monkeypatch.setattr(v3, "backward_pass", lambda *args: calls.append("mosaic backward") or (None,) * 4)
    triton = types.SimpleNamespace(
        forward=lambda inputs, config: calls.append(("triton", config.tuning, inputs.sinks is not None)) or (None,) * 3,
        backward=lambda *args: calls.append(("triton backward", args[-1].tuning)) or (None,) * 4,
    )
    monkeypatch.setattr(v3, "triton_v2", types.SimpleNamespace(IMPLEMENTATION=triton))
    biased = (("causal", "bias"), ("d256_causal", "bias"), ("causal", "bias32+dense"), ("causal", "bias_keys+sinks"))
    taken = (("window_gqa_ragged_d80_v48", "bias"), ("full_d64", "bias32+dense"), ("causal", ""))
    for name, runtime in (*biased, *taken):
        inputs, config = _call(*CALLS[name], runtime=runtime, tuning=v3.Tuning())
        v3._forward(inputs, config)
        v3._backward(inputs, None, None, None, None, config)
    assert calls == [
        *("mosaic", ("triton backward", None)),  # batch 2, a bias per head: a float32 gradient
        *("mosaic", ("triton backward", None)),
        *("mosaic", ("triton backward", None)),
        *(("triton", None, True), ("triton backward", None)),
        *("mosaic", "mosaic backward") * 3,
    ]


def test_segment_ids_take_key_tiles_of_at_most_128(monkeypatch):
    """Packed documents (segment ids) take 128-key tiles where 256 would fit (head dim 64,
    measured: `v3.default_tuning`), as the same call without them does not, and 64-row
    query tiles in the backward (`default_backward_tuning`)."""
    for head_dim, block_k in ((64, 128), (128, 128), (256, 64)):
        spec = MaskSpec.create(16384, 16384, causal=True, has_segments=True)
        assert v3._tuning(None, None, None, head_dim, head_dim, 2, spec).block_k == block_k
    assert v3._tuning(None, None, None, 64, 64, 2, MaskSpec.create(16384, 16384, causal=True)).block_k == 256
    # The backward's query tiles: 128 rows at head dim 64, 64 where segment ids (or a
    # dense mask) mask single elements, as `v3._backward` asks for them.
    tiles = []
    monkeypatch.setattr(v3, "backward_pass", lambda *args: tiles.append(args[-1].block_q) or (None,) * 4)
    for runtime in ("", "segments", "dense", "lengths"):
        inputs, config = _call(*CALLS["full_d64"], runtime=runtime)
        v3._backward(inputs, None, None, None, None, config)
    assert tiles == [128, 64, 64, 128]


@pytest.mark.parametrize("queries_first", [False, True])
@pytest.mark.parametrize("snake", [False, True])
@pytest.mark.parametrize(
    "tiles, programs", [((4, 3, 2), 5), ((1, 7, 1), 7), ((3, 1, 1), 1), ((2, 8, 3), 48), ((5, 7, 1), 6)]
)
def test_persistent_programs_run_every_tile_once_in_rounds(tiles, programs, snake, queries_first):
    """`Schedule`'s programs (the ``"programs"`` axis, here a vmap's) run every (head,
    query tile, batch) of the grid once, in rounds of the order a launch would start them
    (heads fastest) or with the query tiles fastest, every other one backwards when
    snaking; one program per tile without programs."""
    schedule = _ring.Schedule(tiles, programs, snake, queries_first=queries_first)
    assert schedule.grid == (programs,) and schedule.names == ("programs",)
    steps = -(-math.prod(tiles) // programs)

    def program(_):
        indices = [jnp.stack(schedule.index(jnp.int32(i))) for i in range(steps)]
        return schedule.count(), jnp.stack(indices)

    counts, indices = jax.vmap(program, axis_name="programs")(jnp.arange(programs))
    heads, q_tiles, _ = tiles
    ran = []
    for p in range(programs):
        for i in range(int(counts[p])):
            h, t, b = (int(x) for x in indices[p, i])
            place = t + q_tiles * (h + heads * b) if queries_first else h + heads * (t + q_tiles * b)
            assert place == i * programs + (programs - 1 - p if snake and i % 2 else p)
            ran.append(place)
    assert sorted(ran) == list(range(math.prod(tiles)))
    assert _ring.Schedule(tiles).grid == tiles and _ring.Schedule(tiles).names == ("heads", "q_tiles", "batch")
    with pytest.raises(ValueError, match=r"programs=0 must be in \[1, 24\] for tiles=\(4, 3, 2\)"):
        _ring.Schedule((4, 3, 2), 0)
    with pytest.raises(ValueError, match=r"queries_first=True needs persistent programs in rounds, not programs=None"):
        _ring.Schedule((4, 3, 2), queries_first=True)
    with pytest.raises(ValueError, match=r"queries_first=True needs persistent programs in rounds, .*ordered=True"):
        _ring.Schedule((4, 3, 2), 5, ordered=True, queries_first=True)


@pytest.mark.parametrize("queries_first", [False, True])
@pytest.mark.parametrize("tiles, programs", [((4, 3, 2), 5), ((2, 7, 1), 3), ((3, 2, 1), 6)])
def test_dealt_programs_run_every_tile_once_each_taking_the_next_when_free(tiles, programs, queries_first):
    """`Schedule.dealt`: each tile goes to the program the work dealt so far frees first
    (the lowest-numbered among equals), in place order cut into stretches of as many
    heads' query tiles as a round holds, the heaviest first within each; the programs (a
    vmap's ``"programs"`` axis) read their tiles from the plan, their own counts of them."""
    work = [5.0, 1.0, 3.0, 2.0, 4.0, 1.0, 2.0][: tiles[1]]
    schedule = _ring.Schedule.dealt(tiles, work, programs, queries_first)
    heads, q_tiles, _ = tiles
    places = range(math.prod(tiles))
    work_at = [work[place % q_tiles if queries_first else place // heads % q_tiles] for place in places]
    stretch = q_tiles * max(1, programs // q_tiles)  # (4, 3, 2) on 5: 3 places; (2, 7, 1) on 3: 7; (3, 2, 1) on 6: 6
    expected, load = [[] for _ in range(programs)], [0.0] * programs
    # By hand: the stretches in turn, each heaviest first, to the least loaded program
    # (the first of equals).
    for place in sorted(places, key=lambda place: (place // stretch, -work_at[place])):
        p = load.index(min(load))
        expected[p].append(place)
        load[p] += work_at[place]
    assert schedule.busiest(work) == max(load)
    (plan,) = schedule.operands()
    steps = max(map(len, expected))

    def program(_):
        indices = [jnp.stack(schedule.index(jnp.int32(i), plan)) for i in range(steps)]
        return schedule.count(plan), jnp.stack(indices)

    counts, indices = jax.vmap(program, axis_name="programs")(jnp.arange(programs))
    for p in range(programs):
        assert int(counts[p]) == len(expected[p])
        for i, place in enumerate(expected[p]):
            h, t, b = (int(x) for x in indices[p, i])
            assert (t + q_tiles * (h + heads * b) if queries_first else h + heads * (t + q_tiles * b)) == place
    with pytest.raises(ValueError, match=r"a plan of 3 entries needs 24 tiles dealt to persistent programs"):
        _ring.Schedule((4, 3, 2), 5, plan=(0, 1, 2))
    with pytest.raises(ValueError, match=r"needs 24 tiles dealt to persistent programs, not .*snake=True"):
        dataclasses.replace(_ring.Schedule.dealt((4, 3, 2), [1, 1, 1], 5), snake=True)


def _run_schedule(schedule: _ring.Schedule, order=None) -> list[tuple[int, int, int]]:
    """The (head, query tile, batch) tiles ``schedule``'s persistent programs run, in launch
    order: each program's ``i``-th tile at place ``i * programs + p``."""
    steps = -(-math.prod(schedule.tiles) // schedule.programs)

    def program(_):
        return schedule.count(), jnp.stack([jnp.stack(schedule.index(jnp.int32(i), order)) for i in range(steps)])

    counts, indices = jax.vmap(program, axis_name="programs")(jnp.arange(schedule.programs))
    placed = {}
    for p in range(schedule.programs):
        for i in range(int(counts[p])):
            column = schedule.programs - 1 - p if schedule.snake and i % 2 else p
            placed[i * schedule.programs + column] = tuple(int(x) for x in indices[p, i])
    return [placed[place] for place in sorted(placed)]


@pytest.mark.parametrize("bounds_shape", [(2, 1), (1, 4), (2, 4)])
@pytest.mark.parametrize("programs", [5, 24])
def test_ordered_schedules_run_every_tile_once_heaviest_first(programs, bounds_shape):
    """An ordered `Schedule` runs every (head, query tile, batch) once, in launch order
    (rounds of persistent programs snaking) from the most key tiles of the runtime bounds
    to the fewest, ties in grid order (`_ring.tile_order`), for bounds per batch element,
    per head, or both."""
    tiles = (4, 3, 2)
    heads, q_tiles, batch = tiles
    lo_key, width_key = jax.random.split(jax.random.key(7))
    lo = jax.random.randint(lo_key, (*bounds_shape, q_tiles), 0, 4)
    hi = lo + jax.random.randint(width_key, lo.shape, 0, 4)  # ties among the widths
    bounds = jnp.stack([lo, lo, hi, hi], axis=-1)
    spec = MaskSpec.create(q_tiles * 64, 8 * 64, has_segments=True)  # positions bound no key tile
    order = _ring.tile_order(spec, bounds, batch, 64, 64)
    assert order.dtype == jnp.int32 and order.shape == (batch * bounds_shape[1] * q_tiles,)

    def width(h, t, b):
        return int(hi[b % bounds_shape[0], h % bounds_shape[1], t] - lo[b % bounds_shape[0], h % bounds_shape[1], t])

    ran = _run_schedule(_ring.Schedule(tiles, programs, snake=True, ordered=True), order)
    with pytest.raises(ValueError, match=r"ordered=True needs persistent programs, not programs=None"):
        _ring.Schedule(tiles, ordered=True)
    assert sorted(ran) == sorted((h, t, b) for h in range(heads) for t in range(q_tiles) for b in range(batch))
    widths = [width(*tile) for tile in ran]
    assert widths == sorted(widths, reverse=True)
    grid_order = [(b, t, h) for h, t, b in ran]
    for width_ in set(widths):
        same = [g for g, w in zip(grid_order, widths) if w == width_]
        if bounds_shape[1] > 1:
            assert same == sorted(same, key=lambda g: (g[0], g[2], g[1]))  # units (batch, head, tile)
        else:
            assert same == sorted(same)


def test_the_forward_orders_persistent_programs_by_the_runtime_bounds(monkeypatch):
    """`v3._schedule`: one program per tile unless persistent; persistent programs balanced
    on the host without runtime bounds, else ordered by `_ring.tile_order`, whose order
    is the kernel's one extra operand."""
    monkeypatch.setattr(_ring, "multiprocessors", lambda: 132)
    tiles, rows = (16, 16, 8), 128
    lengths = MaskSpec.create(2048, 2048, causal=True, has_lengths=True)
    bounds = lengths.tile_bounds(rows, 128, lengths=jnp.asarray([[2048, 2048], [300, 300]] * 4, jnp.int32))
    one_per_tile = v3._schedule(lengths, v3.Tuning(), tiles, rows, bounds)
    assert one_per_tile == (_ring.Schedule(tiles), ())
    schedule, (order,) = v3._schedule(lengths, v3.Tuning(persistent=True), tiles, rows, bounds)
    assert schedule == _ring.Schedule(tiles, 132, snake=True, ordered=True)
    assert order.tolist() == _ring.tile_order(lengths, bounds, 8, rows, 128).tolist()
    structured = MaskSpec.create(2048, 2048, causal=True)
    schedule, operands = v3._schedule(structured, v3.Tuning(persistent=True), tiles, rows, None)
    assert not schedule.ordered and schedule.programs is not None and operands == ()  # dealing saves too little
    assert not schedule.queries_first  # over 2048 keys or fewer, heads fastest
    causal = MaskSpec.create(16384, 16384, causal=True)
    schedule, operands = v3._schedule(causal, v3.Tuning(persistent=True), (16, 128, 1), rows, None)
    assert schedule.queries_first and schedule.programs == 132 and schedule.plan is not None
    assert [operand.tolist() for operand in operands] == [list(schedule.plan)]  # dealt: the plan is the operand
    full = MaskSpec.create(8192, 8192)
    schedule, operands = v3._schedule(full, v3.Tuning(persistent=True), tiles, rows, None)
    assert schedule == _ring.Schedule(tiles, 132, queries_first=True) and operands == ()


def _partitioned(monkeypatch, call: tuple, runtime: str = "", persistent: bool = True):
    """``jax.value_and_grad`` of the public call on mosaic_v3 with `_call`'s abstract
    inputs of ``call`` and ``runtime``, traced and lowered for CUDA through
    `jaxtile.distributed`'s ``custom_partitioning`` (which the interpreted tests step
    around: `mosaic_interpreter`), on 132 multiprocessors; the lowered call."""
    monkeypatch.setattr(_ring, "multiprocessors", lambda: 132)
    unable = registry.Implementation.unable
    monkeypatch.setattr(
        registry.Implementation, "unable", lambda self, p: None if self.family == "mosaic" else unable(self, p)
    )
    *_, causal, window, soft_cap, _ = call
    inputs, _ = _call(*call, runtime=runtime)
    lengths = None if inputs.lengths is None else jax.ShapeDtypeStruct(inputs.lengths.shape[:1], jnp.int32)
    ids = None if inputs.q_segment_ids is None else (inputs.q_segment_ids, inputs.kv_segment_ids)
    arrays = dict(
        segment_ids=ids, mask=inputs.mask, q_lengths=lengths, kv_lengths=lengths, bias=inputs.bias, sinks=inputs.sinks
    )

    options = dict(causal=causal, window=window, logits_soft_cap=soft_cap, tuning=v3.Tuning(persistent=persistent))

    def loss(q, k, v, arrays):
        out = jaxtile.flash_attention(q, k, v, **arrays, **options, implementation="mosaic_v3")
        return out.astype(jnp.float32).sum()

    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(*inputs[:3], arrays)
    assert [grad.shape for grad in lowered.out_info[1]] == [x.shape for x in inputs[:3]]
    return lowered.lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("runtime", ["", "segments", "lengths", "dense", "bias", "sinks", "segments+lengths+bias"])
def test_every_runtime_input_traces_through_the_partitioned_call(runtime, persistent, monkeypatch):
    """``custom_partitioning`` takes no constants of the function it traces: every runtime
    part of the mask, and the bias and sinks, reach mosaic_v3's kernels, forward and
    backward, through it (a GQA window over more keys than queries, head dims 80 and 48)."""
    lowered = _partitioned(monkeypatch, CALLS["window_gqa_ragged_d80_v48"], runtime, persistent)
    assert "mosaic_gpu" in lowered.as_text()


def test_a_dealt_plan_reaches_the_kernel_through_the_partitioned_call(monkeypatch):
    """The plan is made by a ``jit`` of its own (`_ring._constant`), so the partitioned
    call traces and lowers with the head dim 128, causal, 16K tiles dealt to 132 programs."""
    schedule, taken = v3._schedule, []
    monkeypatch.setattr(v3, "_schedule", lambda *args: taken.append(schedule(*args)) or taken[-1])
    _partitioned(monkeypatch, ((1, 16384, 16, 128), 16384, 16, 128, True, None, None, jnp.bfloat16))
    (dealt, (plan,)) = taken[0]
    assert dealt.plan is not None and plan.shape == (len(dealt.plan),)


def test_the_tile_order_counts_the_key_tiles_positions_leave():
    """Two causal documents of two query tiles each: a document's second tile visits two
    key tiles and its first one, so the order runs the second tiles first."""
    spec = MaskSpec.create(4 * 128, 4 * 128, causal=True, has_segments=True)
    bounds = jnp.asarray([[[[0, 0, 2, 2], [0, 0, 2, 2], [2, 2, 4, 4], [2, 2, 4, 4]]]], jnp.int32)
    assert _ring.tile_order(spec, bounds, 1, 128, 128).tolist() == [1, 3, 0, 2]


def test_persistent_programs_even_out_their_shares_of_uneven_tiles():
    """`Schedule.balanced` picks the count (at most the multiprocessors, at least 7/8 of
    them) and order whose busiest program has the least work: equal tiles go round on
    every multiprocessor; causal tiles (heaviest first) whose rounds would keep each
    program on nearly the same query tile snake, on fewer programs where that evens
    them out, or are dealt to every multiprocessor as they free (`Schedule.dealt`) where
    that evens them out more, by more than ``dealing``."""
    assert _ring.Schedule.balanced((16, 8, 16), [1] * 8, 132) == _ring.Schedule((16, 8, 16), 132)
    causal = [8 - t + 1 for t in range(8)]  # key tiles of a 1K causal call's query tiles, heaviest first, plus one
    rounds = [_ring.Schedule((16, 8, 16), p, snake) for p in range(132, 115, -1) for snake in (False, True)]
    snaking = min(rounds, key=lambda schedule: schedule.busiest(causal))
    assert snaking == _ring.Schedule((16, 8, 16), 128, True) and snaking.busiest(causal) == 88
    assert snaking.busiest(causal) < _ring.Schedule((16, 8, 16), 132).busiest(causal) / 1.3
    balanced = _ring.Schedule.balanced((16, 8, 16), causal, 132)
    assert balanced == _ring.Schedule.dealt((16, 8, 16), causal, 132) and balanced.busiest(causal) == 87
    # Dealing costs the forward's programs `v3._DEALING` key tiles: one fewer is not worth it.
    assert _ring.Schedule.balanced((16, 8, 16), causal, 132, dealing=v3._DEALING) == snaking
    # The busiest program's work, counted by hand: 16 x 8 x 16 tiles dealt round 132 programs.
    ran = [[] for _ in range(132)]
    for place in range(16 * 8 * 16):
        ran[place % 132].append(causal[place // 16 % 8])
    assert _ring.Schedule((16, 8, 16), 132).busiest(causal) == max(map(sum, ran))
    # The query tiles fastest: place p holds query tile p % 8.
    ran = [[] for _ in range(132)]
    for place in range(16 * 8 * 16):
        ran[place % 132].append(causal[place % 8])
    assert _ring.Schedule((16, 8, 16), 132, queries_first=True).busiest(causal) == max(map(sum, ran))
    queries_first = _ring.Schedule.balanced((16, 8, 16), [1] * 8, 132, queries_first=True)
    assert queries_first == _ring.Schedule((16, 8, 16), 132, queries_first=True)
    assert _ring.Schedule.balanced((2, 2, 1), [1, 1], 132) == _ring.Schedule((2, 2, 1), 4)
    # Head dim 128, causal, 16K (128 query tiles of 128 rows in 16 heads, heaviest first,
    # 128-key tiles): 128 programs snaking take 1048 key tiles each, 4 multiprocessors
    # idle; all 132 dealt the tiles as they free take at most 1021, an even share 1016.
    causal_16k = [128 - t + 1 for t in range(128)]
    rounds = _ring.Schedule((16, 128, 1), 128, True, queries_first=True)
    assert rounds.busiest(causal_16k) == 1048 and sum(causal_16k) * 16 / 132 > 1016
    dealt = _ring.Schedule.balanced((16, 128, 1), causal_16k, 132, queries_first=True, dealing=v3._DEALING)
    assert dealt == _ring.Schedule.dealt((16, 128, 1), causal_16k, 132, queries_first=True)
    assert dealt.busiest(causal_16k) == 1021
    # GQA 32:8, causal 8K (64 query tiles in 32 heads and 2 batch elements): rounds take
    # 1072, the tiles dealt in place order 1069; dealt heaviest first within stretches of
    # two heads' tiles (one round's), 1040, the even share.
    causal_8k = [64 - t + 1 for t in range(64)]
    rounds = _ring.Schedule.balanced((32, 64, 2), causal_8k, 132, queries_first=True, dealing=float("inf"))
    assert rounds.plan is None and rounds.busiest(causal_8k) == 1072
    dealt = _ring.Schedule.balanced((32, 64, 2), causal_8k, 132, queries_first=True, dealing=v3._DEALING)
    assert dealt.plan is not None and dealt.busiest(causal_8k) == 1040 == math.ceil(sum(causal_8k) * 64 / 132)
    # The programs' first tiles are of heads 0 to 3 alone, as a round's are (heaviest first
    # over the whole grid, they would be of every head and batch element).
    firsts = [dealt.plan[133 + start] for start in dealt.plan[:132]]
    assert {place // 64 for place in firsts} == {0, 1, 2, 3}


def test_persistent_programs_by_default_where_query_tiles_visit_few_keys_or_have_no_left_bound():
    """Calls whose query tiles each visit 2048 keys or fewer (`v3._PERSISTENT_KEYS`), or
    more with no left bound and no lengths (those in rounds of whole heads' query tiles,
    `v3._queries_first`), with no segment ids and no dense mask, default to persistent
    programs (measured), where their output tile fits (not beside 192-key tiles:
    `test_long_unbounded_calls_take_192_key_tiles`); a user's tuning keeps its own."""
    for (q_len, kv_len), options, head_dim, persistent, queries_first in (
        ((16384, 16384), dict(window=(256, 256)), 128, True, False),
        ((16384, 16384), dict(causal=True, window=(1023, 0)), 128, True, False),
        ((1024, 1024), dict(), 64, True, False),
        ((2048, 2048), dict(causal=True), 128, True, False),
        ((1, 1024), dict(), 128, True, False),
        ((4096, 4096), dict(), 64, True, True),
        ((4096, 4096), dict(), 128, True, True),
        ((16384, 16384), dict(), 64, True, True),
        ((16384, 16384), dict(), 128, False, True),
        ((4096, 4096), dict(causal=True), 64, True, True),
        ((1000, 16384), dict(causal=True), 128, True, True),
        ((1100, 2500), dict(causal=True), 128, True, True),  # PERSISTENT_CASES' two in this order
        ((700, 2300), dict(), 96, True, True),
        ((1, 131072), dict(), 128, False, True),
        ((1, 131072), dict(causal=True), 128, True, True),
        ((4096, 4096), dict(has_lengths=True), 128, False, False),
        ((4096, 4096), dict(causal=True, has_lengths=True), 128, False, False),
        ((16384, 16384), dict(window=(1000, 1000)), 128, False, False),
        ((16384, 16384), dict(causal=True, window=(4095, 0)), 128, False, False),
        ((16384, 16384), dict(window=(256, 256)), 256, True, False),  # the output through slots
        ((1024, 1024), dict(has_segments=True), 128, False, False),
        ((1024, 1024), dict(has_lengths=True), 128, True, False),
        ((1024, 1024), dict(has_dense_mask=True), 128, False, False),
    ):
        spec = MaskSpec.create(q_len, kv_len, **options)
        tuning = v3._tuning(None, None, None, head_dim, head_dim, 2, spec)
        assert tuning.persistent == persistent, (q_len, kv_len, options, head_dim)
        assert v3._queries_first(spec, _ring.CONSUMERS * tuning.block_q) == queries_first, (q_len, kv_len, options)
        assert tuning.shared_memory(head_dim, head_dim, 2, v3.Beside.of(spec)) <= _ring.BLOCK_SHARED_MEMORY
    short = MaskSpec.create(1024, 1024)
    assert not v3._tuning(v3.Tuning(), None, None, 128, 128, 2, short).persistent


def test_head_dim_256_is_persistent_through_output_slots_where_measured_faster():
    """At head dim 256 persistent programs send their output through slots
    (`v3.Tuning.output_slots`); in rounds of whole heads' query tiles
    (`v3._queries_first`) only where query heads share K and V (``group`` > 1), as
    measured; short calls, windows and lengths with any group."""
    slots = v3.Tuning(64, 64, 2, persistent=True, output_slots=True)
    for (q_len, kv_len), options, group, want_slots in (
        ((4096, 4096), dict(causal=True), 16, True),
        ((8192, 8192), dict(causal=True), 4, True),
        ((4096, 4096), dict(), 4, True),
        ((8192, 8192), dict(causal=True), 1, False),
        ((4096, 4096), dict(), 1, False),
        ((1024, 1024), dict(causal=True), 1, True),
        ((16384, 16384), dict(window=(256, 256)), 1, True),
        ((2048, 2048), dict(has_lengths=True), 1, True),
        ((4096, 4096), dict(has_lengths=True), 16, False),
        ((1024, 1024), dict(has_segments=True), 16, False),
    ):
        spec = MaskSpec.create(q_len, kv_len, **options)
        tuning = v3._tuning(None, None, None, 256, 256, 2, spec, group=group)
        assert tuning == (slots if want_slots else v3.Tuning(64, 64, 2)), (q_len, kv_len, options, group, tuning)
    # A call's group and padded head dims decide: MQA at head dim 200 runs at 256.
    inputs, config = _call((1, 4096, 16, 200), 4096, 1, 200, True, None, None, jnp.bfloat16)
    assert v3._plan(inputs, config)[:3] == (256, 256, slots)
    inputs, config = _call((1, 4096, 16, 200), 4096, 16, 200, True, None, None, jnp.bfloat16)
    assert v3._plan(inputs, config)[:3] == (256, 256, v3.Tuning(64, 64, 2))


def test_every_swept_backward_candidate_fits():
    """``bench.tune --impl mosaic_v3`` times only backward tiles the Mosaic kernels take
    (one that did not fit would time the Triton backward under its name)."""
    for head_dim, candidates in tune.MOSAIC_BACKWARD.items():
        for candidate in candidates:
            assert mosaic_backward.BackwardTuning(*candidate).fits(head_dim, head_dim, 2), (head_dim, candidate)


# Backward calls whose tiles are partly masked in every way the kernels handle: a causal
# GQA group over lengths that are no tile multiple; packed documents in sequences of
# their own lengths (float16's scaled dS); a two-sided window, MQA and padded head dims;
# each of them again past head dim 128, where the kernels divide the work by role.
BACKWARD_CASES = [
    Case("gqa_causal_300", q_len=300, num_heads=8, num_kv_heads=2, head_dim=128, dtype="bfloat16", causal=True),
    Case("gqa_causal_300_d256", q_len=300, num_heads=8, num_kv_heads=2, head_dim=256, dtype="bfloat16", causal=True),
    Case(
        "segments_lengths_d160_v256",
        batch=(3,),
        q_len=200,
        head_dim=160,
        head_dim_v=256,
        dtype="float16",
        causal=True,
        segments=3,
        lengths="ragged",
    ),
    Case(
        "window_mqa_d200_v136",
        q_len=260,
        kv_len=330,
        num_kv_heads=1,
        head_dim=200,
        head_dim_v=136,
        dtype="bfloat16",
        window=(40, 10),
    ),
    Case(
        "segments_lengths_d64",
        batch=(3,),
        q_len=200,
        head_dim=64,
        dtype="float16",
        causal=True,
        segments=3,
        lengths="ragged",
    ),
    Case(
        "window_mqa_d80_v48",
        q_len=260,
        kv_len=330,
        num_kv_heads=1,
        head_dim=80,
        head_dim_v=48,
        dtype="bfloat16",
        window=(40, 10),
    ),
]


# Calls with dense masks: a random mask per head, every tile partly masked, over a GQA
# group (whose dK/dV programs visit the union of its heads' tiles) and ragged lengths
# that are no tile multiple; a padding mask, tiles whole, hidden or masked, in float16
# with head dim 64; rows that see no key, inside a two-sided window.
DENSE_CASES = [
    Case(
        "random_gqa_lengths_d80",
        batch=(2,),
        q_len=300,
        kv_len=1000,
        num_heads=8,
        num_kv_heads=2,
        head_dim=80,
        dtype="bfloat16",
        mask="random",
        lengths="ragged",
    ),
    Case("padding_fp16_d64", batch=(3,), q_len=700, head_dim=64, dtype="float16", mask="padding"),
    Case("empty_rows_window", q_len=520, head_dim=128, dtype="bfloat16", window=(100, 30), mask="empty_rows"),
    Case(
        "random_gqa_d256",
        batch=(2,),
        q_len=300,
        kv_len=500,
        num_heads=4,
        num_kv_heads=2,
        head_dim=256,
        dtype="bfloat16",
        mask="random",
    ),
]


def assert_exact(case: Case, tuning: v3.Tuning | None = None):
    """``case`` on mosaic_v3 with ``tuning`` against the float64 reference (`run_case`:
    outputs and gradients); also run under the interpreter (`test_mosaic_interpreted`)."""

    def mosaic_v3(q, k, v, **options):
        return jaxtile.flash_attention(q, k, v, implementation="mosaic_v3", tuning=tuning, **options)

    result = run_case(case, mosaic_v3)
    assert result.ok, result.describe()


def _fitting(candidates, cases):
    """The (case, candidate) pairs whose tiles the Mosaic backward takes at the case's
    padded head dims (others would run the Triton backward)."""
    tunings = sorted({c for cs in candidates for c in cs}, key=str)
    return [
        pytest.param(case, c, id=f"{case.name}-{c}")
        for case in cases
        for c in tunings
        if mosaic_backward.BackwardTuning(*c).fits(
            _ring.padded(case.head_dim, 64), _ring.padded(case.dim_v, 64), 2, case.mask is not None
        )
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("case, candidate", _fitting(tune.MOSAIC_BACKWARD.values(), BACKWARD_CASES + DENSE_CASES))
def test_swept_backward_tiles_are_exact_on_the_gpu(case, candidate):
    """Every backward tiling the sweep may pick, on the cases where it applies, against
    the float64 reference (outputs and the three gradients), before it can become a
    default."""
    assert_exact(case, v3.Tuning(backward=mosaic_backward.BackwardTuning(*candidate)))


def test_long_unbounded_calls_take_192_key_tiles():
    """Head dim 128 (after padding) over `v3._WIDE_KEYS` keys or more, where nothing bounds
    the keys a query sees, takes 192-key tiles with one program per query tile
    (measured); fewer keys, another head dim, or any bound keeps the other defaults."""
    wide = v3.Tuning(block_k=192)
    for (q_len, kv_len), options, head_dim, want_wide in (
        ((8192, 8192), dict(), 128, True),
        ((300, 8300), dict(), 128, True),
        ((1, 131072), dict(), 128, True),
        ((4096, 4096), dict(), 128, False),
        ((8192, 8192), dict(), 64, False),
        ((8192, 8192), dict(), 256, False),
        ((8192, 8192), dict(causal=True), 128, False),
        ((8192, 8192), dict(window=(None, 100)), 128, False),
        ((8192, 8192), dict(has_lengths=True), 128, False),
        ((8192, 8192), dict(has_segments=True), 128, False),
        ((8192, 8192), dict(has_dense_mask=True), 128, False),
    ):
        spec = MaskSpec.create(q_len, kv_len, **options)
        tuning = v3._tuning(None, None, None, head_dim, head_dim, 2, spec)
        assert (tuning == wide) == want_wide, (q_len, kv_len, options, head_dim, tuning)
    spec = MaskSpec.create(8192, 8192)
    assert v3._tuning(None, None, None, 128, 128, 2, spec, bias_itemsize=2).block_k == 128
    assert v3._tuning(v3.Tuning(), None, None, 128, 128, 2, spec) == v3.Tuning()


@pytest.mark.parametrize("kv_len, padded_to", [(16384, None), (8300, 8304), (1000, None), (60, 64)])
def test_the_forward_reads_the_last_key_tile_past_the_keys_end(kv_len, padded_to):
    """K and V reach the kernel as they are, or padded to `_ring.TILE_ROWS` rows only,
    never to a whole key tile: TMA reads the last tile past their end as zeros (keys the
    mask hides). 16384 keys take 192-key tiles, which they are no multiple of."""
    inputs, config = _call((1, 512, 2, 128), kv_len, 2, 128, False, None, None, jnp.bfloat16)
    lowered = jax.jit(lambda q, k, v: v3.forward_pass(Inputs(q, k, v), config)).trace(*inputs[:3])
    pads = re.findall(r"stablehlo\.pad .*-> tensor<(\w+)>", lowered.lower(lowering_platforms=("cuda",)).as_text())
    assert set(pads) == (set() if padded_to is None else {f"1x{padded_to}x2x128xbf16"})


# Calls that take 192-key tiles by default (`v3._WIDE_KEYS`): keys no multiple of the tile,
# GQA, and head dim 96 padded to 128.
WIDE_CASES = [
    Case("wide_keys", q_len=300, kv_len=8300, num_heads=2, head_dim=128, dtype="bfloat16"),
    Case("wide_keys_gqa_d96", q_len=200, kv_len=8250, num_heads=4, num_kv_heads=2, head_dim=96, dtype="float16"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", WIDE_CASES, ids=lambda case: case.name)
def test_192_key_tiles_are_exact_on_the_gpu(case):
    """The default 192-key tiles against the float64 reference: outputs and gradients."""
    spec = MaskSpec.create(case.q_len, case.kv)
    assert v3._tuning(None, None, None, 128, 128, 2, spec).block_k == 192
    assert_exact(case)


def _forward_tuning(case: Case, tuning: v3.Tuning | None = None) -> v3.Tuning:
    """The tuning mosaic_v3's forward runs ``case`` with (`v3._plan` of its abstract
    inputs): ``tuning`` fitted to its padded head dims, mask and bias, or the default."""
    bias = ("bias32" if case.bias == "full32" else "bias", case.bias)
    parts = (("segments", case.segments), ("lengths", case.lengths), ("dense", case.mask), bias)
    runtime = "+".join(part for part, has in parts if has)
    q_shape = (math.prod(case.batch), case.q_len, case.num_heads, case.head_dim)
    call = (q_shape, case.kv, case.kv_heads, case.dim_v, case.causal, case.window, case.logits_soft_cap)
    inputs, config = _call(*call, jnp.dtype(case.dtype), runtime, tuning=tuning)
    return v3._plan(inputs, config)[2]


def _persistence(params):
    """``params`` (each a case, or a tuple led by one) with ``persistent`` False, and True
    where the case's tiles leave room for persistent programs (elsewhere `Tuning.fit`
    falls back to one program per tile, which the False one runs)."""
    return [
        (*param, persistent)
        for param in (p if isinstance(p, tuple) else (p,) for p in params)
        for persistent in (False, True)
        if not persistent or _forward_tuning(param[0], v3.Tuning(persistent=True)).persistent
    ]


# Forward calls for persistent programs: BACKWARD_CASES' awkward masks where the tiles
# leave room for them (past head dim 128 `Tuning.fit` gives up persistence before the
# default 128-key tiles, `_persistence`), enough tiles that each of an H100's programs runs
# two (2 x 8 heads x 16 query tiles), ragged lengths alone (whose programs take the tiles
# heaviest first, `_ring.tile_order`), and more than 2048 keys with no left bound, causal
# (bottom-right) or not (whose programs take the query tiles fastest,
# `v3._queries_first`).
PERSISTENT_CASES = [
    *(case for case, persistent in _persistence(BACKWARD_CASES) if persistent),
    Case("causal_256_tiles", batch=(2,), q_len=2048, num_heads=8, head_dim=128, dtype="bfloat16", causal=True),
    Case(
        "lengths_gqa_causal",
        batch=(3,),
        q_len=700,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        dtype="bfloat16",
        causal=True,
        lengths="ragged",
    ),
    Case("causal_queries_first", q_len=1100, kv_len=2500, num_heads=6, head_dim=128, dtype="bfloat16", causal=True),
    Case("full_queries_first_d96", batch=(2,), q_len=700, kv_len=2300, num_heads=3, head_dim=96, dtype="float16"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [3, 20, None])
@pytest.mark.parametrize("case", PERSISTENT_CASES, ids=lambda case: case.name)
def test_persistent_programs_are_exact_on_the_gpu(case, programs, monkeypatch, request):
    """Persistent programs (`Tuning.persistent`) against the float64 reference, outputs
    and gradients: as many programs as multiprocessors, and 3 so that each runs many
    tiles of uneven lengths and the ring's slots carry over from tile to tile (the count
    is read when the kernel is traced: jax's caches are cleared around the test); the 3
    programs are dealt causal_256_tiles' tiles (dealing costs nothing here: `v3._DEALING`),
    and 20 causal_queries_first's, heaviest first within stretches of two heads' tiles
    (`_ring.Schedule.dealt`), which is not place order."""
    assert _forward_tuning(case, v3.Tuning(persistent=True)).persistent
    if programs is not None:
        monkeypatch.setattr(_ring, "multiprocessors", lambda: programs)
        monkeypatch.setattr(v3, "_DEALING", 0)
    jax.clear_caches()
    request.addfinalizer(jax.clear_caches)
    assert_exact(case, v3.Tuning(persistent=True))


# Calls whose default at head dim 256 is persistent programs with their output through
# slots (`v3.Tuning.output_slots`): MQA, causal (bottom-right) over more keys than
# queries and GQA with head dim 200 (padded to 256), both in rounds of whole heads
# (`v3._queries_first`); a two-sided window; ragged lengths (the tiles heaviest first).
SLOT_CASES = [
    Case(
        "slots_mqa_causal",
        q_len=1100,
        kv_len=2500,
        num_heads=8,
        num_kv_heads=1,
        head_dim=256,
        dtype="bfloat16",
        causal=True,
    ),
    Case(
        "slots_gqa_d200", batch=(2,), q_len=700, kv_len=2300, num_heads=8, num_kv_heads=2, head_dim=200, dtype="float16"
    ),
    Case("slots_window", q_len=1500, num_heads=4, head_dim=256, dtype="bfloat16", window=(300, 200)),
    Case(
        "slots_lengths",
        batch=(3,),
        q_len=900,
        num_heads=4,
        head_dim=256,
        dtype="bfloat16",
        causal=True,
        lengths="ragged",
    ),
]


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [3, None])
@pytest.mark.parametrize("case", SLOT_CASES, ids=lambda case: case.name)
def test_output_slots_are_exact_on_the_gpu(case, programs, monkeypatch, request):
    """The default at head dim 256, persistent programs whose output leaves through slots,
    against the float64 reference (outputs and gradients): as many programs as
    multiprocessors, and 3, each running many tiles (the slots reused tile after tile)."""
    assert _forward_tuning(case) == v3.Tuning(64, 64, 2, persistent=True, output_slots=True)
    if programs is not None:
        monkeypatch.setattr(_ring, "multiprocessors", lambda: programs)
    jax.clear_caches()
    request.addfinalizer(jax.clear_caches)
    assert_exact(case)


# Packed documents long enough that masked steps (the causal diagonal, a window's edge)
# fall both inside one document and across a document's edge.
DOCUMENT_CASES = [
    Case("documents_causal_d128", q_len=1100, num_heads=2, head_dim=128, dtype="bfloat16", causal=True, segments=3),
    Case(
        "documents_window_gqa_d64",
        q_len=1300,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        dtype="float16",
        causal=True,
        window=(300, 0),
        segments=2,
    ),
]


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("case", DOCUMENT_CASES, ids=lambda case: case.name)
def test_packed_documents_are_exact_on_the_gpu(case, persistent):
    """Packed documents against the float64 reference, outputs and gradients, with one
    program per query tile and with persistent programs."""
    assert_exact(case, v3.Tuning(persistent=True) if persistent else None)


@pytest.mark.gpu
@pytest.mark.parametrize("case, persistent", _persistence(DENSE_CASES), ids=lambda p: getattr(p, "name", str(p)))
def test_dense_masks_are_exact_on_the_gpu(case, persistent):
    """The forward and the backward kernels reading dense masks tile by tile
    (`_ring.dense_stream`), with one program per query tile and persistent programs
    (where they fit), against the float64 reference: outputs and the three gradients."""
    assert_exact(case, v3.Tuning(persistent=persistent))


# A bias beside every mask the forward's ring carries: GQA, a window and ragged lengths at
# head dim 80; one shared by every head with segment ids in float16 at head dim 128
# (whose float32 gradient sends the backward to the Triton kernels) and with GQA at head
# dim 64; a float32 one beside bf16 inputs, causal, with rows no tile multiple; causal
# at head dim 128 (the forward in 128-key tiles) and 256 (the forward's ring fits a bf16
# bias; the backward is Triton's); with a soft cap and rows that see no key. The second
# of each pair: whether the Mosaic backward takes the call (`v3._backward_tuning`).
BIAS_CASES = [
    (
        Case(
            "bias_gqa_window_lengths_d80",
            batch=(2,),
            q_len=300,
            kv_len=700,
            num_heads=8,
            num_kv_heads=2,
            head_dim=80,
            dtype="bfloat16",
            causal=True,
            window=(250, 0),
            lengths="ragged",
            bias="full",
        ),
        True,
    ),
    (Case("bias_shared_segments_fp16", q_len=520, head_dim=128, dtype="float16", segments=3, bias="shared"), False),
    (
        Case(
            "bias_shared_gqa_causal_d64_fp16",
            q_len=700,
            num_heads=8,
            num_kv_heads=2,
            head_dim=64,
            dtype="float16",
            causal=True,
            bias="shared",
        ),
        True,
    ),
    (
        Case(
            "bias_float32_causal_d64", batch=(2,), q_len=300, head_dim=64, dtype="bfloat16", causal=True, bias="full32"
        ),
        True,
    ),
    (Case("bias_causal_d128", q_len=700, head_dim=128, dtype="bfloat16", causal=True, bias="full"), True),
    (Case("bias_causal_d256", q_len=300, head_dim=256, dtype="bfloat16", causal=True, bias="full"), False),
    (
        Case(
            "bias_soft_cap_empty_rows_d64",
            q_len=1100,
            head_dim=64,
            dtype="bfloat16",
            logits_soft_cap=20.0,
            mask="empty_rows",
            bias="full",
        ),
        True,
    ),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case, mosaic_backward, persistent", _persistence(BIAS_CASES), ids=lambda p: getattr(p, "name", str(p))
)
def test_a_bias_is_exact_on_the_gpu(case, mosaic_backward, persistent, monkeypatch, request):
    """The forward reading the bias tile by tile (`_ring.bias_stream`), with one program
    per query tile and persistent programs (where they fit), and the Mosaic backward (reading it in both
    kernels, the dQ kernel writing its gradient and zeros where the mask hides a tile)
    or the Triton one, each where the call goes, against the float64 reference: outputs
    and the four gradients."""
    taken = []
    monkeypatch.setattr(v3, "backward_pass", lambda *args: taken.append(args) or mosaic_backward_pass(*args))
    jax.clear_caches()
    request.addfinalizer(jax.clear_caches)
    assert_exact(case, v3.Tuning(persistent=persistent))
    assert bool(taken) == mosaic_backward
