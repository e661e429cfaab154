"""Packed documents on mosaic_v3: masked steps whose tiles lie inside the segment ids'
runtime interior (`_ring.same_ids`: every id of the tile's queries and keys equal) skip
the id test (``uniform``), against testing the ids on every masked step (``ids``), an
upper bound that never tests them (``noids``, exact only on documents that sit on tile
edges), persistent programs with the skip, and the documents as separate sequences. In
one process, two passes, jax's caches cleared between variants (the patches apply at
trace time)."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxtile
from bench import check
from jaxtile.mosaic import _ring, v3

VISIBLE, PERSISTENT, SAME_IDS = _ring.visible, v3._persistent, _ring.same_ids


def _without_ids(spec, *args, **kwargs):
    kwargs.pop("own_ids", None), kwargs.pop("step_ids", None)
    return VISIBLE(dataclasses.replace(spec, has_segments=False), *args, **kwargs)


def variant(ids, *, uniform=True, noids=False, persistent=False):
    def attend(q, k, v, bias=None, mask=None):
        _ring.same_ids = SAME_IDS if uniform else (lambda *args: None)
        _ring.visible = _without_ids if noids else VISIBLE
        v3._persistent = (lambda spec, rows: True) if persistent else PERSISTENT
        try:
            return jaxtile.flash_attention(q, k, v, causal=True, segment_ids=ids, implementation="mosaic_v3")
        finally:
            _ring.same_ids, _ring.visible, v3._persistent = SAME_IDS, VISIBLE, PERSISTENT

    return attend


def uneven_ids(documents: int, seq: int, seed: int):
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, seq), documents - 1, replace=False))
    return jnp.asarray(np.searchsorted(cuts, np.arange(seq), side="right"), jnp.int32)[None]


def report(title, mode, ms):
    first = min(x for x in next(iter(ms.values())) if x)
    for label, runs in ms.items():
        best = min((x for x in runs if x), default=None)
        runs_text = ",".join(f"{x:.4f}" if x else "err" for x in runs)
        speed = f"{first / best:.3f}x {next(iter(ms))}" if best else "error"
        print(f"{title:26s} {mode:6s} {label:20s} {runs_text:16s} {speed}", flush=True)


def main():
    stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
    print(jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind)
    d128 = next(s for s in check.SHAPES if s.name == "documents_8x2k_causal_16k")
    d64 = next(s for s in check.SHAPES if s.name == "documents_8x2k_d64_causal_16k")
    many = dataclasses.replace(d128, name="documents_32x512", documents=32)
    uneven = dataclasses.replace(d128, name="documents_8_uneven")
    rows = [(d128, "fwd", True, True), (d64, "fwd", True, True), (many, "fwd", False, True)]
    rows += [(uneven, "fwd", False, False), (d128, "fwdbwd", False, True)]
    for shape, mode, more, aligned in rows:
        ids = check._segment_ids(shape) if aligned else uneven_ids(8, shape.seq, 8)
        variants = {"ids": variant(ids, uniform=False), "uniform": variant(ids)}
        if more:
            variants["noids"] = variant(ids, noids=True)
            variants["uniform_persistent"] = variant(ids, persistent=True)
        if aligned:
            variants["separate"] = check._separate_documents(shape)
        report(shape.name, mode, check.timed_passes(variants, shape, mode))


if __name__ == "__main__":
    main()
