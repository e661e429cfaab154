"""Dense masks in mosaic_v3's forward (the kernel reads the mask's tiles on the tiles
they mask) against the routing before it (mosaic_v3 without dense masks: pallas_v2 takes
the call, and runs a mask it recognises as the structured call, on mosaic_v3) and against
mosaic_v3 recognising masks itself; beside cuDNN, in one process."""

import argparse
import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import jaxtile
from bench import check, timing
from bench.probe import git_state
from jaxtile import registry

parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=2)
parser.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"])
args = parser.parse_args()
print(jaxtile.__file__, git_state(), jax.devices()[0].device_kind, flush=True)
MOSAIC = registry.get("mosaic_v3")
VARIANTS = {
    "dense": MOSAIC,
    "before": dataclasses.replace(MOSAIC, features=MOSAIC.features - {"dense_mask"}),
    "recognising": dataclasses.replace(MOSAIC, recognises_masks=True),
}


@contextlib.contextmanager
def variant(name):
    registry._REGISTRY["mosaic_v3"] = VARIANTS[name]
    try:
        yield
    finally:
        registry._REGISTRY["mosaic_v3"] = MOSAIC


def fn(attend):
    """``attend`` as `check._timed` times it: the forward, or forward and backward."""

    def run(dense, cotangent, *qkv):
        if cotangent is None:
            return attend(*qkv, mask=dense)
        out, vjp = jax.vjp(lambda *p: attend(*p, mask=dense), *qkv)
        return out, *vjp(cotangent)

    return run


SHAPES = [s for s in check.SHAPES if s.dense_mask] + [
    check.Shape("d128_4k_dense_unrecognised", 4, 4096, 16, 128, causal=True, dense_mask="unrecognised"),
    check.Shape("d128_8k_dense_causal", 2, 8192, 16, 128, causal=True, dense_mask="flax"),
]
for shape in SHAPES:
    for mode in args.modes:
        primals, mask, dout = check._inputs(shape, mode)
        attends = {name: check._jaxtile(shape) for name in VARIANTS} | {"cudnn": check._cudnn(shape)}

        outs, ms = {}, {name: [] for name in attends}
        for _ in range(args.rounds):
            for name, attend in attends.items():
                with variant(name) if name in VARIANTS else contextlib.nullcontext():
                    try:
                        ms[name].append(timing.time_jitted(fn(attend), [mask, dout, *primals], 0.5).ms)
                        if name in VARIANTS and mode == "fwd" and name not in outs:
                            outs[name] = jax.jit(fn(attend))(mask, dout, *primals).astype(jnp.float32)
                    except Exception as exc:  # reported, and the row goes on
                        ms[name].append(float("nan"))
                        print(shape.name, mode, name, type(exc).__name__, str(exc)[:300], flush=True)
        med = {name: float(np.median(v)) for name, v in ms.items()}
        flops = shape.flops(mode)
        base = outs.get("before", outs.get("dense"))
        diff = {name: float(jnp.max(jnp.abs(x - base))) for name, x in outs.items() if x is not base}
        print(
            f"{shape.name:28s} {mode:6s}",
            " ".join(f"{n}={m:.3f}ms/{flops / m / 1e9:.0f}TF" for n, m in med.items()),
            " ".join(f"{n}/cudnn={med['cudnn'] / med[n]:.3f}" for n in VARIANTS),
            f"dense/before={med['before'] / med['dense']:.3f}",
            f"max|out-before|={diff}" if diff else "",
            flush=True,
        )
