"""Where mosaic_v3's forward+backward time goes: the whole, and with the dQ or dK/dV
kernel (or both) replaced by zeros, beside cuDNN in one process; jax's caches cleared
between variants."""

import jax
import jax.numpy as jnp

import jaxtile
from bench import check
from jaxtile.mosaic import _ring

print(jaxtile.__file__, jax.__version__, jax.devices()[0].device_kind)
launch = _ring.launch


def skipping(*names):
    def patched(kernel, operands, out_type, *args):
        if getattr(kernel, "func", kernel).__name__ in names:
            return tuple(jnp.zeros(t.shape, t.dtype) for t in out_type)
        return launch(kernel, operands, out_type, *args)

    return patched


VARIANTS = {
    "whole": launch,
    "no_dq": skipping("_dq_kernel"),
    "no_dkdv": skipping("_dkdv_kernel"),
    "neither": skipping("_dq_kernel", "_dkdv_kernel"),
}
SHAPES = {s.name: s for s in check.SHAPES}
for name in ("d64_4k_full", "d128_4k_full", "d128_16k_full", "d128_16k_causal", "d64_16k_full"):
    shape = SHAPES[name]
    ms = {}
    for _pass in range(2):
        for label, fn in VARIANTS.items():
            _ring.launch = fn
            jax.clear_caches()
            ms.setdefault(label, []).append(check._timed(check._jaxtile(shape), shape, "fwdbwd", 0.5)["ms"])
        _ring.launch = launch
        jax.clear_caches()
        ms.setdefault("fwd", []).append(check._timed(check._jaxtile(shape), shape, "fwd", 0.5)["ms"])
        for mode in ("fwd", "fwdbwd"):
            ms.setdefault(f"cudnn_{mode}", []).append(check._timed(check._cudnn(shape), shape, mode, 0.5)["ms"])
    m = {k: min(v) for k, v in ms.items()}
    bwd_flops = shape.flops("fwdbwd") - shape.flops("fwd")
    parts = {
        "jaxtile bwd": m["whole"] - m["fwd"],
        "cudnn bwd": m["cudnn_fwdbwd"] - m["cudnn_fwd"],
        "dq kernel": m["whole"] - m["no_dq"],
        "dkdv kernel": m["whole"] - m["no_dkdv"],
        "rest of bwd": m["neither"] - m["fwd"],
    }
    print(name, " ".join(f"{k}={' '.join(f'{x:.3f}' for x in v)}" for k, v in ms.items()))
    for k, v in parts.items():
        print(f"  {name} {k:12s} {v:.3f} ms ({bwd_flops / v / 1e9:.0f} TFLOP/s of the backward's flops)")
