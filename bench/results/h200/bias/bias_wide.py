"""Whether 128-key tiles would pay for a bias at head dim 128 (mosaic_v3's forward): its
ring leaves them 1.5 KiB short of the 4 KiB margin `jaxtile.mosaic._ring.SHARED_MEMORY`
keeps for what Mosaic GPU adds to the tiles, so the default takes 64-key tiles. Here the
margin is dropped for one variant (which may then fail to compile: "err"). The check's
bias row, forward; one process, two passes, jax's caches cleared between variants."""

import contextlib
import json
from pathlib import Path

import jax

import jaxtile
from bench import check
from jaxtile.mosaic import v3

SHAPE = next(s for s in check.SHAPES if s.name == "bias_d128_causal_8k")


def call(tuning=None, margin=True):
    def attend(q, k, v, bias=None, mask=None):
        limit = contextlib.nullcontext() if margin else _no_margin()
        with limit:
            return jaxtile.flash_attention(q, k, v, bias=bias, causal=True, implementation="mosaic_v3", tuning=tuning)

    return attend


@contextlib.contextmanager
def _no_margin():
    kept = v3.SHARED_MEMORY
    v3.SHARED_MEMORY = 232448
    try:
        yield
    finally:
        v3.SHARED_MEMORY = kept


def main():
    stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
    print(jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind)
    variants = {"default": call(), "keys128_no_margin": call(v3.Tuning(block_k=128), margin=False)}
    ms = check.timed_passes(variants, SHAPE, "fwd")
    for label, runs in ms.items():
        print(f"{SHAPE.name:22s} fwd    {label:18s} {','.join(f'{x:.4f}' if x else 'err' for x in runs)}", flush=True)


if __name__ == "__main__":
    main()
