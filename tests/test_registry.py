"""The implementation registry: a new implementation, declared in this module alone, is
picked up by the shared test base, the parity suite and the benchmark, chosen by default
where it is the fastest that supports a call, and refused with the names of those that
do where it does not."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtile
from jaxtile import registry
from jaxtile._core import Config, Inputs
from jaxtile._softmax import Logits
from jaxtile.mask import MaskSpec

ROOT = Path(__file__).resolve().parents[1]

# The reference under a new name, declaring a subset of its capabilities: causal masks
# and GQA, head dims up to 64, no windows, segments, dense masks or soft cap.
TOY = dataclasses.replace(
    registry.get("reference"),
    name="toy_reference",
    summary="the reference, declaring less",
    features=frozenset({"causal", "gqa"}),
    max_head_dim=64,
    speed=-1,
)


@pytest.fixture
def fast_toy():
    """TOY, registered in this process as the fastest implementation, counting its calls."""
    calls = []

    def forward(inputs, config):
        calls.append(inputs.q.shape)
        return TOY.forward(inputs, config)

    registry.register(dataclasses.replace(TOY, forward=forward, speed=1000))
    try:
        yield calls
    finally:
        registry.unregister(TOY.name)


def _qkv(head_dim: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 24, 4, head_dim)), jnp.float32) for _ in range(3))
    return q, k, v


def test_default_is_the_fastest_that_supports_the_call(fast_toy):
    q, k, v = _qkv(32)
    out = jaxtile.flash_attention(q, k, v, causal=True)
    assert len(fast_toy) == 1
    np.testing.assert_allclose(out, jaxtile.flash_attention(q, k, v, causal=True, implementation="scan_v2"), atol=1e-5)
    # Outside its capabilities (a window; a head dim over 64) the next fastest runs.
    for call in (dict(causal=True, window=(4, 0)), dict(causal=True, head_dim=96)):
        q, k, v = _qkv(call.pop("head_dim", 32), seed=1)
        out = jaxtile.flash_attention(q, k, v, **call)
        np.testing.assert_allclose(out, jaxtile.flash_attention(q, k, v, implementation="scan_v2", **call), atol=1e-5)
    assert len(fast_toy) == 1


def test_a_call_outside_its_capabilities_names_those_that_support_it(fast_toy):
    q, k, v = _qkv(32)
    with pytest.raises(NotImplementedError, match=r"toy_reference does not support soft_cap.*'scan_v2'"):
        jaxtile.flash_attention(q, k, v, logits_soft_cap=5.0, implementation="toy_reference")
    q, k, v = _qkv(96)
    with pytest.raises(NotImplementedError, match=r"head dims up to 64; got head_dim=96.*'reference'"):
        jaxtile.flash_attention(q, k, v, implementation="toy_reference")


def _with_toy(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``command`` in a fresh process where JAXTILE_IMPLEMENTATIONS registers TOY."""
    env = dict(os.environ, JAXTILE_IMPLEMENTATIONS="test_registry:TOY")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"), str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, **kwargs)


def test_the_shared_test_base_runs_it():
    """Every shared test runs the new implementation: what it supports passes, what its
    record declares it lacks is skipped with that reason."""
    done = _with_toy(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-rs",
            "tests/test_correctness.py",
            "-k",
            "toy_reference",
        ]
    )
    tail = done.stdout[-3000:]
    assert done.returncode == 0, tail
    assert " passed" in tail and "failed" not in tail, tail
    assert "unsupported: toy_reference does not support window" in done.stdout, tail


def test_parity_and_bench_run_it(tmp_path):
    parity = tmp_path / "parity.json"
    done = _with_toy([sys.executable, "-m", "parity", "--impl", "toy_reference", "--json", str(parity)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [r for r in json.loads(parity.read_text())["rows"] if r["implementation"] == "toy_reference"]
    assert rows and all(r["ok"] or r["unsupported"] for r in rows)
    assert any(r["ok"] for r in rows) and any(r["unsupported"] for r in rows)

    done = _with_toy(
        [
            sys.executable,
            "-m",
            "bench",
            "--quick",
            "--seq-lens",
            "32",
            "--head-dim",
            "16",
            "--no-plots",
            "--impl",
            "toy_reference",
            "--save-dir",
            str(tmp_path / "bench"),
        ]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = json.loads((tmp_path / "bench" / "results.json").read_text())["measurements"]
    assert records and {r["status"] for r in records} == {"ok"} and {r["impl"] for r in records} == {"toy_reference"}


def test_short_queries_on_a_gpu_default_to_split_kv_decoding():
    """The default on a GPU: the decode family (declared for q_len <= its max_q_len, and
    faster there) for a decode step, another family beyond; explicitly asked beyond its
    q_len, the decode family names the implementations that can run the call."""

    def call(q_len: int):
        q = jax.ShapeDtypeStruct((2, q_len, 8, 64), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((2, 4096, 2, 64), jnp.bfloat16)
        return Inputs(q, kv, kv), Config(MaskSpec.create(q_len, 4096, causal=True), Logits(0.125), platform="gpu")

    decode = registry.get("pallas_decode")
    assert registry.choose(*call(1)) is decode
    assert registry.choose(*call(decode.max_q_len)) is decode
    assert registry.choose(*call(decode.max_q_len + 1)).name in ("pallas_v2", "mosaic_v3")  # mosaic_v3 on Hopper
    with pytest.raises(registry.Unsupported, match=r"q_len up to 16; got q_len=17.*'pallas_v2'"):
        registry.check(decode, *call(17))
