"""mosaic_v3's forward with the softmax overlapping its own P V (`Tuning.overlap`, P in
registers or through shared memory) against the default, one process, cuDNN beside.
Usage: python overlap.py dump VARIANT (compile one head dim 128, 4K forward, for the
MOSAIC_GPU_DUMP_* flags) | check (exactness on awkward calls) | time [ROWS...]."""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxtile
from bench import check
from bench.probe import git_state
from bench.timing import time_jitted
from jaxtile.mask import MaskSpec
from jaxtile.mosaic import v3

VARIANTS = (None, "registers", "smem")


def tuning_of(d, spec, overlap):
    return dataclasses.replace(v3.default_tuning(d, d, 2, spec), overlap=overlap)


def dump(variant):
    overlap = None if variant == "none" else variant
    q = jax.random.normal(jax.random.key(0), (1, 4096, 16, 128), jnp.bfloat16)
    tuning = tuning_of(128, None, overlap)
    out = jaxtile.flash_attention(q, q, q, implementation="mosaic_v3", tuning=tuning)
    print(variant, tuning, float(out.astype(jnp.float32).sum()), flush=True)


def exactness():
    rng = np.random.default_rng(0)
    calls = {
        "q_longer_window": (1, 200, 60, 2, 2, 64, True, (10, 0), False),
        "gqa_ragged_d80": (2, 300, 1000, 8, 2, 80, True, (100, 0), False),
        "segments": (2, 1024, 1024, 4, 4, 128, True, None, True),
        "two_sided_d64": (1, 777, 777, 4, 4, 64, False, (50, 70), False),
        "d256": (1, 512, 512, 4, 4, 256, True, None, False),
        "window_persistent": (1, 2048, 2048, 4, 4, 128, False, (256, 256), False),
    }
    for name, (b, t, s, h, kvh, d, causal, window, seg) in calls.items():
        q, k, v = (
            jnp.asarray(rng.standard_normal(sh, np.float32)).astype(jnp.bfloat16)
            for sh in ((b, t, h, d), (b, s, kvh, d), (b, s, kvh, d))
        )
        ids = jnp.asarray(np.sort(rng.integers(0, 4, (b, t)), axis=1), jnp.int32) if seg else None
        kw = dict(causal=causal, window=window, segment_ids=ids)
        ref = jaxtile.flash_attention(*(x.astype(jnp.float32) for x in (q, k, v)), implementation="reference", **kw)
        spec = MaskSpec.create(t, s, causal=causal, window=window, has_segments=seg)
        dp = -(-d // 64) * 64
        outs = {
            o: jaxtile.flash_attention(q, k, v, implementation="mosaic_v3", tuning=tuning_of(dp, spec, o), **kw)
            for o in VARIANTS
        }
        outs = {o: x.astype(jnp.float32) for o, x in outs.items()}
        err = " ".join(f"{o}={float(jnp.max(jnp.abs(x - ref))):.4f}" for o, x in outs.items())
        same = " ".join(f"{o}:{bool(jnp.array_equal(outs[None], outs[o]))}" for o in VARIANTS[1:])
        print(f"{name}: max|err| {err}; equal to base {same}", flush=True)


def timing(names):
    shapes = [s for s in check.SHAPES if s.name in names]
    for shape in shapes:
        spec = MaskSpec.create(shape.seq, shape.seq, causal=shape.causal, window=shape.window)
        d = shape.head_dim
        primals = check._inputs(shape, "fwd")[0]

        def mosaic(overlap, shape=shape, spec=spec, d=d):
            tuning = tuning_of(d, spec, overlap)
            options = dict(causal=shape.causal, window=shape.window)
            return lambda *qkv: jaxtile.flash_attention(*qkv, implementation="mosaic_v3", tuning=tuning, **options)

        attends = {str(o): mosaic(o) for o in VARIANTS}
        attends["cudnn"] = check._cudnn(shape)
        ms = {n: [] for n in attends}
        for _ in range(2):
            for n, f in attends.items():
                try:
                    ms[n].append(time_jitted(f, primals[:3], 0.5).ms)
                except Exception as e:  # a variant that does not compile is reported, not fatal
                    ms[n].append(float("nan"))
                    print(n, type(e).__name__, str(e)[:300], flush=True)
        med = {n: float(np.median(v)) for n, v in ms.items()}
        flops = shape.flops("fwd")
        print(
            f"{shape.name:26}",
            " ".join(f"{n}={m:.3f}ms/{flops / m / 1e9:.0f}TF" for n, m in med.items()),
            " ".join(f"{o}/base={med['None'] / med[str(o)]:.3f}" for o in VARIANTS[1:]),
            flush=True,
        )


if __name__ == "__main__":
    print(jaxtile.__file__, git_state(), jax.devices()[0].device_kind, flush=True)
    mode, *rest = sys.argv[1:]
    {"dump": lambda: dump(rest[0]), "check": exactness, "time": lambda: timing(rest)}[mode]()
