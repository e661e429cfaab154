"""MQA and GQA at head dims past 128: the dK/dV kernel with query-head shares (c36e7a3)
against none (the rule before it, restored by patching `_splits`), beside cuDNN, in one
process; jax's caches cleared between variants. Also the gradients' agreement and their
bitwise repeat."""

from pathlib import Path

import jax
import numpy as np
from _gradients import grads  # this folder: run as a script

import jaxtile
from bench import check
from jaxtile.mosaic import backward as mb

print(
    jaxtile.__file__,
    Path("VERSION.json").read_text().strip(),
    jax.__version__,
    jax.devices()[0].device_kind,
    flush=True,
)
shares = mb._splits


def no_shares(dims, tuning):
    return 1 if mb._roles(dims.head_dim, dims.head_dim_v) else shares(dims, tuning)


SHAPES = [
    check.Shape("mqa_d256_b1_4k", 1, 4096, 16, 256, kv_heads=1, causal=True),
    check.Shape("mqa_d256_b1_8k", 1, 8192, 16, 256, kv_heads=1, causal=True),
    check.Shape("mqa_d256_b2_8k", 2, 8192, 16, 256, kv_heads=1, causal=True),
    check.Shape("gqa_d256_16_2_b1_4k_full", 1, 4096, 16, 256, kv_heads=2),
    check.Shape("mqa_d192_b1_8k", 1, 8192, 16, 192, kv_heads=1, causal=True),
]


for shape in SHAPES:
    mb._splits = shares
    jax.clear_caches()
    first, second = grads(shape), grads(shape)
    mb._splits = no_shares
    jax.clear_caches()
    before = grads(shape)
    bitwise = all(np.array_equal(a, b) for a, b in zip(first, second))
    diff = [float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30)) for a, b in zip(first, before)]
    print(f"{shape.name} bitwise_repeat={bitwise} max|shares-none|/max|none| dq,dk,dv={diff}", flush=True)
    ms = {}
    for _pass in range(2):
        for label, fn in (("shares", shares), ("none", no_shares)):
            mb._splits = fn
            jax.clear_caches()
            ms.setdefault(label, []).append(check._timed(check._jaxtile(shape), shape, "fwdbwd", 0.5)["ms"])
        ms.setdefault("cudnn", []).append(check._timed(check._cudnn(shape), shape, "fwdbwd", 0.5)["ms"])
    mb._splits = shares
    print(shape.name, " ".join(f"{k}={','.join(f'{x:.3f}' for x in v)}" for k, v in ms.items()), flush=True)
    m = {k: min(v) for k, v in ms.items()}
    for label in ms:
        tf = shape.flops("fwdbwd") / m[label] / 1e9
        print(
            f"  {shape.name} {label:7s} fwd+bwd {m[label]:.3f} ms {tf:.0f} TFLOP/s {m['cudnn'] / m[label]:.3f}x cuDNN"
        )
