"""mosaic_v3's forward at head dim 256, persistent programs whose output leaves through
slots (`v3.Tuning.output_slots`) against one program per query tile (the default before
them), both in 64-key tiles, beside cuDNN and tokamax, timed together in one process,
two passes; the default's tuning for each row is printed, and its output checked
against one program per tile's (bitwise equal: the same tiles in the same order)."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp

import jaxtile
from bench import check
from jaxtile import _inputs
from jaxtile.mosaic import v3

SHAPES = (
    check.Shape("mqa_16_1_d256_causal_4k", 1, 4096, 16, 256, kv_heads=1, causal=True),
    check.Shape("mqa_16_1_d256_full_4k", 1, 4096, 16, 256, kv_heads=1),
    check.Shape("gqa_16_4_d256_causal_8k", 1, 8192, 16, 256, kv_heads=4, causal=True),
    check.Shape("gqa_16_4_d256_full_8k", 1, 8192, 16, 256, kv_heads=4),
    check.Shape("d256_causal_1k", 4, 1024, 16, 256, causal=True),
    check.Shape("d256_window_256_16k", 1, 16384, 8, 256, window=(256, 256)),
    check.Shape("d256_causal_8k", 2, 8192, 8, 256, causal=True),
    check.Shape("d256_causal_16k", 1, 16384, 8, 256, causal=True),
    check.Shape("d256_full_4k", 2, 4096, 8, 256),
    check.Shape("d256_full_16k", 1, 16384, 8, 256),
)


def call(shape, tuning=None):
    def attend(q, k, v, bias=None, mask=None):
        return jaxtile.flash_attention(
            q, k, v, causal=shape.causal, window=shape.window, implementation="mosaic_v3", tuning=tuning
        )

    return attend


def default_tuning(shape) -> v3.Tuning:
    """The forward's tuning for ``shape`` (`v3._plan` of its inputs, as the API gives them)."""
    (q, k, v), _, _ = check._inputs(shape, "fwd")
    options = dict(
        segment_ids=None, mask=None, logits_soft_cap=None, scale=None, tuning=None, block_q=None, block_k=None
    )
    inputs, config, _ = _inputs.canonicalize(
        q, k, v, causal=shape.causal, window=shape.window, tuning_types=(v3.Tuning,), platform="gpu", **options
    )
    return v3._plan(inputs, config)[2]


def main():
    stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
    print(jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind)
    for shape in SHAPES:
        variants = {
            "slots": call(shape, v3.Tuning(block_k=64, persistent=True)),
            "tile_np": call(shape, v3.Tuning(block_k=64)),
            "default": call(shape),
            "cudnn": check._cudnn(shape),
            "tokamax": check._tokamax(shape),
        }
        (q, k, v), _, _ = check._inputs(shape, "fwd")
        want, got = (jax.jit(variants[name])(q, k, v) for name in ("tile_np", "slots"))
        err = float(jnp.max(jnp.abs(want.astype(jnp.float32) - got.astype(jnp.float32))))
        print(f"{shape.name:26s} default {default_tuning(shape)}; slots max |diff| to tile_np {err:.3e}", flush=True)
        check.print_passes_together(variants, shape, "fwd", passes=2)


if __name__ == "__main__":
    main()
