"""Sweeps the Pallas kernels' launch parameters on the benchmark grid (run on a GPU).

For each shape it times the forward pass under each forward candidate and
forward+backward under each backward candidate (the forward fixed at the table's), and
writes every number to JSON; with ``--peers`` it times cuDNN too, in the same process.
The candidates are the ones `python -m bench.kernels --sweep` compiles without
spilling registers (or spilling least), so the GPU's minutes go to configurations that
can win. The winners become `jaxtile.triton.tuning`'s table. With ``--impl mosaic_v3``
it sweeps the Mosaic GPU kernels' tiles and stages instead (`jaxtile.mosaic.v3.Tuning`),
whose winners become `jaxtile.mosaic.v3.default_tuning`. Usage::

    PYTHONPATH=. python -m bench.tune --out tune.json [--impl mosaic_v3] [--head-dims 64 128] [--seq-lens 4096] [--peers]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json

import jax
import jax.numpy as jnp

import jaxtile
from bench.check import Shape
from bench.probe import git_state
from bench.timing import time_jitted
from jaxtile import registry
from jaxtile.mask import MaskSpec
from jaxtile.mosaic import v3 as mosaic_v3
from jaxtile.mosaic.backward import BackwardTuning
from jaxtile.triton.tuning import KernelTuning, Tuning, default_tuning, mask_kind

# Seconds of timed calls per candidate, after warm-up (`bench.timing.time_jitted`).
_BUDGET_S = 0.5
# head_dim -> candidates (block_q, block_k, num_warps, num_stages)
FORWARD = {
    64: [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3)],
    128: [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3), (64, 64, 8, 3)],
    256: [(64, 64, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 3)],
}
# head_dim -> (dK/dV candidate, dQ candidate)
BACKWARD = {
    64: [
        ((64, 64, 4, 3), (64, 64, 4, 3)),
        ((64, 64, 8, 3), (64, 64, 8, 3)),
        ((32, 128, 8, 3), (128, 32, 8, 3)),
        ((64, 128, 8, 3), (128, 64, 8, 3)),
        ((128, 64, 8, 2), (64, 128, 8, 2)),
    ],
    128: [
        ((64, 64, 8, 3), (64, 64, 8, 3)),
        ((64, 64, 8, 2), (64, 64, 8, 2)),
        ((32, 128, 8, 2), (128, 32, 8, 2)),
        ((64, 128, 8, 3), (128, 64, 8, 3)),
        ((64, 64, 4, 2), (64, 64, 4, 2)),
    ],
    256: [
        ((64, 64, 8, 2), (64, 64, 8, 2)),
        ((32, 64, 4, 2), (64, 32, 4, 2)),
        ((32, 64, 8, 2), (64, 32, 8, 2)),
        ((32, 128, 8, 2), (128, 32, 8, 2)),
    ],
}
# mosaic_v3, head_dim -> forward candidates (block_q, block_k, num_stages), and backward
# candidates (block_q, block_k, num_stages, dq_block_k) with the forward at its default;
# each fits (`BackwardTuning.fits`: one that did not would time the Triton backward).
MOSAIC_FORWARD = {
    64: [(64, 256, 2), (64, 128, 2), (64, 128, 3), (64, 128, 4)],
    128: [(64, 128, 2), (64, 128, 3), (64, 64, 2), (64, 64, 3), (64, 64, 4)],
    256: [(64, 64, 2), (64, 64, 3)],
}
MOSAIC_BACKWARD = {
    64: [(128, 64, 2, None), (128, 64, 3, None), (64, 64, 2, 128), (64, 64, 3, 128)],
    128: [(64, 64, 2, None), (64, 64, 2, 128)],
}


def _candidates(impl: str, dim: int, spec: MaskSpec, modes) -> list[tuple[bool, object, list]]:
    """``(backward, tuning, what to report of it)`` for each candidate of ``impl``."""
    candidates = []
    if registry.get(impl).tuning is mosaic_v3.Tuning:
        base = mosaic_v3.default_tuning(dim, dim, 2)
        if "fwd" in modes:
            candidates += [(False, mosaic_v3.Tuning(*f), list(f)) for f in MOSAIC_FORWARD[dim]]
        if "fwdbwd" in modes:
            candidates += [
                (True, dataclasses.replace(base, backward=BackwardTuning(*b)), list(b))
                for b in MOSAIC_BACKWARD.get(dim, [])
            ]
        return candidates
    base = default_tuning(dim, jnp.bfloat16, mask_kind(spec))
    if "fwd" in modes:
        candidates += [
            (False, t, list(f)) for f in FORWARD[dim] for t in [dataclasses.replace(base, forward=KernelTuning(*f))]
        ]
    if "fwdbwd" in modes:
        candidates += [
            (True, Tuning(base.forward, KernelTuning(*dkdv), KernelTuning(*dq)), [list(dkdv), list(dq)])
            for dkdv, dq in BACKWARD[dim]
        ]
    return candidates


def _measure(attend, q, k, v, backward: bool) -> float | str:
    """Median seconds per call of ``attend`` (with ``backward``, of the gradients of a
    loss through it; `bench.timing.time_jitted`), or why it did not compile or run."""

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * q[..., :1].astype(jnp.float32))

    fn = jax.grad(loss, argnums=(0, 1, 2)) if backward else attend
    try:
        return time_jitted(fn, (q, k, v), _BUDGET_S).ms / 1e3
    except Exception as e:  # a candidate that does not compile (shared memory, registers)
        return f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _jaxtile(impl: str, causal: bool, window, tuning):
    def attend(q, k, v):
        return jaxtile.flash_attention(q, k, v, causal=causal, window=window, implementation=impl, tuning=tuning)

    return attend


def _cudnn(causal: bool, window):
    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, local_window_size=window, implementation="cudnn")

    return attend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--impl", choices=("pallas_v2", "mosaic_v3"), default="pallas_v2")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096])
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--peers", action="store_true", help="also time cuDNN on each shape")
    parser.add_argument("--modes", nargs="+", choices=("fwd", "fwdbwd"), default=["fwd", "fwdbwd"])
    parser.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"), help="a sliding window")
    args = parser.parse_args()
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    window = None if args.window is None else tuple(args.window)
    rows = []
    for dim in args.head_dims:
        for seq in args.seq_lens:
            for causal in causals:
                batch, heads = max(1, 16384 // seq), 2048 // dim
                keys = jax.random.split(jax.random.key(seq + dim), 3)
                q, k, v = (jax.random.normal(key, (batch, seq, heads, dim), jnp.bfloat16) for key in keys)
                shape = dict(head_dim=dim, seq=seq, batch=batch, heads=heads, causal=causal, window=window)
                spec = MaskSpec.create(seq, seq, causal=causal, window=window)
                for backward, tuning, kernel in _candidates(args.impl, dim, spec, args.modes):
                    seconds = _measure(_jaxtile(args.impl, causal, window, tuning), q, k, v, backward)
                    rows.append(dict(shape, impl=args.impl, tuning=kernel, backward=backward, seconds=seconds))
                if args.peers:
                    for backward in (False, True):
                        seconds = _measure(_cudnn(causal, window), q, k, v, backward)
                        rows.append(dict(shape, impl="jax.cudnn", backward=backward, seconds=seconds))
                problem = Shape("tune", batch, seq, heads, dim, causal=causal, window=window)
                for row in rows:
                    if "tflops" not in row and isinstance(row["seconds"], float):
                        row["tflops"] = problem.flops("fwdbwd" if row["backward"] else "fwd") / row["seconds"] / 1e12
                done = [r for r in rows if all(r[key] == value for key, value in shape.items())]
                for backward in (False, True):
                    part = [r for r in done if r["backward"] == backward and "tflops" in r]
                    mine = sorted((r for r in part if r["impl"] == args.impl), key=lambda r: -r["tflops"])
                    peers = {r["impl"]: round(r["tflops"]) for r in part if r["impl"] != args.impl}
                    if mine:
                        ranking = ", ".join(f"{r['tuning']}: {r['tflops']:.0f}" for r in mine)
                        mode = "fwdbwd" if backward else "fwd"
                        print(f"D={dim} T={seq} causal={causal} {mode}: {ranking}  peers {peers}", flush=True)
    meta = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device=jax.devices()[0].device_kind,
        jax=jax.__version__,
        git=git_state(),
    )
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
