"""jaxtile: exact, memory-efficient attention (FlashAttention V1 and V2) for JAX."""

from jaxtile.api import IMPLEMENTATIONS, flash_attention
from jaxtile.mask import MaskSpec
from jaxtile.ring import ring_attention

__all__ = ["IMPLEMENTATIONS", "MaskSpec", "flash_attention", "ring_attention"]
__version__ = "0.1.0"
