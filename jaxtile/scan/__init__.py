"""The ``jax.lax`` loops: FlashAttention-1 (``scan_v1``) and -2 (``scan_v2``) over tiles
of every batch element and head at once, with their shared tile helpers. They run on any
platform JAX does."""

from jaxtile.scan import v1, v2

__all__ = ["v1", "v2"]
