"""Persistent programs for a runtime mask on mosaic_v3's forward, taking the tiles
heaviest first in snaking rounds (an ordered `_ring.Schedule` over `_ring.tile_order`,
which counts the key tiles of each query tile within its positions and runtime bounds;
da9195c's order counted the bounds alone, which tie for documents of one length),
against one program per query tile in grid order and heaviest first: packed causal
documents (16 heads of 128, 16K: 8 × 2K, 4 × 4K, 32 × 512, one document, 8 cut at
random points; 8 × 2K at 32 heads of 64), beside the separate sequences, a dense mask
that is not recognised, and ragged lengths. In one process, two passes, jax's caches
cleared between variants."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxtile
from bench import check
from jaxtile.mosaic import _ring, v3

stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
print(
    jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind, flush=True
)

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


d128 = next(s for s in check.SHAPES if s.name == "documents_8x2k_causal_16k")
d64 = next(s for s in check.SHAPES if s.name == "documents_8x2k_d64_causal_16k")
dense = next(s for s in check.SHAPES if s.name == "d64_4k_dense_unrecognised")
CASES = [
    (d128, "fwd", check._segment_ids(d128)),
    (d128, "fwdbwd", check._segment_ids(d128)),
    (dataclasses.replace(d128, name="documents_4x4k", documents=4), "fwd", None),
    (dataclasses.replace(d128, name="documents_32x512", documents=32), "fwd", None),
    (dataclasses.replace(d128, name="documents_1x16k", documents=1), "fwd", None),
    (dataclasses.replace(d128, name="documents_8_uneven"), "fwd", uneven_ids(8, d128.seq, 8)),
    (d64, "fwd", check._segment_ids(d64)),
]
for shape, mode, ids in CASES:
    ids_ = check._segment_ids(shape) if ids is None else ids
    packed = call(causal=True, segment_ids=ids_)
    variants = {
        "grid": scheduled(grid_order, packed),
        "ordered": scheduled(ORDERED, packed),
        "persistent": call(causal=True, segment_ids=ids_, tuning=v3.Tuning(persistent=True)),
    }
    if shape.name != "documents_8_uneven":
        variants["separate"] = check._separate_documents(shape)
    report(shape.name, mode, check.timed_passes(variants, shape, mode))

unrecognised = call(causal=False)
report(
    dense.name,
    "fwd",
    check.timed_passes(
        {
            "grid": scheduled(grid_order, unrecognised),
            "ordered": scheduled(ORDERED, unrecognised),
            "persistent": call(causal=False, tuning=v3.Tuning(persistent=True)),
        },
        dense,
        "fwd",
    ),
)

ragged = dataclasses.replace(d128, name="ragged_8x2k_lengths", batch=8, seq=2048, documents=0)
lengths = jnp.asarray(np.random.default_rng(3).integers(1, 2049, (8,)), jnp.int32)
by_length = call(causal=True, kv_lengths=lengths, q_lengths=lengths)
report(
    ragged.name,
    "fwd",
    check.timed_passes(
        {
            "grid": scheduled(grid_order, by_length),
            "ordered": scheduled(ORDERED, by_length),
            "persistent": call(causal=True, kv_lengths=lengths, q_lengths=lengths, tuning=v3.Tuning(persistent=True)),
        },
        ragged,
        "fwd",
    ),
)
