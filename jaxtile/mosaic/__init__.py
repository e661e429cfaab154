"""The Pallas kernels lowered through Mosaic GPU, for Hopper GPUs: FlashAttention-3's
forward (`v3`) and backward (`backward`), ``implementation="mosaic_v3"``. Mosaic GPU has
no interpreter on the jax versions CI runs, so on a CPU these kernels are traced and
lowered but not run."""

from jaxtile.mosaic import backward, v3

__all__ = ["backward", "v3"]
