"""What a forward costs per key step and per query tile: mosaic_v3 and tokamax's sm90
kernel, each with one program per query tile and with persistent programs, beside cuDNN.

The queries stay ``[4, 4096, 16, 128]`` (2048 tiles of 128 rows, about 15.5 waves of
programs on 132 SMs) while the keys grow (non-causal, 1024 to 8192: 8 to 64 steps of 128
keys). A line fitted to each kernel's milliseconds against the steps splits its time
into a part per step (the slope) and a part that does not grow with the keys (the
intercept: launching the programs, loading the queries, storing the output). The SASS of
the two kernels' steps matched (`../named_free/`), so this asks whether their gap is in
the steps or around them. Two passes, jax's caches cleared between calls::

    PYTHONPATH=. python costs.py OUT.json
"""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxtile
from bench import check, timing
from jaxtile.mosaic import v3

BATCH, Q_LEN, HEADS, HEAD_DIM, BLOCK_K = 4, 4096, 16, 128, 128
KV_LENS = (1024, 2048, 4096, 8192)


def _jaxtile(persistent: bool):
    tuning = v3.Tuning(persistent=persistent)
    return lambda q, k, v: jaxtile.flash_attention(q, k, v, implementation="mosaic_v3", tuning=tuning)


def _tokamax(persistent: bool):
    tokamax = check.load_tokamax()
    if tokamax is None:
        return None
    from tokamax._src.ops.attention import pallas_mosaic_gpu as tk

    config = tk.ConfigSM90(block_q=64, block_kv=BLOCK_K, num_stages=2, persistent=persistent)
    op = tk.PallasMosaicGpuFlashAttention(config=config)
    return lambda q, k, v: tokamax.dot_product_attention(q, k, v, implementation=(op,))


def _cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")


def main():
    stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
    print(jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind)
    variants = {
        "jaxtile": _jaxtile(False),
        "jaxtile.persistent": _jaxtile(True),
        "tokamax": _tokamax(False),
        "tokamax.persistent": _tokamax(True),
        "cudnn": _cudnn,
    }
    variants = {label: f for label, f in variants.items() if f is not None}
    ms = {label: {kv: [] for kv in KV_LENS} for label in variants}
    for _pass in range(2):
        for kv_len in KV_LENS:
            keys = jax.random.split(jax.random.key(kv_len), 3)
            q = jax.random.normal(keys[0], (BATCH, Q_LEN, HEADS, HEAD_DIM), jnp.bfloat16)
            k, v = (jax.random.normal(key, (BATCH, kv_len, HEADS, HEAD_DIM), jnp.bfloat16) for key in keys[1:])
            for label, attend in variants.items():
                jax.clear_caches()
                try:
                    ms[label][kv_len].append(timing.time_jitted(attend, [q, k, v], 0.5).ms)
                except Exception as exc:  # a kernel that rejects a shape leaves a gap
                    print(label, kv_len, "error:", str(exc).splitlines()[0][:200])
                print(f"{label:20s} kv {kv_len:5d} {ms[label][kv_len]}", flush=True)
    print("\nlabel                per step (us)  fixed (ms)   ms at kv " + " ".join(f"{kv:>7d}" for kv in KV_LENS))
    for label, runs in ms.items():
        steps = np.array([kv // BLOCK_K for kv in KV_LENS if runs[kv]], float)
        times = np.array([np.median(runs[kv]) for kv in KV_LENS if runs[kv]])
        if len(steps) < 2:
            continue
        slope, intercept = np.polyfit(steps, times, 1)
        cells = " ".join(f"{t:7.3f}" for t in times)
        print(f"{label:20s} {slope * 1e3:12.2f} {intercept:11.3f}   {cells}")
    Path(sys.argv[1]).write_text(
        json.dumps(dict(stamp=stamp, ms={k: {str(kv): t for kv, t in r.items()} for k, r in ms.items()}))
    )


if __name__ == "__main__":
    main()
