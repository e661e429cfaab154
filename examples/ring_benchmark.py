"""Ring attention over 2 GPUs against one GPU: causal, bfloat16, forward and backward.

The sequence (2 × 65536 tokens by default, 16 heads of 128) is sharded over the two
GPUs along its length, and `jaxtile.ring_attention` computes exact causal attention and
its gradients. Before timing, the same program on a smaller sequence is checked against
single-GPU ``flash_attention`` (out, dq, dk, dv, with parity's bfloat16 tolerance).

It also checks `flash_attention` on arrays sharded over the two GPUs along heads (the
kernels run through ``custom_partitioning``): the compiled program must not gather q, k
or v, and must equal the single-GPU result.

Timings (median of batches, as in shared/GPU-NOTES.md), all forward + backward:

* ``ring``: the 2-GPU ring on the whole sequence;
* ``one_gpu_half``: one GPU on half the sequence (one device's share of tokens; a
  quarter of the causal work);
* ``one_gpu_whole``: one GPU on the whole sequence (jaxtile needs O(N) memory).

The ring is not load-balanced: the second device computes three quarters of the causal
work, so the ideal ring time is about ``3 × one_gpu_half`` (``0.75 × one_gpu_whole``).

    python examples/ring_benchmark.py ring.json [--tokens-per-device 65536]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxtile
from parity.compare import TOLERANCES, compare

SEQ = P(None, "seq")


def _forward_backward(attend):
    """``(q, k, v, dout) -> (out, dq, dk, dv)``."""

    def run(q, k, v, dout):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(dout))

    return run


def _ring(mesh: Mesh, implementation: str | None):
    def attend(q, k, v):
        return jaxtile.ring_attention(q, k, v, axis_name="seq", causal=True, implementation=implementation)

    mapped = jax.shard_map(_forward_backward(attend), mesh=mesh, in_specs=(SEQ,) * 4, out_specs=(SEQ,) * 4)
    return jax.jit(mapped)


def _single(implementation: str | None):
    return jax.jit(
        _forward_backward(lambda q, k, v: jaxtile.flash_attention(q, k, v, causal=True, implementation=implementation))
    )


def _inputs(tokens: int, heads: int, head_dim: int, sharding, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    shape = (1, tokens, heads, head_dim)
    make = jax.jit(lambda key: jax.random.normal(key, shape, jnp.bfloat16), out_shardings=sharding)
    return tuple(make(key) for key in keys)


def _errors(got, expected) -> dict:
    errors = {}
    for name, x, ref in zip(("out", "dq", "dk", "dv"), got, expected):
        error = compare(np.asarray(x, np.float32), np.asarray(ref, np.float64), TOLERANCES["bfloat16"])
        errors[name] = {"rel_l2": error.rel_l2, "max_err": error.max_err, "ok": error.ok}
    return {"errors": errors, "ok": all(e["ok"] for e in errors.values())}


def _head_sharding(devices, heads: int, head_dim: int, implementation: str | None) -> dict:
    """Forward + backward on q, k, v sharded over ``devices`` along heads."""
    sharding = NamedSharding(Mesh(np.array(devices), ("heads",)), P(None, None, "heads"))
    args = _inputs(4096, heads, head_dim, jax.sharding.SingleDeviceSharding(devices[0]), seed=2)
    whole = _single(implementation)
    sharded = tuple(jax.device_put(x, sharding) for x in args)
    compiled = jax.jit(whole, in_shardings=(sharding,) * 4).lower(*sharded).compile()
    hlo = compiled.as_text()
    gathers = {
        name: len(re.findall(rf"\b{name}(-start)?\(", hlo))
        for name in ("all-gather", "all-to-all", "collective-permute")
    }
    result = _errors(compiled(*sharded), whole(*args))
    return result | {"gathers": gathers, "ok": result["ok"] and not any(gathers.values())}


def _time(fn, args, calls: int, batches: int) -> float:
    """Median seconds per call over ``batches`` batches of ``calls`` calls."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls):
            result = fn(*args)
        jax.block_until_ready(result)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="write the results here as JSON")
    parser.add_argument("--tokens-per-device", type=int, default=65536)
    parser.add_argument("--check-tokens-per-device", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--implementation", default=None)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--batches", type=int, default=5)
    args = parser.parse_args()

    devices = jax.devices()
    if len(devices) < 2:
        raise SystemExit(f"needs 2 devices, found {devices}")
    mesh = Mesh(np.array(devices[:2]), ("seq",))
    sharded, single = NamedSharding(mesh, SEQ), jax.sharding.SingleDeviceSharding(devices[0])
    ring, whole = _ring(mesh, args.implementation), _single(args.implementation)
    result = {"devices": [d.device_kind for d in devices[:2]], "args": vars(args), "jax": jax.__version__}

    # Correctness on a smaller sequence: the ring against one GPU.
    tokens = 2 * args.check_tokens_per_device
    check = _inputs(tokens, args.heads, args.head_dim, single, seed=1)
    expected = whole(*check)
    got = ring(*(jax.device_put(x, sharded) for x in check))
    result["check"] = {"tokens": tokens} | _errors(got, expected)
    result["head_sharding"] = _head_sharding(devices[:2], args.heads, args.head_dim, args.implementation)
    print(json.dumps({"check": result["check"], "head_sharding": result["head_sharding"]}))

    tokens = 2 * args.tokens_per_device
    shape = (args.heads, args.head_dim)
    timings = {
        "ring": _time(ring, _inputs(tokens, *shape, sharded), args.calls, args.batches),
        "one_gpu_half": _time(whole, _inputs(tokens // 2, *shape, single), args.calls, args.batches),
        "one_gpu_whole": _time(whole, _inputs(tokens, *shape, single), args.calls, args.batches),
    }
    flops = 3.5 * 2 * tokens**2 * args.heads * args.head_dim  # causal: half of 4·N²·H·D, ×3.5 for fwd+bwd
    result["tokens"] = tokens
    result["seconds"] = timings
    result["speedup_over_one_gpu_whole"] = timings["one_gpu_whole"] / timings["ring"]
    result["ring_over_one_gpu_half"] = timings["ring"] / timings["one_gpu_half"]
    result["ring_tflops_per_second"] = flops / timings["ring"] / 1e12
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
