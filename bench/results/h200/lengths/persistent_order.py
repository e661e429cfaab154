"""The order of persistent programs for masks with lengths on mosaic_v3's forward: batch
element by batch element, each one's tiles heaviest first (`_ring.tile_order` at 18e875f,
where the log was taken; reverted in 4ba6452), against all tiles heaviest first
(9a7850c's order, now `_ring.tile_order` again, `persistent_lengths.py`),
and one program per query tile; on `persistent_lengths.py`'s cases and two more (16K
ragged, 4K whole sequences). In one process, two passes, jax's caches cleared between
variants."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
from persistent_lengths import CASES, lengths_call, lengths_cases, patched, report

import jaxtile
from bench import check
from jaxtile.mosaic import _ring


def heaviest_first(spec, bounds, batch: int, rows: int, block_k: int):
    """9a7850c's `_ring.tile_order`: every unit by its key tiles, most first."""
    bounds = jnp.broadcast_to(bounds, (batch, *bounds.shape[1:]))
    q_tiles = jnp.arange(bounds.shape[-2], dtype=jnp.int32)
    spans = spec.kv_spans(q_tiles, rows, block_k, tuple(bounds[..., i] for i in range(4)))
    steps = jnp.broadcast_to(spans[-1].stop - spans[0].start, bounds.shape[:-1]).reshape(-1)
    return jnp.argsort(steps, descending=True, stable=True).astype(jnp.int32)


def main():
    stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
    print(jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind)
    more = (("ragged_2x16k_d128", 2, 16384, 16, 128, True, True), ("full_4x4k_d128", 4, 4096, 16, 128, True, False))
    for shape, lengths in lengths_cases(CASES + more):
        variants = {
            "grid": lengths_call(shape, lengths, False),
            "batch_major": lengths_call(shape, lengths, True),
            "heaviest": patched(_ring, "tile_order", heaviest_first, lengths_call(shape, lengths, True)),
        }
        report(shape.name, "fwd", check.timed_passes(variants, shape, "fwd"))


if __name__ == "__main__":
    main()
