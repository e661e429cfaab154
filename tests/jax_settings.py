"""JAX's global settings that change how user code traces, as context managers, for
tests that run jaxtile under each: 64-bit types by default (``jax_enable_x64``), JAX's
own test configuration (``jax_numpy_rank_promotion="raise"``,
``jax_numpy_dtype_promotion="strict"``), all three at once, and a default matmul
precision that jaxtile's products must ignore."""

from __future__ import annotations

import contextlib

import jax


@contextlib.contextmanager
def jax_test_config():
    """x64, strict rank promotion and strict dtype promotion together."""
    with jax.enable_x64(True), jax.numpy_rank_promotion("raise"), jax.numpy_dtype_promotion("strict"):
        yield


SETTINGS = {
    "x64": lambda: jax.enable_x64(True),
    "rank_promotion_raise": lambda: jax.numpy_rank_promotion("raise"),
    "dtype_promotion_strict": lambda: jax.numpy_dtype_promotion("strict"),
    "jax_test_config": jax_test_config,
    "matmul_precision_bfloat16": lambda: jax.default_matmul_precision("bfloat16"),
}
