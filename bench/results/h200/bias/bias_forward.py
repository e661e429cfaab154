"""A learned bias on mosaic_v3's forward (its tiles riding the ring beside K and V)
against the Triton forward (pallas_v2, which ran every bias call before), tokamax's
Mosaic kernel and cuDNN; the check's bias row and a head dim 64 call, the Mosaic forward
at its default tiles and in 64-key tiles of three stages. Forward and forward+backward
(the backward is pallas_v2's in both jaxtile variants). In one process, two passes,
jax's caches cleared between variants; ``ms`` per pass and the speed over the first
variant's best."""

import json
from pathlib import Path

import jax

import jaxtile
from bench import check
from jaxtile.mosaic import v3

SHAPES = (
    next(s for s in check.SHAPES if s.name == "bias_d128_causal_8k"),
    check.Shape("bias_d64_4k_causal", 4, 4096, 16, 64, causal=True, bias=True),
)


def jaxtile_call(shape, implementation, tuning=None):
    return lambda q, k, v, bias=None, mask=None: jaxtile.flash_attention(
        q, k, v, bias=bias, causal=shape.causal, implementation=implementation, tuning=tuning
    )


def main():
    stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
    print(jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind)
    for shape in SHAPES:
        for mode in check.MODES:
            variants = {
                "pallas_v2": jaxtile_call(shape, "pallas_v2"),
                "mosaic_v3": jaxtile_call(shape, "mosaic_v3"),
                "default": jaxtile_call(shape, None),
                "cudnn": check._cudnn(shape),
                "tokamax": check._tokamax(shape),
            }
            if mode == "fwd":
                variants["mosaic_64x3"] = jaxtile_call(shape, "mosaic_v3", v3.Tuning(block_k=64, num_stages=3))
            ms = check.timed_passes({k: f for k, f in variants.items() if f is not None}, shape, mode)
            first = min(x for x in ms["pallas_v2"] if x)
            for label, runs in ms.items():
                best = min((x for x in runs if x), default=None)
                runs_text = ",".join(f"{x:.4f}" if x else "err" for x in runs)
                speed = f"{first / best:.3f}x pallas_v2" if best else "error"
                tflops = f"{shape.flops(mode) / best / 1e9:.0f} TFLOP/s" if best else ""
                print(f"{shape.name:22s} {mode:6s} {label:12s} {runs_text:16s} {speed} {tflops}", flush=True)


if __name__ == "__main__":
    main()
