"""jaxtile: exact, memory-efficient attention (FlashAttention 1, 2 and 3) for JAX."""

from jaxtile import analysis, mosaic, reference, registry, scan, triton  # importing an implementation registers it
from jaxtile.api import flash_attention
from jaxtile.distributed.ring import ring_attention
from jaxtile.jax_nn import dot_product_attention
from jaxtile.mask import MaskSpec
from jaxtile.paged import paged_attention

registry._import_listed()

__all__ = [
    "MaskSpec",
    "analysis",
    "dot_product_attention",
    "flash_attention",
    "mosaic",
    "paged_attention",
    "reference",
    "registry",
    "ring_attention",
    "scan",
    "triton",
]
__version__ = "0.1.0"
