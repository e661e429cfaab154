"""What only compiled kernels on an NVIDIA GPU can show (skipped elsewhere)."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtile
from jaxtile import registry
from jaxtile.triton import tuning
from parity.case import Case
from parity.compare import TOLERANCES, compare
from parity.run import run_case

pytestmark = pytest.mark.gpu

_LONG = """
import json, jax, jax.numpy as jnp, jaxtile
n = 131072
keys = jax.random.split(jax.random.key(0), 4)
q, k, v, do = (jax.random.normal(key, (1, n, 16, 128), jnp.bfloat16) for key in keys)
f = jax.jit(lambda q, k, v, do: jax.vjp(lambda *a: jaxtile.flash_attention(*a, causal=True), q, k, v)[1](do))
grads = jax.block_until_ready(f(q, k, v, do))
ok = all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in grads)
print(json.dumps(dict(peak=jax.devices()[0].memory_stats()["peak_bytes_in_use"], array=q.nbytes, finite=ok)))
"""


def test_131k_tokens_forward_backward_in_linear_memory():
    """Causal fwd+bwd at 131072 tokens (16 heads of 128, bf16) peaks within 1.5x the size
    of q, k, v, out and their four gradients (a fresh process, so the peak is its own)."""
    result = subprocess.run([sys.executable, "-c", _LONG], capture_output=True, text=True, check=True)
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    arrays = 8 * stats["array"]
    assert stats["finite"]
    assert stats["peak"] <= 1.5 * arrays, f"peak {stats['peak'] / 2**30:.2f} GiB vs arrays {arrays / 2**30:.2f} GiB"


def _inputs(seed=0, shape=(2, 256, 4, 64)):
    keys = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(key, shape, jnp.bfloat16) for key in keys]


def test_compiled_kernels_inside_shard_map_with_check_vma():
    mesh = jax.make_mesh((1,), ("batch",))
    q, k, v = (jax.device_put(x, jax.sharding.NamedSharding(mesh, P("batch"))) for x in _inputs())

    def attend(q, k, v):
        return jaxtile.flash_attention(q, k, v, causal=True, implementation="pallas_v2")

    mapped = jax.jit(jax.shard_map(attend, mesh=mesh, in_specs=P("batch"), out_specs=P("batch")))
    np.testing.assert_array_equal(np.asarray(mapped(q, k, v)), np.asarray(jax.jit(attend)(q, k, v)))


def test_autotune_times_once_and_stays_exact():
    q, k, v = _inputs(seed=1)
    calls = []
    original = tuning.median_seconds

    def counting(run, repeats=5):
        calls.append(1)
        return original(run, repeats)

    tuning.median_seconds = counting
    try:
        auto = jax.jit(lambda q, k, v: jaxtile.flash_attention(q, k, v, implementation="pallas_v2", tuning="autotune"))
        out = auto(q, k, v)
        timed = len(calls)
        jax.jit(lambda q, k, v: jaxtile.flash_attention(q, k, v, implementation="pallas_v2", tuning="autotune"))(
            q, k, v
        )
    finally:
        tuning.median_seconds = original
    assert timed > 0 and len(calls) == timed, "autotune must time candidates once per shape"
    expected = jaxtile.flash_attention(q, k, v, implementation="reference")
    error = compare(np.asarray(out, np.float32), np.asarray(expected, np.float32), TOLERANCES["bfloat16"])
    assert error.ok, error


NATIVE = [i.name for i in registry.implementations() if "gpu" in i.platforms]
KERNELS = [i.name for i in registry.implementations() if i.platforms == {"gpu"}]  # native nowhere else

# What the shared-memory model admits, compiled for real: the smallest and largest head
# dims and one that pads, every dtype, masks that add runtime tiles (a padding mask,
# packed documents) or none, no GQA and a group of 16 (query heads packed per tile), at
# the shape flash-attn's own test grid crashed an earlier kernel on (q_len 64 against 800
# keys).
EXTREMES = [
    Case(
        f"extreme_d{head_dim}_{dtype}_{mask}_g{group}",
        batch=(2,),
        q_len=64,
        kv_len=800,
        num_heads=group,
        num_kv_heads=1,
        head_dim=head_dim,
        dtype=dtype,
        causal=mask != "none",
        mask="padding" if mask == "padding" else None,
        segments=3 if mask == "segments" else 0,
    )
    for head_dim in (16, 80, 256)
    for dtype in ("float32", "bfloat16", "float16")
    for mask in ("none", "padding", "segments")
    for group in (1, 16)
]


@pytest.mark.parametrize("case", EXTREMES, ids=lambda c: c.name)
@pytest.mark.parametrize("implementation", KERNELS)
def test_kernels_compile_and_are_exact_at_the_extremes(case, implementation):
    result = run_case(case, implementation, device="cpu")
    assert result.ok, result.describe()


# Decode steps at the sizes they run at: long caches filled to different lengths (the
# split-KV kernel shares them out over many programs), GQA and MQA, a window, the head
# dims and dtypes at both ends.
DECODE = [
    Case(
        "decode_gqa_32k",
        batch=(2,),
        q_len=1,
        kv_len=32768,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        lengths="kv",
    ),
    Case(
        "decode_chunk16_32k",
        batch=(2,),
        q_len=16,
        kv_len=32768,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        causal=True,
        lengths="ragged",
    ),
    Case(
        "decode_mqa_window",
        batch=(3,),
        q_len=3,
        kv_len=5000,
        num_heads=16,
        num_kv_heads=1,
        head_dim=80,
        dtype="float16",
        causal=True,
        window=(1000, 0),
        lengths="kv",
    ),
    Case(
        "decode_d256_f32", batch=(2,), q_len=1, kv_len=3000, num_heads=4, num_kv_heads=2, head_dim=256, dtype="float32"
    ),
]


@pytest.mark.parametrize("case", DECODE, ids=lambda c: c.name)
@pytest.mark.parametrize("implementation", NATIVE)
def test_decode_at_scale(case, implementation):
    result = run_case(case, implementation, device="cpu")
    assert result.ok, result.describe()
