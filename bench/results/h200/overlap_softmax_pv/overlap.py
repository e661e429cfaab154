"""mosaic_v3's forward with and without the softmax overlapping P V (Tuning.overlap), beside cuDNN, one process."""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxtile
from bench import check, timing
from bench.probe import git_state
from jaxtile.mask import MaskSpec
from jaxtile.mosaic import v3

print(jaxtile.__file__, git_state(), jax.devices()[0].device_kind, flush=True)
# Correctness: overlap against the reference (float32) on awkward calls, then against no overlap.
rng = np.random.default_rng(0)
for name, (b, t, s, h, kvh, d, causal, window, seg) in {
    "q_longer_window": (1, 200, 60, 2, 2, 64, True, (10, 0), False),
    "gqa_ragged_d80": (2, 300, 1000, 8, 2, 80, True, (100, 0), False),
    "segments": (2, 1024, 1024, 4, 4, 128, True, None, True),
    "two_sided_d64": (1, 777, 777, 4, 4, 64, False, (50, 70), False),
    "d256": (1, 512, 512, 4, 4, 256, True, None, False),
}.items():
    q, k, v = (
        jnp.asarray(rng.standard_normal(sh, np.float32)).astype(jnp.bfloat16)
        for sh in ((b, t, h, d), (b, s, kvh, d), (b, s, kvh, d))
    )
    ids = jnp.asarray(np.sort(rng.integers(0, 4, (b, t)), axis=1), jnp.int32) if seg else None
    kw = dict(causal=causal, window=window, segment_ids=ids)
    ref = jaxtile.flash_attention(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), implementation="reference", **kw
    )
    outs = {}
    for overlap in (False, True):
        tuning = dataclasses.replace(
            v3.default_tuning(((d + 63) // 64) * 64, ((d + 63) // 64) * 64, 2), overlap=overlap
        )
        outs[overlap] = jaxtile.flash_attention(q, k, v, implementation="mosaic_v3", tuning=tuning, **kw).astype(
            jnp.float32
        )
    err = {o: float(jnp.max(jnp.abs(x - ref))) for o, x in outs.items()}
    print(
        f"{name}: max|err| no-overlap {err[False]:.4f} overlap {err[True]:.4f}; equal {bool(jnp.array_equal(outs[False], outs[True]))}; finite {bool(jnp.isfinite(outs[True]).all())}",
        flush=True,
    )

names = sys.argv[1:] or [
    "d64_4k_full",
    "d64_4k_causal",
    "d64_16k_full",
    "d64_16k_causal",
    "d128_4k_full",
    "d128_4k_causal",
    "d128_16k_full",
    "d128_16k_causal",
    "gqa_32_8_causal_8k",
    "window_1023_causal_16k",
    "window_256_256_16k",
    "documents_8x2k_causal_16k",
    "d256_causal_8k",
]
shapes = [s for s in check.SHAPES if s.name in names] + [check.Shape("d64_1k_causal", 16, 1024, 32, 64, causal=True)]
for shape in shapes:
    spec = MaskSpec.create(shape.seq, shape.seq, causal=shape.causal, window=shape.window)
    d = shape.head_dim
    base = v3.default_tuning(d, d, 2, spec)
    variants = {"base": base, "overlap": dataclasses.replace(base, overlap=True)}
    if base.block_k > 128:
        variants["overlap_k128"] = dataclasses.replace(base, overlap=True, block_k=128)
    primals, mask, _ = check._inputs(shape, "fwd")
    segment_ids = check._segment_ids(shape) if shape.documents else None

    def mosaic(tuning, shape=shape, segment_ids=segment_ids):
        options = dict(causal=shape.causal, window=shape.window, segment_ids=segment_ids)
        return lambda *qkv: jaxtile.flash_attention(*qkv, implementation="mosaic_v3", tuning=tuning, **options)

    attends = {n: mosaic(t) for n, t in variants.items()}
    cudnn = check._cudnn(shape)
    if cudnn is not None:
        attends["cudnn"] = cudnn
    ms = {n: [] for n in attends}
    for _ in range(2):
        for n, f in attends.items():
            try:
                ms[n].append(timing.time_jitted(f, primals[:3], 0.5).ms)
            except Exception as e:
                ms[n].append(float("nan"))
                print(n, type(e).__name__, str(e)[:300])
    med = {n: float(np.median(v)) for n, v in ms.items()}
    flops = shape.flops("fwd")
    print(
        shape.name,
        " ".join(f"{n}={m:.3f}ms/{flops / m / 1e9:.0f}TF" for n, m in med.items()),
        f"overlap/base={med['base'] / med['overlap']:.3f}",
        flush=True,
    )
