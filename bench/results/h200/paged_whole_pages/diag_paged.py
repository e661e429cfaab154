"""Paged against contiguous decode, in one process: random and identity page tables, interleaved rounds."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxtile
from bench import decode as bd
from bench.timing import time_jitted

print(jaxtile.__file__, Path("VERSION.json").read_text().strip(), jax.devices()[0].device_kind, flush=True)
for case in bd.SMOKE if "--smoke" in sys.argv else bd.CASES:
    q, k, v = bd._inputs(case)
    lengths = bd._kv_lengths(case)
    calls = {"ragged": (bd._jaxtile, (q, k, v, jnp.asarray(lengths)))}
    for ps in (16, 64):
        random = bd._page_table(case, ps)
        tables = (
            {"random": random}
            if ps == 64
            else {"random": random, "identity": np.arange(random.size, dtype=np.int32).reshape(random.shape)}
        )
        for name, table in tables.items():
            calls[f"paged{ps}_{name}"] = (
                bd._paged,
                (q, bd._to_pages(k, table), bd._to_pages(v, table), jnp.asarray(table), jnp.asarray(lengths)),
            )
    ms = {name: [] for name in calls}
    for _ in range(3):
        for name, (fn, args) in calls.items():
            ms[name].append(time_jitted(lambda *a, fn=fn: fn(*a, implementation=None), args, 0.4).ms)
    base = np.median(ms["ragged"])
    print(case, " ".join(f"{n}={np.median(m):.4f}ms({base / np.median(m):.3f}x)" for n, m in ms.items()), flush=True)
    del q, k, v, calls
sys.exit(0)
