"""What taking persistent programs' tiles in a runtime order costs on mosaic_v3's forward
with lengths: the order by an argsort (`_ring.tile_order`, the default), by a counting
sort (each unit's place from one comparison of all pairs), and no order at all (the
launch order, through the same ordered kernel), beside the host's balanced schedule (the
lengths ignored) and one program per tile; and each order's cost alone, from the
lengths. In one process, two passes, jax's caches cleared between variants."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
from persistent_lengths import lengths_call, lengths_cases, patched, report
from persistent_whole import balanced

import jaxtile
from bench import check, timing
from jaxtile.mask import MaskSpec
from jaxtile.mosaic import _ring, v3

TILE_ORDER = _ring.tile_order

# (name, batch, seq, heads, head_dim, causal, ragged lengths or whole sequences)
CASES = (
    ("full_8x2k_d128_noncausal", 8, 2048, 16, 128, False, False),
    ("full_16x1k_d64", 16, 1024, 32, 64, True, False),
    ("ragged_8x2k_d128", 8, 2048, 16, 128, True, True),
    ("ragged_16x1k_d64", 16, 1024, 32, 64, True, True),
)


def counting_order(spec, bounds, batch: int, rows: int, block_k: int):
    """`_ring.tile_order`'s permutation without a sort: unit ``u``'s place is the number of
    units heavier than it, or as heavy and before it."""
    bounds = jnp.broadcast_to(bounds, (batch, *bounds.shape[1:]))
    q_tiles = jnp.arange(bounds.shape[-2], dtype=jnp.int32)
    spans = spec.kv_spans(q_tiles, rows, block_k, tuple(bounds[..., i] for i in range(4)))
    steps = jnp.broadcast_to(spans[-1].stop - spans[0].start, bounds.shape[:-1]).reshape(-1)
    units = jnp.arange(steps.size, dtype=jnp.int32)
    before = (steps[None, :] > steps[:, None]) | (
        (steps[None, :] == steps[:, None]) & (units[None, :] < units[:, None])
    )
    place = jnp.sum(before, axis=1, dtype=jnp.int32)
    return jnp.sum(jnp.where(place[None, :] == units[:, None], units[None, :], 0), axis=1, dtype=jnp.int32)


def launch_order(spec, bounds, batch: int, rows: int, block_k: int):
    """No order: the units in launch order."""
    return jnp.arange(batch * bounds.shape[1] * bounds.shape[2], dtype=jnp.int32)


def order_alone(shape, lengths, order):
    """Milliseconds of the tile bounds and ``order`` from the lengths, as the forward
    computes them."""
    spec = MaskSpec.create(shape.seq, shape.seq, causal=shape.causal, has_lengths=True)
    tuning = v3.default_tuning(shape.head_dim, shape.head_dim, 2, spec)
    rows = 2 * tuning.block_q

    def fn(lengths):
        pair = jnp.stack([lengths, lengths], axis=-1)
        bounds = spec.tile_bounds(rows, tuning.block_k, lengths=pair)
        return order(spec, bounds, shape.batch, rows, tuning.block_k)

    both = jnp.stack([lengths, lengths], axis=-1)
    bounds = spec.tile_bounds(rows, tuning.block_k, lengths=both)
    want = TILE_ORDER(spec, bounds, shape.batch, rows, tuning.block_k)
    same = bool(jnp.all(order(spec, bounds, shape.batch, rows, tuning.block_k) == want))
    return timing.time_jitted(fn, [lengths], 0.5).ms, same


def main():
    stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
    print(jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind)
    for shape, lengths in lengths_cases(CASES):
        for label, order in (("argsort", TILE_ORDER), ("counting", counting_order)):
            ms, same = order_alone(shape, lengths, order)
            print(f"{shape.name:28s} order  {label:14s} {ms:.4f} ms alone, same as argsort: {same}", flush=True)
        persistent = lengths_call(shape, lengths, True)
        variants = {
            "grid": lengths_call(shape, lengths, False),
            "argsort": persistent,
            "counting": patched(_ring, "tile_order", counting_order, persistent),
            "launch_order": patched(_ring, "tile_order", launch_order, persistent),
            "balanced": patched(v3, "_schedule", balanced, persistent),
        }
        report(shape.name, "fwd", check.timed_passes(variants, shape, "fwd"))


if __name__ == "__main__":
    main()
