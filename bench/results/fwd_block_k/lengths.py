"""Where 192-key forward tiles win at head dim 128 without a causal mask or window
(`ab.py` at 9dc3295, H100: 16K 1.04x the default, 4K 0.90x): the default against
``Tuning(block_k=192)`` (one program per query tile) at 8K, 16K and 32K keys, and a GQA
32:8 call at 16K, beside cuDNN and tokamax, timed together in one process, three passes.
The 192-key output is checked against the default's first. With ``--ptxas`` it compiles
only the 16K call's 192-key forward, for ptxas's report (``MOSAIC_GPU_DUMP_PTXAS=1``)."""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

import jaxtile
from bench import check
from jaxtile.mosaic import v3

SHAPES = (
    check.Shape("d128_8k_full", 2, 8192, 16, 128),
    check.Shape("d128_16k_full", 1, 16384, 16, 128),
    check.Shape("d128_32k_full", 1, 32768, 8, 128),
    check.Shape("gqa_32_8_full_16k", 1, 16384, 32, 128, kv_heads=8),
)


def call(tuning=None):
    def attend(q, k, v, bias=None, mask=None):
        return jaxtile.flash_attention(q, k, v, implementation="mosaic_v3", tuning=tuning)

    return attend


def main():
    stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
    print(jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind)
    k192 = v3.Tuning(block_k=192)
    if "--ptxas" in sys.argv:
        (q, k, v), _, _ = check._inputs(SHAPES[1], "fwd")
        jax.jit(call(k192))(q, k, v).block_until_ready()
        return
    for shape in SHAPES:
        variants = {
            "default": call(),
            "k192": call(k192),
            "cudnn": check._cudnn(shape),
            "tokamax": check._tokamax(shape),
        }
        (q, k, v), _, _ = check._inputs(shape, "fwd")
        want, got = (jax.jit(variants[name])(q, k, v) for name in ("default", "k192"))
        err = float(jnp.max(jnp.abs(want.astype(jnp.float32) - got.astype(jnp.float32))))
        print(f"{shape.name:24s} k192 max |diff| to default {err:.3e}", flush=True)
        check.print_passes_together(variants, shape, "fwd", passes=3)


if __name__ == "__main__":
    main()
