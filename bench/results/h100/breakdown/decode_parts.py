"""Where a decode step's time goes: jaxtile's compiled call (its HLO ops), the split-KV
kernel alone, the merge alone, beside cuDNN, in one process."""

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxtile
from bench.decode import Case, _inputs
from bench.timing import time_jitted
from jaxtile import _softmax as sm

print(jaxtile.__file__, jax.__version__, jax.devices()[0].device_kind)
for case in (Case(1, 1, 131072), Case(8, 1, 32768), Case(64, 1, 4096)):
    q, k, v = _inputs(case)
    fj = lambda q, k, v: jaxtile.flash_attention(q, k, v)  # noqa: E731
    fc = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")  # noqa: E731
    for name, f in (("jaxtile", fj), ("cudnn", fc)):
        text = jax.jit(f).lower(q, k, v).compile().as_text()
        entry = text[text.find("ENTRY") :]
        ops = re.findall(r"= \S+ (fusion|custom-call|copy|transpose|bitcast|reduce|convert)\(", entry)
        calls = re.findall(r'custom_call_target="([^"]+)"', entry)
        print(case.name, name, "entry ops:", {o: ops.count(o) for o in set(ops)}, calls)
        if name == "jaxtile" and "-v" in sys.argv:
            print(entry[:6000])
    t = {name: time_jitted(f, (q, k, v), 1.0).ms for name, f in (("jaxtile", fj), ("cudnn", fc))}
    for s in (16, 32):
        parts = jnp.asarray(np.random.default_rng(0).standard_normal((s, case.batch, 1, 32, 128), np.float32))
        lse = jnp.asarray(np.random.default_rng(1).standard_normal((s, case.batch, 32, 1), np.float32))
        t[f"merge{s}"] = time_jitted(lambda o, l: sm.merge(o, l)[0].astype(jnp.bfloat16), (parts, lse), 0.5).ms
    t["empty"] = time_jitted(lambda x: x + 1, (jnp.ones(16, jnp.float32),), 0.5).ms
    print(case.name, {n: round(ms * 1000, 1) for n, ms in t.items()}, "us")
