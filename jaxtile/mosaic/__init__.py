"""The Pallas kernels lowered through Mosaic GPU, for Hopper GPUs: FlashAttention-3's
forward (`v3`) and backward (`backward`), ``implementation="mosaic_v3"``. Off the GPU the
tests lower them for CUDA, and run them through jax 0.10.2's Mosaic GPU interpreter
(``tests/mosaic_interpreter.py`` fills what it lacks)."""

from jaxtile.mosaic import backward, v3

__all__ = ["backward", "v3"]
