"""pallas_decode's share count at batch 1 (one query, GQA 32:8, head dim 128, 128K keys),
three passes interleaved, beside cuDNN."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxtile
from bench.decode import Case, _inputs
from bench.timing import time_jitted
from jaxtile.triton import decode

print(jaxtile.__file__, jax.__version__, jax.devices()[0].device_kind)
t = decode.DEFAULTS[2]
for kv in (131072, 65536):
    case = Case(1, 1, kv)
    q, k, v = _inputs(case)
    for layout, n in (("full", None), ("ragged", jnp.asarray(np.array([kv * 3 // 4], np.int32)))):
        variants = {"default": None, **{f"s{s}": decode.Tuning(t, t, t, num_splits=s) for s in (12, 13, 14, 15, 16)}}
        ms = {}
        for _pass in range(3):
            for name, tuning in variants.items():
                f = lambda q, k, v, n, tuning=tuning: jaxtile.flash_attention(q, k, v, kv_lengths=n, tuning=tuning)  # noqa: E731
                ms.setdefault(name, []).append(time_jitted(f, (q, k, v, n), 0.5).ms * 1e3)
            c = lambda q, k, v, n: jax.nn.dot_product_attention(  # noqa: E731
                q, k, v, key_value_seq_lengths=n, implementation="cudnn"
            )
            ms.setdefault("cudnn", []).append(time_jitted(c, (q, k, v, n), 0.5).ms * 1e3)
        for name, x in ms.items():
            print(
                f"kv{kv} {layout:6s} {name:8s} " + " ".join(f"{y:6.1f}" for y in x) + f"  median {np.median(x):.1f} us"
            )
