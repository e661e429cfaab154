"""The Triton kernels lower for CUDA without a GPU, to modules that verify.

Interpret mode runs a kernel's jaxpr through XLA on the CPU, which forgives what the
Triton lowering does not (an ``arith`` op given operands of two types fails only when
the GPU's XLA parses the module). Here each Triton implementation's kernels are lowered
for sm_90 (Pallas's target where no GPU is present) and every module is verified.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax._src.pallas.triton import pallas_call_registration as registration

import jaxtile
import jaxtile.api
from bench import lowered
from jaxtile import registry
from jaxtile._core import HOPPER_SMS
from jaxtile.triton import _kernel as pk

TRITON = [i for i in registry.implementations() if i.family == "triton"]
# Lengths alone (the kernels form the tile bounds from them), with and without a window,
# and segment ids beside a bias (the bounds read from an array; the bias's gradient written).
MASKS = {
    "lengths": (frozenset({"lengths", "gqa"}), dict()),
    "lengths_window": (frozenset({"causal", "window", "lengths", "gqa"}), dict(causal=True, window=(30, 0))),
    "segments_bias": (frozenset({"segments", "bias", "gqa"}), dict()),
}
S = jax.ShapeDtypeStruct


@pytest.fixture
def verified_modules(monkeypatch):
    """Lowers as on a Hopper GPU; yields the list of Triton modules lowered, each verified."""
    monkeypatch.setattr(jaxtile.api, "_platform", lambda x: "gpu")
    monkeypatch.setattr(pk, "sm_count", lambda platform: HOPPER_SMS)
    hopper = pk.shared_memory_limit("cpu")  # off the GPU: Hopper's
    monkeypatch.setattr(pk, "shared_memory_limit", lambda platform: hopper)
    lower = registration.lowering.lower_jaxpr_to_triton_module
    modules = []

    def verified(*args, **kwargs):
        result = lower(*args, **kwargs)
        result.module.operation.verify()  # raises with the offending op
        modules.append(result.module)
        return result

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", verified)
    return modules


def _lower(fn, *args):
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("impl", TRITON, ids=lambda i: i.name)
def test_triton_kernels_lower_to_modules_that_verify(impl, mask, verified_modules):
    features, options = MASKS[mask]
    if not features <= impl.features:
        pytest.skip(f"{impl.name} does not declare {sorted(features - impl.features)}")
    q, k = S((2, 3, 4, 64), jnp.bfloat16), S((2, 70, 2, 64), jnp.bfloat16)
    if mask.startswith("lengths"):
        bias, ints = None, dict(q_lengths=S((2,), jnp.int32), kv_lengths=S((2,), jnp.int32))
    else:
        bias, ints = S((2, 4, 3, 70), jnp.float32), dict(segment_ids=(S((2, 3), jnp.int32), S((2, 70), jnp.int32)))

    def attend(q, k, v, bias, ints):
        out = jaxtile.flash_attention(q, k, v, bias=bias, **ints, **options, implementation=impl.name)
        return out.astype(jnp.float32).sum()

    _lower(attend, q, k, k, bias, ints)
    _lower(jax.grad(attend, argnums=(0, 1, 2) if bias is None else (0, 1, 2, 3)), q, k, k, bias, ints)
    assert len(verified_modules) >= 3  # the forward, and the backward's kernels


@pytest.mark.parametrize("q_len", [3, 130], ids=["packed_heads", "rows"])
@pytest.mark.parametrize("impl", [i for i in TRITON if i.takes_sinks], ids=lambda i: i.name)
def test_forward_kernels_taking_sinks_lower_to_modules_that_verify(impl, q_len, verified_modules):
    """The sinks read per row, where a short query's tile packs a group's heads and where
    its rows are one head's positions."""
    q, k = S((2, q_len, 4, 64), jnp.bfloat16), S((2, 200, 2, 64), jnp.bfloat16)
    sinks = S((4,), jnp.float32)
    _lower(
        lambda q, k, v, s: jaxtile.flash_attention(q, k, v, sinks=s, causal=True, implementation=impl.name),
        q,
        k,
        k,
        sinks,
    )
    assert len(verified_modules) == 1


@pytest.mark.parametrize("impl", [i for i in TRITON if i.paged_forward is not None], ids=lambda i: i.name)
def test_paged_kernels_lower_to_modules_that_verify(impl, verified_modules):
    q, pages = S((2, 3, 4, 64), jnp.bfloat16), S((2, 40, 16, 64), jnp.bfloat16)
    table, lengths = S((2, 20), jnp.int32), S((2,), jnp.int32)
    _lower(lambda *args: jaxtile.paged_attention(*args, implementation=impl.name), q, pages, pages, table, lengths)
    assert len(verified_modules) == 1


def test_kernel_hashes_are_stable_and_tell_kernels_apart():
    """`bench.lowered`, the check that a change leaves the GPU code alone: a call hashes
    the same twice, another mask hashes differently, and a call the implementation
    refuses is recorded as refused."""
    grid = {
        name: lowered._attention_call(impl, "bfloat16", q_len, 70, 64, mask)
        for name, impl, q_len, mask in (
            ("v2_causal", "pallas_v2", 3, dict(causal=True)),
            ("v2_full", "pallas_v2", 3, {}),
            ("mosaic_causal", "mosaic_v3", 3, dict(causal=True)),
            ("decode_too_long", "pallas_decode", 40, {}),
        )
    }
    first, second = lowered.hashes(grid), lowered.hashes(grid)
    assert first == second
    assert len(first["v2_causal"]) == len(first["mosaic_causal"]) == 1
    assert first["v2_causal"] != first["v2_full"]
    assert first["decode_too_long"].startswith("refused: Unsupported")
    assert lowered.compare(first, {**second, "v2_full": first["v2_causal"]}) == ["v2_full"]
