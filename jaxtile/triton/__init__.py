"""The Pallas kernels lowered to Triton: FlashAttention-1 (``pallas_v1``) and -2
(``pallas_v2``), split-KV decoding with the latter's kernel (``pallas_decode``), what they share (`jaxtile.triton._kernel`: tiles and their shared-memory
model, loads, masked products, the launch) and their launch parameters
(`jaxtile.triton.tuning`). They run on NVIDIA GPUs, and interpreted on the CPU."""

from jaxtile._core import AUTOTUNE
from jaxtile.triton import decode, v1, v2
from jaxtile.triton.tuning import KernelTuning, Tuning

__all__ = ["AUTOTUNE", "KernelTuning", "Tuning", "decode", "v1", "v2"]
