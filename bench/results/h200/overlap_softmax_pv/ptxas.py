import dataclasses

import jax
import jax.numpy as jnp

import jaxtile
from jaxtile.mosaic import v3

print(jaxtile.__file__, flush=True)
tuning = v3.default_tuning(128, 128, 2)
if "overlap" in {f.name for f in dataclasses.fields(v3.Tuning)}:
    tuning = dataclasses.replace(tuning, overlap=True)
q = jax.random.normal(jax.random.key(0), (1, 4096, 16, 128), jnp.bfloat16)
out = jaxtile.flash_attention(q, q, q, causal=False, implementation="mosaic_v3", tuning=tuning)
print(tuning, float(out.astype(jnp.float32).sum()), flush=True)
