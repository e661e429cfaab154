"""The record scripts' shared helper: jaxtile's gradients of a `bench.check` shape."""

import jax
import jax.numpy as jnp
import numpy as np

from bench import check


def grads(shape) -> list[np.ndarray]:
    """dq, dk and dv of `bench.check`'s jaxtile call on ``shape``, as float32 arrays."""
    primals, _, dout = check._inputs(shape, "fwdbwd")
    attend = check._jaxtile(shape)
    f = jax.jit(lambda *p: jax.vjp(lambda *x: attend(*x), *p)[1](dout))
    return [np.asarray(g.astype(jnp.float32)) for g in f(*primals)]
