"""One program per query tile, launched in grid order against heaviest first (an ordered
`_ring.Schedule` over `_ring.tile_order`, which counts the key tiles of each query tile
within its runtime bounds and its positions), on mosaic_v3's forward with a runtime mask:
packed causal documents (16 heads of 128, 16K: 8 × 2K, 4 × 4K, 32 × 512, one document,
8 cut at random points; 8 × 2K at 32 heads of 64), a dense mask that is not recognised,
and ragged lengths. And what a runtime mask costs a program: the 8 × 2K documents as
separate sequences (one program per tile) with and without segment ids that are all
zero, and with lengths that are the whole sequences. In one process, two passes, jax's
caches cleared between variants."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxtile
from bench import check
from jaxtile.mosaic import _ring, v3

ORDERED = v3._schedule


def grid_order(spec, tuning, tiles, rows, bounds):
    """`v3._schedule` before the ordered grid: runtime bounds launch in grid order."""
    if bounds is not None and not tuning.persistent:
        return _ring.Schedule(tiles), ()
    return ORDERED(spec, tuning, tiles, rows, bounds)


def scheduled(schedule, attend):
    def traced(*args, **kwargs):
        v3._schedule = schedule
        try:
            return attend(*args, **kwargs)
        finally:
            v3._schedule = ORDERED

    return traced


def call(**options):
    return lambda q, k, v, bias=None, mask=None: jaxtile.flash_attention(
        q, k, v, mask=mask, implementation="mosaic_v3", **options
    )


def uneven_ids(documents: int, seq: int, seed: int):
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, seq), documents - 1, replace=False))
    return jnp.asarray(np.searchsorted(cuts, np.arange(seq), side="right"), jnp.int32)[None]


def report(title, mode, ms):
    first = min(x for x in next(iter(ms.values())) if x)
    for label, runs in ms.items():
        best = min((x for x in runs if x), default=None)
        runs_text = ",".join(f"{x:.4f}" if x else "err" for x in runs)
        speed = f"{first / best:.3f}x {next(iter(ms))}" if best else "error"
        print(f"{title:30s} {mode:6s} {label:14s} {runs_text:16s} {speed}", flush=True)


def main(persistent: bool = False):
    """The runs of this script; with ``persistent`` (`docs_persist.py`) a third variant,
    persistent programs, and not the cost of a runtime mask to a program."""
    stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
    print(jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind)
    d128 = next(s for s in check.SHAPES if s.name == "documents_8x2k_causal_16k")
    d64 = next(s for s in check.SHAPES if s.name == "documents_8x2k_d64_causal_16k")
    dense = next(s for s in check.SHAPES if s.name == "d64_4k_dense_unrecognised")
    ragged = dataclasses.replace(d128, name="ragged_8x2k_lengths", batch=8, seq=2048, documents=0)
    lengths = jnp.asarray(np.random.default_rng(3).integers(1, 2049, (8,)), jnp.int32)
    packed = [
        (d128, "fwd", None),
        (d128, "fwdbwd", None),
        (dataclasses.replace(d128, name="documents_4x4k", documents=4), "fwd", None),
        (dataclasses.replace(d128, name="documents_32x512", documents=32), "fwd", None),
        (dataclasses.replace(d128, name="documents_1x16k", documents=1), "fwd", None),
        (dataclasses.replace(d128, name="documents_8_uneven"), "fwd", uneven_ids(8, d128.seq, 8)),
        (d64, "fwd", None),
    ]
    cases = [
        (shape, mode, dict(causal=True, segment_ids=check._segment_ids(shape) if ids is None else ids))
        for shape, mode, ids in packed
    ]
    cases += [
        (dense, "fwd", dict(causal=False)),
        (ragged, "fwd", dict(causal=True, kv_lengths=lengths, q_lengths=lengths)),
    ]
    for shape, mode, options in cases:
        variants = {"grid": scheduled(grid_order, call(**options)), "ordered": scheduled(ORDERED, call(**options))}
        if persistent:
            variants["persistent"] = call(**options, tuning=v3.Tuning(persistent=True))
        if shape.documents and shape.name != "documents_8_uneven":
            variants["separate"] = check._separate_documents(shape)
        report(shape.name, mode, check.timed_passes(variants, shape, mode))
    if persistent:
        return
    # What the runtime mask costs a program: the same 8 × 2K sequences, one program per tile.
    separate = dataclasses.replace(d128, name="separate_8x2k", batch=8, seq=2048, documents=0)
    one_per_tile = v3.Tuning()
    full = jnp.full((8,), 2048, jnp.int32)
    masks = {
        "zero_ids": dict(segment_ids=jnp.zeros((8, 2048), jnp.int32)),
        "full_lengths": dict(kv_lengths=full, q_lengths=full),
    }
    variants = {"plain": call(causal=True, tuning=one_per_tile)}
    variants |= {
        label: scheduled(grid_order, call(causal=True, tuning=one_per_tile, **mask)) for label, mask in masks.items()
    }
    report(separate.name, "fwd", check.timed_passes(variants, separate, "fwd"))


if __name__ == "__main__":
    main()
