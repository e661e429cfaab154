"""Dense masks in mosaic_v3's backward (the dQ and dK/dV kernels read the mask's tiles on
the tiles they mask; dK/dV from a transposed copy) against the routing before it (the
backward of a dense mask on pallas_v2's Triton kernels), with the d64 default backward
tiles (128-row query tiles) against 64-row ones, and with Flax's mask read as dense
rather than recognised; forward+backward beside cuDNN, in one process."""

import argparse
import contextlib
import dataclasses

import jax
import numpy as np

import jaxtile
from bench import check, timing
from bench.probe import git_state
from jaxtile import registry
from jaxtile.mosaic import backward as mosaic_backward
from jaxtile.mosaic import v3

parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=2)
parser.add_argument("--shapes", nargs="*", help="names of the shapes to time (default: all)")
parser.add_argument("--variants", nargs="*", default=["mosaic", "triton_bwd", "bq64", "unrecognising"])
args = parser.parse_args()
print(jaxtile.__file__, git_state(), jax.devices()[0].device_kind, flush=True)
MOSAIC = registry.get("mosaic_v3")
FITS = mosaic_backward.BackwardTuning.fits
DEFAULT_BACKWARD = v3.default_backward_tuning


def _triton_for_dense(self, head_dim, head_dim_v, itemsize, dense=False):
    return not dense and FITS(self, head_dim, head_dim_v, itemsize)


@contextlib.contextmanager
def variant(name):
    """mosaic (this commit), triton_bwd (dense backward on pallas_v2, as before it),
    bq64 (64-row query tiles in the backward at every head dim), unrecognising."""
    jax.clear_caches()  # flash_attention's traces are cached by config: each variant traces its own
    if name == "unrecognising":
        registry._REGISTRY["mosaic_v3"] = dataclasses.replace(MOSAIC, recognises_masks=False)
    if name == "triton_bwd":
        mosaic_backward.BackwardTuning.fits = _triton_for_dense
    if name == "bq64":
        v3.default_backward_tuning = lambda *dims_and_mask: mosaic_backward.BackwardTuning(block_q=64)
    try:
        yield
    finally:
        registry._REGISTRY["mosaic_v3"] = MOSAIC
        mosaic_backward.BackwardTuning.fits = FITS
        v3.default_backward_tuning = DEFAULT_BACKWARD
        jax.clear_caches()


def fn(attend):
    def run(dense, cotangent, *qkv):
        out, vjp = jax.vjp(lambda *p: attend(*p, mask=dense), *qkv)
        return out, *vjp(cotangent)

    return run


VARIANTS = args.variants
SHAPES = [s for s in check.SHAPES if s.dense_mask] + [
    check.Shape("d128_4k_dense_unrecognised", 4, 4096, 16, 128, causal=True, dense_mask="unrecognised"),
    check.Shape("d128_8k_dense_causal", 2, 8192, 16, 128, causal=True, dense_mask="flax"),
]
for shape in [s for s in SHAPES if not args.shapes or s.name in args.shapes]:
    primals, mask, dout = check._inputs(shape, "fwdbwd")
    attends = {name: check._jaxtile(shape) for name in VARIANTS} | {"cudnn": check._cudnn(shape)}
    ms, grads = {name: [] for name in attends}, {}
    for _ in range(args.rounds):
        for name, attend in attends.items():
            with variant(name) if name in VARIANTS else contextlib.nullcontext():
                try:
                    ms[name].append(timing.time_jitted(fn(attend), [mask, dout, *primals], 0.5).ms)
                    if name in VARIANTS and name not in grads:
                        grads[name] = jax.jit(fn(attend))(mask, dout, *primals)
                except Exception as exc:  # reported, and the row goes on
                    ms[name].append(float("nan"))
                    print(shape.name, name, type(exc).__name__, str(exc)[:300], flush=True)
    med = {name: float(np.median(v)) for name, v in ms.items()}
    flops = shape.flops("fwdbwd")
    base = grads.get("triton_bwd")
    diff = {
        name: max(float(abs(a.astype(np.float32) - b.astype(np.float32)).max()) for a, b in zip(g, base))
        for name, g in grads.items()
        if base is not None and name != "triton_bwd"
    }
    print(
        f"{shape.name:28s} fwdbwd",
        " ".join(f"{n}={m:.3f}ms/{flops / m / 1e9:.0f}TF" for n, m in med.items()),
        " ".join(f"{n}/cudnn={med['cudnn'] / med[n]:.3f}" for n in VARIANTS),
        f"mosaic/triton_bwd={med['triton_bwd'] / med['mosaic']:.3f}",
        f"max|grads-triton_bwd|={diff}",
        flush=True,
    )
