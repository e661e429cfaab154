"""ptxas's report on mosaic_v3's kernels (forward, dK/dV, dQ) of causal 1K calls with a
bias per head (bf16, and float32 at head dim 64): registers, spills, and C7513 where
ptxas serialises ``wgmma``s. Run from a directory holding jaxtile/:
MOSAIC_GPU_DUMP_PTXAS=1 PYTHONPATH=. python ptxas.py 2>&1 | grep ...
"""

import jax
import jax.numpy as jnp

import jaxtile

print(jaxtile.__file__, flush=True)
for head_dim, bias_dtype in ((128, jnp.bfloat16), (64, jnp.bfloat16), (64, jnp.float32)):
    q, k, v = (jax.random.normal(jax.random.key(n), (1, 1024, 4, head_dim), jnp.bfloat16) for n in range(3))
    bias = jax.random.normal(jax.random.key(3), (1, 4, 1024, 1024), bias_dtype)

    def loss(q, k, v, bias):
        out = jaxtile.flash_attention(q, k, v, bias=bias, causal=True, implementation="mosaic_v3")
        return out.astype(jnp.float32).sum()

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)
    print(
        f"== head dim {head_dim}, bias {jnp.dtype(bias_dtype).name}:",
        [float(jnp.abs(g.astype(jnp.float32)).sum()) for g in grads],
        flush=True,
    )
