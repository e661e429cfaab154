"""Persistent programs with lengths on mosaic_v3's forward, with the tile bounds in the
tile order's places (one read of global memory less on the way to a tile's spans) or
read through the order; each version is run in its own process, from its own directory,
against one program per tile and the same call without lengths (persistent programs in
the host's balanced order), as yardsticks in that process. Two passes, jax's caches
cleared between variants."""

import json
from pathlib import Path

import jax
from persistent_lengths import lengths_call, lengths_cases, report
from persistent_whole import mask_call

import jaxtile
from bench import check

# (name, batch, seq, heads, head_dim, causal, ragged lengths or whole sequences)
CASES = (
    ("full_16x1k_d64", 16, 1024, 32, 64, True, False),
    ("ragged_16x1k_d64", 16, 1024, 32, 64, True, True),
    ("ragged_8x2k_d128", 8, 2048, 16, 128, True, True),
    ("full_8x2k_d128", 8, 2048, 16, 128, True, False),
    ("full_8x2k_d128_noncausal", 8, 2048, 16, 128, False, False),
)


def main():
    stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
    print(jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind)
    for shape, lengths in lengths_cases(CASES):
        variants = {
            "grid": lengths_call(shape, lengths, False),
            "ordered": lengths_call(shape, lengths, True),
            "mask_balanced": mask_call(shape, True),
        }
        report(shape.name, "fwd", check.timed_passes(variants, shape, "fwd"))


if __name__ == "__main__":
    main()
