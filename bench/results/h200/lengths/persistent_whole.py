"""Why persistent programs lose on lengths that are the whole sequences (mosaic_v3's
forward): with lengths, one program per tile (grid), persistent programs taking the tiles
heaviest first (ordered, the default since 9a7850c) and persistent programs in the host's
balanced order of the structured mask, the lengths ignored (balanced); beside the same
calls without lengths, one program per tile and balanced persistent programs. In one
process, two passes, jax's caches cleared between variants."""

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
from persistent_lengths import lengths_call, lengths_cases, patched, report

import jaxtile
from bench import check
from jaxtile.mask import MaskSpec
from jaxtile.mosaic import v3

SCHEDULE = v3._schedule

# (name, batch, seq, heads, head_dim, causal, ragged lengths or whole sequences)
CASES = (
    ("full_8x2k_d128", 8, 2048, 16, 128, True, False),
    ("full_8x2k_d128_noncausal", 8, 2048, 16, 128, False, False),
    ("ragged_8x2k_d128", 8, 2048, 16, 128, True, True),
    ("full_16x1k_d64", 16, 1024, 32, 64, True, False),
)


def balanced(spec, tuning, tiles, rows, bounds):
    """`v3._schedule` as if the mask had no runtime bounds."""
    return SCHEDULE(spec, tuning, tiles, rows, None)


def mask_call(shape, persistent: bool):
    spec = MaskSpec.create(shape.seq, shape.seq, causal=shape.causal)
    tuning = dataclasses.replace(v3.default_tuning(shape.head_dim, shape.head_dim, 2, spec), persistent=persistent)
    return lambda q, k, v, bias=None, mask=None: jaxtile.flash_attention(
        q, k, v, causal=shape.causal, implementation="mosaic_v3", tuning=tuning
    )


def main():
    stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
    print(jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind)
    for shape, lengths in lengths_cases(CASES):
        print(f"{shape.name}: lengths {np.asarray(lengths).tolist()}", flush=True)
        variants = {
            "grid": lengths_call(shape, lengths, False),
            "ordered": lengths_call(shape, lengths, True),
            "balanced": patched(v3, "_schedule", balanced, lengths_call(shape, lengths, True)),
            "mask_grid": mask_call(shape, False),
            "mask_balanced": mask_call(shape, True),
        }
        report(shape.name, "fwd", check.timed_passes(variants, shape, "fwd"))


if __name__ == "__main__":
    main()
