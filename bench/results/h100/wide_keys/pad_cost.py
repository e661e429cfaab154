"""What the 192-key forward's K/V padding copy costs at head dim 128, non-causal: the
default at 16384 keys (padded to 16512, 86 tiles) beside the padding of K and V alone,
and the default at 16128 keys (84 tiles, nothing padded, queries a multiple of the
256-row tiles), read in TFLOP/s; cuDNN and tokamax beside each, timed together in one
process, two passes."""

import json
from pathlib import Path

import jax

import jaxtile
from bench import check
from jaxtile._core import pad_to

SHAPES = (check.Shape("d128_16k_full", 1, 16384, 16, 128), check.Shape("d128_16128_full", 1, 16128, 16, 128))


def attend(q, k, v, bias=None, mask=None):
    return jaxtile.flash_attention(q, k, v, implementation="mosaic_v3")


def pad_only(q, k, v, bias=None, mask=None):
    keys = -(-k.shape[1] // 192) * 192
    return pad_to(k, 1, keys), pad_to(v, 1, keys)


def main():
    stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
    print(jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind)
    for shape in SHAPES:
        variants = {"default": attend, "cudnn": check._cudnn(shape), "tokamax": check._tokamax(shape)}
        if shape.seq % 192:
            variants["pad_only"] = pad_only
        check.print_passes_together(variants, shape, "fwd", passes=2)


if __name__ == "__main__":
    main()
