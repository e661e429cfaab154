"""Persistent programs for a runtime mask on mosaic_v3's forward, taking the tiles
heaviest first in snaking rounds (an ordered `_ring.Schedule` over `_ring.tile_order`,
which counts the key tiles of each query tile within its positions and runtime bounds;
da9195c's order counted the bounds alone, which tie for documents of one length),
against one program per query tile in grid order and heaviest first: packed causal
documents (16 heads of 128, 16K: 8 × 2K, 4 × 4K, 32 × 512, one document, 8 cut at
random points; 8 × 2K at 32 heads of 64), beside the separate sequences, a dense mask
that is not recognised, and ragged lengths. In one process, two passes, jax's caches
cleared between variants."""

from docs_order import main

main(persistent=True)
