"""What attention sinks cost (the check's sinks_gqa_64_8_causal_8k row): the call with
and without its sinks, and the fold that adds them (`_softmax.with_sinks`) alone, timed
in one process in interleaved rounds. Forward, then forward+backward. An implementation
named after the script is the one timed (the API's choice without it).

    bash bench/gpu_session.sh script OUT bench/results/h200/sinks/sinks_breakdown.py [IMPL]
"""

import functools
import json
import os
import sys

import jax
import jax.numpy as jnp

import jaxtile
from bench import timing
from bench.probe import probe
from jaxtile import _softmax

B, T, H, KV, D = 2, 8192, 64, 8, 64


def main(implementation: str | None = None):
    print(jaxtile.__file__, probe()["git"], jax.devices()[0].device_kind, implementation, flush=True)
    keys = jax.random.split(jax.random.key(0), 4)
    q, do = (jax.random.normal(key, (B, T, H, D), jnp.bfloat16) for key in keys[::3])
    k, v = (jax.random.normal(key, (B, T, KV, D), jnp.bfloat16) for key in keys[1:3])
    sinks = jnp.linspace(-1.0, 1.0, H, dtype=jnp.float32)
    options = dict(causal=True, implementation=implementation)
    out, lse = jaxtile.flash_attention(q, k, v, return_lse=True, **options)

    def attend(with_sinks):
        return lambda q, k, v, s: jaxtile.flash_attention(q, k, v, sinks=s if with_sinks else None, **options)

    def fold(out, lse, s):
        return _softmax.with_sinks(out, lse, s)

    def build(fn, args, mode):
        if mode == "fwdbwd":
            inner = fn

            def fn(*args):
                primal, vjp = jax.vjp(inner, *args)
                return vjp(jax.tree.map(jnp.ones_like, primal) if isinstance(primal, tuple) else do)

        return functools.partial(timing.compiled_call, fn, args)

    results = {}
    for mode in ("fwd", "fwdbwd"):
        builds = {
            "jaxtile, no sinks": build(attend(False), (q, k, v, sinks), mode),
            "jaxtile, sinks": build(attend(True), (q, k, v, sinks), mode),
            "with_sinks alone": build(fold, (out, lse, sinks), mode),
        }
        for name, t in timing.time_together(builds, 1.0).items():
            print(f"{mode:7s} {name:20s} {t.ms:8.3f} ms ({t.ms_lo:.3f}-{t.ms_hi:.3f})", flush=True)
            results[f"{mode}/{name}"] = t.ms
    with open(os.path.join(os.environ.get("OUT", "."), "sinks_breakdown.json"), "w") as f:
        record = dict(git=probe()["git"], device=jax.devices()[0].device_kind, implementation=implementation)
        json.dump(dict(record, ms=results), f, indent=1)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
