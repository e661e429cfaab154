"""mosaic_v3's forward at head dim 128 with 192-key tiles (a two-stage ring of them fits
beside the queries; one program per query tile, since the persistent output's own tile
does not fit beside them) against the default (128-key tiles, persistent where
`v3._persistent` says) and 128-key tiles without persistence, beside cuDNN and tokamax,
timed together in one process, two passes. The 192-key output is checked against the
default's first."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp

import jaxtile
from bench import check
from jaxtile.mosaic import v3

ROWS = ("d128_4k_full", "d128_4k_causal", "d128_16k_full", "d128_16k_causal", "gqa_32_8_causal_8k")


def call(shape, tuning=None):
    def attend(q, k, v, bias=None, mask=None):
        return jaxtile.flash_attention(
            q, k, v, causal=shape.causal, window=shape.window, implementation="mosaic_v3", tuning=tuning
        )

    return attend


def main():
    stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
    print(jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind)
    for shape in (s for s in check.SHAPES if s.name in ROWS):
        variants = {
            "default": call(shape),
            "k128_np": call(shape, v3.Tuning(block_k=128)),
            "k192": call(shape, v3.Tuning(block_k=192)),
            "cudnn": check._cudnn(shape),
            "tokamax": check._tokamax(shape),
        }
        (q, k, v), _, _ = check._inputs(shape, "fwd")
        want, got = (jax.jit(variants[name])(q, k, v) for name in ("default", "k192"))
        err = float(jnp.max(jnp.abs(want.astype(jnp.float32) - got.astype(jnp.float32))))
        print(f"{shape.name:24s} k192 max |diff| to default {err:.3e}", flush=True)
        check.print_passes_together(variants, shape, "fwd", passes=2)


if __name__ == "__main__":
    main()
