"""jaxtile: exact, memory-efficient attention (FlashAttention V1 and V2) for JAX."""

from jaxtile import mosaic, reference, registry, scan, triton  # importing an implementation registers it
from jaxtile.api import flash_attention
from jaxtile.distributed.ring import ring_attention
from jaxtile.jax_nn import dot_product_attention
from jaxtile.mask import MaskSpec
from jaxtile.paged import paged_attention

registry._import_listed()

__all__ = [
    "MaskSpec",
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
