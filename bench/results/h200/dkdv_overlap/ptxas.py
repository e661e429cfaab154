"""ptxas's report on mosaic_v3's kernels (forward, dK/dV, dQ) of three causal 1K calls:
registers, spills, and C7513 where ptxas serialises ``wgmma``s. Run from a directory
holding jaxtile/: MOSAIC_GPU_DUMP_PTXAS=1 PYTHONPATH=. python ptxas.py 2>&1 | grep ...
"""

import jax
import jax.numpy as jnp

import jaxtile

print(jaxtile.__file__, flush=True)
for head_dim, dtype in ((128, jnp.bfloat16), (64, jnp.bfloat16), (128, jnp.float16)):
    q, k, v = (jax.random.normal(jax.random.key(n), (1, 1024, 4, head_dim), dtype) for n in range(3))

    def loss(q, k, v):
        out = jaxtile.flash_attention(q, k, v, causal=True, implementation="mosaic_v3")
        return out.astype(jnp.float32).sum()

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    print(
        f"== head dim {head_dim} {jnp.dtype(dtype).name}:",
        [float(jnp.abs(g.astype(jnp.float32)).sum()) for g in grads],
        flush=True,
    )
