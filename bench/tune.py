"""Sweeps the Pallas kernels' launch parameters on the benchmark grid (run on a GPU).

For each shape of the grid it times the forward pass under each forward candidate and
forward+backward under each backward candidate, next to JAX's bundled Pallas ``mha``
and cuDNN, and writes every number to JSON. The winners become `jaxtile.tuning`'s
table. Usage::

    PYTHONPATH=. python -m bench.tune --out tune.json [--head-dims 64 128] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import time
import warnings

import jax
import jax.numpy as jnp

import jaxtile
from jaxtile.tuning import KernelTuning, Tuning, default_tuning

FORWARD = [
    (128, 128, 8, 3),
    (128, 128, 4, 3),
    (128, 128, 8, 4),
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 64, 4, 4),
    (64, 64, 4, 3),
    (128, 32, 4, 3),
]
BACKWARD = [  # (dK/dV tiles+warps+stages, dQ tiles+warps+stages)
    ((64, 64, 4, 3), (64, 64, 4, 3)),
    ((32, 128, 4, 3), (128, 32, 4, 3)),
    ((64, 128, 8, 3), (128, 64, 8, 3)),
    ((32, 64, 4, 3), (64, 32, 4, 3)),
    ((64, 64, 4, 2), (64, 64, 4, 2)),
    ((64, 128, 4, 2), (128, 64, 4, 2)),
]


def _time(fn, *args, batches: int = 5, per_batch: int = 10) -> float:
    """Median seconds per call: two warm-up calls, then batches ending in one sync."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(per_batch):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / per_batch)
    return sorted(times)[len(times) // 2]


def _flops(batch, seq, heads, dim, causal, backward):
    f = 4 * batch * seq * seq * heads * dim * (0.5 if causal else 1.0)
    return f * (3.5 if backward else 1.0)


def _fwd_and_fwdbwd(attend, q, k, v):
    fwd = jax.jit(attend)

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * q[..., :1].astype(jnp.float32))

    both = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    return fwd, both


def _measure(attend, q, k, v, backward: bool) -> float | str:
    fwd, both = _fwd_and_fwdbwd(attend, q, k, v)
    try:
        return _time(both if backward else fwd, q, k, v)
    except Exception as e:  # a candidate that does not compile (shared memory, registers)
        return f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _peers(causal: bool, dim: int):
    """cuDNN, and JAX's bundled Pallas kernel with its defaults and with the settings
    ANCHORS.md found best (blocks 128 forward / 64 backward, 3 stages)."""
    peers = {
        "jax.cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention as bundled

    scale = dim**-0.5
    tuned = bundled.BlockSizes(128, 128, 64, 64, 64, 64)
    peers["pallas.mha"] = lambda q, k, v: bundled.mha(q, k, v, None, causal=causal, sm_scale=scale)
    peers["pallas.mha_tuned"] = lambda q, k, v: bundled.mha(
        q, k, v, None, causal=causal, sm_scale=scale, block_sizes=tuned, num_warps=8 if dim > 64 else 4, num_stages=3
    )
    return peers


def _jaxtile(causal: bool, tuning: Tuning):
    def attend(q, k, v):
        return jaxtile.flash_attention(q, k, v, causal=causal, implementation="pallas_v2", tuning=tuning)

    return attend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--quick", action="store_true", help="only the first candidates")
    args = parser.parse_args()
    rows = []
    for dim in args.head_dims:
        for seq in args.seq_lens:
            for causal in (False, True):
                batch, heads = 16384 // seq, 2048 // dim
                keys = jax.random.split(jax.random.key(seq + dim), 3)
                q, k, v = (jax.random.normal(key, (batch, seq, heads, dim), jnp.bfloat16) for key in keys)
                base = default_tuning(dim, jnp.bfloat16, causal)
                forward = FORWARD[:2] if args.quick else FORWARD
                backward = BACKWARD[:2] if args.quick else BACKWARD
                shape = dict(head_dim=dim, seq=seq, batch=batch, heads=heads, causal=causal)
                for name, attend in _peers(causal, dim).items():
                    for bwd in (False, True):
                        rows.append(dict(shape, impl=name, backward=bwd, seconds=_measure(attend, q, k, v, bwd)))
                for f in forward:
                    attend = _jaxtile(causal, dataclasses.replace(base, forward=KernelTuning(*f)))
                    seconds = _measure(attend, q, k, v, False)
                    rows.append(dict(shape, impl="pallas_v2", tuning=f, backward=False, seconds=seconds))
                for dkdv, dq in backward:
                    attend = _jaxtile(causal, Tuning(base.forward, KernelTuning(*dkdv), KernelTuning(*dq)))
                    seconds = _measure(attend, q, k, v, True)
                    rows.append(dict(shape, impl="pallas_v2", tuning=[dkdv, dq], backward=True, seconds=seconds))
                for row in rows:
                    if "tflops" not in row and isinstance(row["seconds"], float):
                        flops = _flops(batch, seq, heads, dim, causal, row["backward"])
                        row["tflops"] = flops / row["seconds"] / 1e12
                done = [r for r in rows if r["seq"] == seq and r["head_dim"] == dim and r["causal"] == causal]
                for bwd in (False, True):
                    part = [r for r in done if r["backward"] == bwd and "tflops" in r]
                    best = max((r for r in part if r["impl"] == "pallas_v2"), key=lambda r: r["tflops"], default=None)
                    peers = {r["impl"]: round(r["tflops"]) for r in part if r["impl"] != "pallas_v2"}
                    if best:
                        print(
                            f"D={dim} T={seq} causal={causal} {'fwdbwd' if bwd else 'fwd'}: best {best['tflops']:.0f} "
                            f"TFLOP/s {best.get('tuning')}  peers {peers}",
                            flush=True,
                        )
    meta = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device=jax.devices()[0].device_kind,
        jax=jax.__version__,
    )
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
