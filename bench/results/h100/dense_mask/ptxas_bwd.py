"""MOSAIC_GPU_DUMP_PTXAS=1: ptxas's register and spill lines of the kernels of a dense
mask's forward+backward (recognition off: one branch), in launch order (forward, dK/dV,
dQ)."""

import dataclasses
import sys

import jax
import jax.numpy as jnp

import jaxtile
from jaxtile import registry
from jaxtile.mosaic import backward as mb
from jaxtile.mosaic import v3

registry._REGISTRY["mosaic_v3"] = dataclasses.replace(registry.get("mosaic_v3"), recognises_masks=False)

for head_dim, block_q in ((64, 128), (64, 64)):
    q = jax.random.normal(jax.random.key(0), (1, 1024, 4, head_dim), jnp.bfloat16)
    mask = jax.random.bernoulli(jax.random.key(1), 0.7, (1, 1, 1024, 1024))
    tuning = v3.Tuning(backward=mb.BackwardTuning(block_q=block_q))

    def loss(q, mask=mask, tuning=tuning):
        return jaxtile.flash_attention(q, q, q, mask=mask, implementation="mosaic_v3", tuning=tuning).sum()

    print(f"=== head_dim={head_dim} block_q={block_q}", file=sys.stderr, flush=True)
    jax.block_until_ready(jax.jit(jax.grad(loss))(q))
