"""MOSAIC_GPU_DUMP_PTXAS=1: ptxas's register and spill lines of mosaic_v3's forward
kernel (16 heads of 128, causal, 16K, 8 × 2K documents) with segment ids, lengths, or
neither, one program per tile and persistent; each call's label is printed to stderr
before its kernel compiles."""

import sys

import jax
import jax.numpy as jnp

import jaxtile
from bench import check
from jaxtile.mosaic import v3

shape = next(s for s in check.SHAPES if s.name == "documents_8x2k_causal_16k")
(q, k, v), _, _ = check._inputs(shape, "fwd")
full = jnp.full((1,), shape.seq, jnp.int32)
for label, options in (
    ("causal", {}),
    ("segments", {"segment_ids": check._segment_ids(shape)}),
    ("lengths", {"kv_lengths": full, "q_lengths": full}),
):
    for persistent in (False, True):
        tuning = v3.Tuning(persistent=persistent)
        print(f"=== {label} persistent={persistent}", file=sys.stderr, flush=True)

        def attend(q, k, v, options=options, tuning=tuning):
            return jaxtile.flash_attention(q, k, v, causal=True, implementation="mosaic_v3", tuning=tuning, **options)

        jax.block_until_ready(jax.jit(attend)(q, k, v))
