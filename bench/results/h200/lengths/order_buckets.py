"""Persistent programs' runtime tile order on mosaic_v3's forward with lengths, heaviest
first (`_ring.tile_order` at 93bab95) against heaviest first by classes of weight, each
class batch element by batch element (so that the tiles running together share their
keys and values in L2): classes of a power of two of key tiles, and of a power of the
square root of two; beside the host's balanced schedule (the lengths ignored) and one
program per tile. In one process, two passes, jax's caches cleared between variants."""

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from persistent_lengths import lengths_call, lengths_cases, patched, report
from persistent_whole import balanced

import jaxtile
from bench import check
from jaxtile.mosaic import _ring, v3

# (name, batch, seq, heads, head_dim, causal, ragged lengths or whole sequences)
CASES = (
    ("full_8x2k_d128", 8, 2048, 16, 128, True, False),
    ("full_16x1k_d64", 16, 1024, 32, 64, True, False),
    ("ragged_8x2k_d128", 8, 2048, 16, 128, True, True),
    ("ragged_16x1k_d64", 16, 1024, 32, 64, True, True),
)


def class_order(spec, bounds, batch: int, rows: int, block_k: int, *, power: int):
    """Units by class of weight (the floor of log2 of their key tiles to the ``power``),
    heaviest class first; in a class batch element by batch element, heaviest first."""
    bounds = jnp.broadcast_to(bounds, (batch, *bounds.shape[1:]))
    q_tiles = jnp.arange(bounds.shape[-2], dtype=jnp.int32)
    spans = spec.kv_spans(q_tiles, rows, block_k, tuple(bounds[..., i] for i in range(4)))
    steps = jnp.broadcast_to(spans[-1].stop - spans[0].start, bounds.shape[:-1])
    weight = jnp.where(steps > 0, 31 - lax.clz(steps**power), -1)
    b = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None, None], steps.shape)
    return jnp.lexsort((-steps.reshape(-1), b.reshape(-1), -weight.reshape(-1))).astype(jnp.int32)


def main():
    stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
    print(jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind)
    for shape, lengths in lengths_cases(CASES):
        persistent = lengths_call(shape, lengths, True)
        variants = {
            "grid": lengths_call(shape, lengths, False),
            "heaviest": persistent,
            "classes_2": patched(_ring, "tile_order", functools.partial(class_order, power=1), persistent),
            "classes_sqrt2": patched(_ring, "tile_order", functools.partial(class_order, power=2), persistent),
            "balanced": patched(v3, "_schedule", balanced, persistent),
        }
        report(shape.name, "fwd", check.timed_passes(variants, shape, "fwd"))


if __name__ == "__main__":
    main()
