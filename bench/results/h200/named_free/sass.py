"""Compiles and runs one forward at head dim 128 (bf16, batch 4, 16 heads), jaxtile's
``mosaic_v3`` from the working directory or tokamax's Mosaic GPU kernel, with Mosaic GPU's
SASS (with each instruction's control bits) and ptxas report written to a file::

    PYTHONPATH=. python sass.py {mosaic_v3,tokamax} SEQ {causal,full} FILE

Mosaic GPU prints its dumps from C++ to the process's stdout while it compiles, so that
file descriptor is pointed at FILE first.
"""

import os
import sys

os.environ.update(MOSAIC_GPU_DUMP_SASS_CTRL="1", MOSAIC_GPU_DUMP_PTXAS="1")

import jax
import jax.numpy as jnp

impl, seq, mask, path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
causal = mask == "causal"
q, k, v = (jax.random.normal(jax.random.key(i), (4, seq, 16, 128), jnp.bfloat16) for i in range(3))
if impl == "tokamax":
    import tokamax

    attend = jax.jit(lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=causal, implementation="mosaic"))
else:
    import jaxtile

    print("jaxtile", jaxtile.__file__, file=sys.stderr)
    attend = jax.jit(lambda q, k, v: jaxtile.flash_attention(q, k, v, causal=causal, implementation=impl))
sys.stdout.flush()
dump = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
saved = os.dup(1)
os.dup2(dump, 1)
out = attend(q, k, v).block_until_ready()
sys.stdout.flush()
os.dup2(saved, 1)
print(impl, seq, mask, "ran:", out.shape, "finite:", bool(jnp.isfinite(out.astype(jnp.float32)).all()))
