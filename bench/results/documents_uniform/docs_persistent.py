"""Packed documents on mosaic_v3's forward at the kernels of main: persistent programs
(the runtime tiles heaviest first, `v3._schedule`) against one program per query tile,
each with the segment id test and without it (``noids``: `_ring.visible` told there
are no ids, exact only on documents that sit on tile edges, as here), beside the
documents as separate sequences. Does persistence pay once the ids' registers are gone?
In one process, two passes, jax's caches cleared between variants (the patches apply at
trace time)."""

import dataclasses
import json
from pathlib import Path

import jax

import jaxtile
from bench import check
from jaxtile.mosaic import _ring, v3

VISIBLE, PERSISTENT = _ring.visible, v3._persistent


def _without_ids(spec, *args, **kwargs):
    kwargs.pop("own_ids", None), kwargs.pop("step_ids", None)
    return VISIBLE(dataclasses.replace(spec, has_segments=False), *args, **kwargs)


def variant(ids, *, noids=False, persistent=False):
    def attend(q, k, v, bias=None, mask=None):
        _ring.visible = _without_ids if noids else VISIBLE
        v3._persistent = (lambda spec, rows: True) if persistent else PERSISTENT
        try:
            return jaxtile.flash_attention(q, k, v, causal=True, segment_ids=ids, implementation="mosaic_v3")
        finally:
            _ring.visible, v3._persistent = VISIBLE, PERSISTENT

    return attend


def main():
    stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
    print(jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind)
    for name in ("documents_8x2k_causal_16k", "documents_8x2k_d64_causal_16k"):
        shape = next(s for s in check.SHAPES if s.name == name)
        ids = check._segment_ids(shape)
        variants = {
            "ids": variant(ids),
            "ids_persistent": variant(ids, persistent=True),
            "noids": variant(ids, noids=True),
            "noids_persistent": variant(ids, noids=True, persistent=True),
            "separate": check._separate_documents(shape),
        }
        ms = check.timed_passes(variants, shape, "fwd")
        first = min(x for x in ms["ids"] if x)
        for label, runs in ms.items():
            best = min((x for x in runs if x), default=None)
            speed = f"{first / best:.3f}x ids" if best else "error"
            print(f"{name:30s} fwd {label:17s} {','.join(f'{x:.4f}' if x else 'err' for x in runs):16s} {speed}")


if __name__ == "__main__":
    main()
