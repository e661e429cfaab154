"""Dense-mask forward tiles of mosaic_v3 against causal=True and cuDNN; and the cost of
the mask's pre-pass (int8 copy and tile bounds)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxtile
from bench import check, timing
from bench.probe import git_state
from jaxtile._core import Inputs
from jaxtile.mask import MaskSpec
from jaxtile.mosaic import _ring, v3

print(jaxtile.__file__, git_state(), jax.devices()[0].device_kind, flush=True)
if len(sys.argv) > 1:
    q = jax.random.normal(jax.random.key(0), (1, 1024, 4, 64), jnp.bfloat16)
    m = jnp.tril(jnp.ones((1024, 1024), bool))
    tuning = v3.Tuning(block_k=int(sys.argv[1]))
    out = jaxtile.flash_attention(q, q, q, mask=m, implementation="mosaic_v3", tuning=tuning)
    print(tuning, float(out.astype(jnp.float32).sum()), flush=True)
    sys.exit()
SHAPES = [s for s in check.SHAPES if s.dense_mask] + [
    check.Shape("d128_4k_dense_unrecognised", 4, 4096, 16, 128, causal=True, dense_mask="unrecognised"),
]
for shape in SHAPES:
    primals, mask, _ = check._inputs(shape, "fwd")
    d = shape.head_dim
    blocks = [(256, 2), (128, 2), (128, 3), (64, 2), (64, 4)] if d == 64 else [(128, 2), (64, 2), (64, 3)]
    attends = {}
    for bk, st in blocks:
        tuning = v3.Tuning(block_k=bk, num_stages=st)
        attends[f"dense_{bk}x{st}"] = lambda q, k, v, m, t=tuning: jaxtile.flash_attention(
            q, k, v, mask=m, implementation="mosaic_v3", tuning=t
        )
    attends["default"] = lambda q, k, v, m: jaxtile.flash_attention(q, k, v, mask=m)
    attends["causal"] = lambda q, k, v, m: jaxtile.flash_attention(q, k, v, causal=True)
    cudnn = check._cudnn(shape)
    attends["cudnn"] = lambda q, k, v, m, cudnn=cudnn: cudnn(q, k, v)
    spec = MaskSpec.create(shape.seq, shape.seq, has_dense_mask=True)
    attends["prepass"] = lambda q, k, v, m, spec=spec, n=shape.seq: _ring.runtime_operands(
        Inputs(q, k, v, mask=m), spec, n, n, 128, 128
    )
    ms = {n: [] for n in attends}
    for _ in range(2):
        for n, f in attends.items():
            try:
                ms[n].append(timing.time_jitted(f, [*primals[:3], mask], 0.5).ms)
            except Exception as e:
                ms[n].append(float("nan"))
                print(n, type(e).__name__, str(e)[:300], flush=True)
    med = {n: float(np.median(v)) for n, v in ms.items()}
    flops = shape.flops("fwd")
    print(
        shape.name,
        " ".join(f"{n}={m:.3f}ms/{flops / m / 1e9:.0f}TF/{med['cudnn'] / m:.3f}x" for n, m in med.items()),
        flush=True,
    )
