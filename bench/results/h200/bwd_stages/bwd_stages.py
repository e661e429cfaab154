"""Rings of 3 and 4 stages in mosaic_v3's backward kernels, never swept at head dim 128
(`bench.tune`'s candidates there were two stages, with 64- or 128-key dQ tiles), against
the default two, forward+backward on the check's standard rows and GQA, beside cuDNN.
Every variant runs the forward at its default tiles (`v3.default_tuning` of the call),
so that only the backward differs. In one process, two passes, jax's caches cleared
between variants; ``ms`` per pass and the speed over the default's best."""

import dataclasses
import json
from pathlib import Path

import jax

import jaxtile
from bench import check
from jaxtile.mask import MaskSpec
from jaxtile.mosaic import v3
from jaxtile.mosaic.backward import default_backward_tuning

NAMES = ("d128_4k_full", "d128_4k_causal", "d128_16k_full", "d128_16k_causal", "gqa_32_8_causal_8k", "d64_4k_full")
STAGES = (2, 3, 4)


def call(shape, stages: int):
    spec = MaskSpec.create(shape.seq, shape.seq, causal=shape.causal, window=shape.window)
    d = shape.head_dim
    backward = dataclasses.replace(default_backward_tuning(d, d), num_stages=stages)
    tuning = dataclasses.replace(v3.default_tuning(d, d, 2, spec), backward=backward)
    assert backward.fits(d, d, 2), backward
    return lambda q, k, v, mask=None: jaxtile.flash_attention(
        q, k, v, causal=shape.causal, window=shape.window, implementation="mosaic_v3", tuning=tuning
    )


def main():
    stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
    print(jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind)
    for name in NAMES:
        shape = next(s for s in check.SHAPES if s.name == name)
        variants = {f"stages_{n}": call(shape, n) for n in STAGES}
        variants["cudnn"] = check._cudnn(shape)
        ms = check.timed_passes(variants, shape, "fwdbwd")
        first = min(x for x in ms["stages_2"] if x)
        for label, runs in ms.items():
            best = min((x for x in runs if x), default=None)
            runs_text = ",".join(f"{x:.4f}" if x else "err" for x in runs)
            speed = f"{first / best:.3f}x stages_2" if best else "error"
            tflops = f"{shape.flops('fwdbwd') / best / 1e9:.0f} TFLOP/s" if best else ""
            print(f"{name:20s} {label:9s} {runs_text:16s} {speed} {tflops}", flush=True)


if __name__ == "__main__":
    main()
