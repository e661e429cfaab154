"""Head dims past 128: mosaic_v3's backward on the Mosaic kernels with roles (the dK/dV
kernel's consumers share a key tile, one accumulating dV, the other dK; the dQ kernel
runs one consumer) against the Triton backward it took before, beside cuDNN, in one
process; jax's caches cleared between variants. Also each Mosaic kernel's part (the
other replaced by zeros) and the backward's bitwise determinism."""

import jax
import jax.numpy as jnp
import numpy as np
from _gradients import grads  # this folder: run as a script

import jaxtile
from bench import check
from jaxtile.mosaic import _ring
from jaxtile.mosaic import backward as mosaic_backward

print(jaxtile.__file__, jax.__version__, jax.devices()[0].device_kind, flush=True)
launch, fits = _ring.launch, mosaic_backward.BackwardTuning.fits


def skipping(*names):
    def patched(kernel, operands, out_type, *args):
        if getattr(kernel, "func", kernel).__name__ in names:
            return tuple(jnp.zeros(t.shape, t.dtype) for t in out_type)
        return launch(kernel, operands, out_type, *args)

    return patched


def narrow_only(self, head_dim, head_dim_v, *args):  # the Triton backward past 128, as before
    return max(head_dim, head_dim_v) <= 128 and fits(self, head_dim, head_dim_v, *args)


VARIANTS = {
    "mosaic": (launch, fits),
    "triton": (launch, narrow_only),
    "no_dq": (skipping("_dq_kernel"), fits),
    "no_dkdv": (skipping("_dkdv_kernel"), fits),
}
SHAPES = [
    next(s for s in check.SHAPES if s.name == "d256_causal_8k"),
    check.Shape("d256_4k_full", 2, 4096, 8, 256),
    check.Shape("d256_gqa_16_4_causal_8k", 2, 8192, 16, 256, kv_heads=4, causal=True),
    check.Shape("d192_causal_8k", 2, 8192, 8, 192, causal=True),
]


for shape in SHAPES:
    jax.clear_caches()
    first, second = grads(shape), grads(shape)
    bitwise = all(np.array_equal(a, b) for a, b in zip(first, second))
    _ring.launch, mosaic_backward.BackwardTuning.fits = VARIANTS["triton"]
    jax.clear_caches()
    triton = grads(shape)
    _ring.launch, mosaic_backward.BackwardTuning.fits = VARIANTS["mosaic"]
    diff = [float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30)) for a, b in zip(first, triton)]
    print(f"{shape.name} bitwise_repeat={bitwise} max|mosaic-triton|/max|triton| dq,dk,dv={diff}", flush=True)
    ms = {}
    for _pass in range(2):
        for label, (fn, fit) in VARIANTS.items():
            _ring.launch, mosaic_backward.BackwardTuning.fits = fn, fit
            jax.clear_caches()
            ms.setdefault(label, []).append(check._timed(check._jaxtile(shape), shape, "fwdbwd", 0.5)["ms"])
        _ring.launch, mosaic_backward.BackwardTuning.fits = VARIANTS["mosaic"]
        jax.clear_caches()
        ms.setdefault("fwd", []).append(check._timed(check._jaxtile(shape), shape, "fwd", 0.5)["ms"])
        for mode in ("fwd", "fwdbwd"):
            ms.setdefault(f"cudnn_{mode}", []).append(check._timed(check._cudnn(shape), shape, mode, 0.5)["ms"])
    m = {k: min(v) for k, v in ms.items()}
    fwd_flops, all_flops = shape.flops("fwd"), shape.flops("fwdbwd")
    print(shape.name, " ".join(f"{k}={','.join(f'{x:.3f}' for x in v)}" for k, v in ms.items()))
    for label in ("mosaic", "triton", "cudnn_fwdbwd"):
        print(
            f"  {shape.name} {label:13s} fwd+bwd {m[label]:.3f} ms {all_flops / m[label] / 1e9:.0f} TFLOP/s"
            f" {m['cudnn_fwdbwd'] / m[label]:.3f}x cuDNN"
        )
    bwd = {
        "mosaic": m["mosaic"] - m["fwd"],
        "triton": m["triton"] - m["fwd"],
        "cudnn": m["cudnn_fwdbwd"] - m["cudnn_fwd"],
    }
    for label, t in bwd.items():
        print(f"  {shape.name} {label:13s} bwd {t:.3f} ms {(all_flops - fwd_flops) / t / 1e9:.0f} TFLOP/s")
    print(
        f"  {shape.name} dq kernel {m['mosaic'] - m['no_dq']:.3f} ms, dkdv kernel {m['mosaic'] - m['no_dkdv']:.3f} ms"
    )
