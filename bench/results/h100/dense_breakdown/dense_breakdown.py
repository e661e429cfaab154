"""Where the unrecognised dense mask's time goes (the check's d64_4k_dense_unrecognised
row): each part of the call timed beside cuDNN in one process, interleaved rounds.

    bash bench/gpu_session.sh script OUT bench/results/h100/dense_breakdown/dense_breakdown.py

Calls: cuDNN causal (the check's peer) and with the mask itself; jaxtile causal; the
Flax mask (recognised); the unrecognised mask as ``flash_attention`` runs it (the
recognition pass, then a ``lax.switch`` to the dense branch); the same mask with the
recognition left out (the dense branch alone); and the host-side passes alone: the
recognition, the mask's tile bounds, its int8 copy. Forward, then forward+backward.
"""

import functools
import json
import os
import sys
from unittest import mock

import jax
import jax.numpy as jnp

import jaxtile
from bench import timing
from bench.probe import probe
from jaxtile import api
from jaxtile.mask import MaskSpec

B, T, H, D = 4, 4096, 32, 64


def main():
    print(jaxtile.__file__, probe()["git"], jax.devices()[0].device_kind, flush=True)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(key, (B, T, H, D), jnp.bfloat16) for key in keys)
    causal = jnp.tril(jnp.ones((T, T), jnp.bool_))
    masks = {"flax": causal, "unrecognised": causal.at[1:, 0].set(False)}
    spec = MaskSpec.create(T, T, has_dense_mask=True)

    def attend(kind):
        if kind == "cudnn":
            return lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        if kind == "cudnn_mask":
            return lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m[None, None], implementation="cudnn")
        if kind == "jaxtile_causal":
            return lambda q, k, v, m: jaxtile.flash_attention(q, k, v, causal=True)
        return lambda q, k, v, m: jaxtile.flash_attention(q, k, v, mask=m)

    def build(kind, mask, mode, recognise=True):
        fn = attend(kind)
        if mode == "fwdbwd":
            inner = fn

            def fn(q, k, v, m):
                _, vjp = jax.vjp(lambda q, k, v: inner(q, k, v, m), q, k, v)
                return vjp(do)

        def compiled():
            if recognise:
                return timing.compiled_call(fn, (q, k, v, masks[mask]))
            with mock.patch.object(api, "_recognises", lambda *a: False):
                return timing.compiled_call(fn, (q, k, v, masks[mask]))

        return compiled

    results = {}
    for mode in ("fwd", "fwdbwd"):
        builds = {
            "cudnn causal": build("cudnn", "flax", mode),
            "cudnn with the unrecognised mask": build("cudnn_mask", "unrecognised", mode),
            "jaxtile causal": build("jaxtile_causal", "flax", mode),
            "jaxtile flax (recognised)": build("jaxtile", "flax", mode),
            "jaxtile unrecognised": build("jaxtile", "unrecognised", mode),
            "jaxtile unrecognised, no recognition": build("jaxtile", "unrecognised", mode, recognise=False),
            "jaxtile flax, no recognition": build("jaxtile", "flax", mode, recognise=False),
        }
        if mode == "fwd":
            passes = {
                "recognition pass": lambda m: api._recognise(spec, m[None, None]),
                "tile bounds (128x128)": lambda m: spec.tile_bounds(128, 128, dense=m[None, None]),
                "int8 copy": lambda m: m.astype(jnp.int8),
            }
            for name, fn in passes.items():
                builds[name] = functools.partial(timing.compiled_call, fn, (masks["unrecognised"],))
        timings = timing.time_together(builds, 1.0)
        for name, t in timings.items():
            line = f"{mode:7s} {name:40s} " + (
                f"{t.ms:8.3f} ms ({t.ms_lo:.3f}-{t.ms_hi:.3f})" if hasattr(t, "ms") else str(t)
            )
            print(line, flush=True)
            results[f"{mode}/{name}"] = t.ms if hasattr(t, "ms") else str(t)
    # What the dense branch's compiled forward runs around the kernel.
    fn = attend("jaxtile")
    with mock.patch.object(api, "_recognises", lambda *a: False):
        text = jax.jit(fn).lower(q, k, v, masks["unrecognised"]).compile().as_text()
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "dense_forward_hlo.txt"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "dense_breakdown.json"), "w") as f:
        json.dump(dict(git=probe()["git"], device=jax.devices()[0].device_kind, ms=results), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
