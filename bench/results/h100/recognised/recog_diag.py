"""Where the recognised Flax mask's forward loses time (d64_4k_dense_causal: 0.94 ms
against 0.70 for the causal call): the recognition alone, a
run-time switch between two copies of the causal call, and the whole recognised call,
beside the causal call and cuDNN, in one process (each timed twice, jax's caches cleared
between variants)."""

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

import jaxtile
from bench import check, timing
from jaxtile import api
from jaxtile.mask import MaskSpec

stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
print(jaxtile.__file__, stamp.get("commit"), jax.__version__, jax.devices()[0].device_kind, os.environ.get("XLA_FLAGS"))

shape = next(s for s in check.SHAPES if s.name == "d64_4k_dense_causal")
(q, k, v), mask, _ = check._inputs(shape, "fwd")
spec = MaskSpec(shape.seq, shape.seq, has_dense_mask=True)
index = jnp.int32(0)


def causal(q, k, v, mask, index):
    return jaxtile.flash_attention(q, k, v, causal=True)


def recognised(q, k, v, mask, index):
    return jaxtile.flash_attention(q, k, v, mask=mask)


def recognition(q, k, v, mask, index):
    return api._recognise(spec, mask[None, None])


def switch_given(q, k, v, mask, index):  # a switch on an argument: the conditional alone
    call = lambda: jaxtile.flash_attention(q, k, v, causal=True)  # noqa: E731
    return lax.switch(index, [call, call])


def switch_recognised(q, k, v, mask, index):  # a switch on the recognition's branch
    call = lambda: jaxtile.flash_attention(q, k, v, causal=True)  # noqa: E731
    _, branch = api._recognise(spec, mask[None, None])
    return lax.switch(jnp.minimum(branch, 1), [call, call])


def cudnn(q, k, v, mask, index):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


VARIANTS = dict(
    causal=causal,
    recognised=recognised,
    recognition=recognition,
    switch_given=switch_given,
    switch_recognised=switch_recognised,
    cudnn=cudnn,
)
ms = {}
for _pass in range(2):
    for name, fn in VARIANTS.items():
        jax.clear_caches()
        ms.setdefault(name, []).append(timing.time_jitted(fn, [q, k, v, mask, index], 0.5).ms)
        print(name, ms[name][-1], flush=True)
for name, values in ms.items():
    print(
        f"{name:18s} "
        + " ".join(f"{x:.4f}" for x in values)
        + f"  ms; cuDNN / this {min(ms['cudnn']) / min(values):.3f}"
    )
hlo = jax.jit(recognised).lower(q, k, v, mask, index).compile().as_text()
print("conditionals in the compiled recognised call:", hlo.count(" conditional("), "copies:", hlo.count(" copy("))
hlo = jax.jit(recognition).lower(q, k, v, mask, index).compile().as_text()
print(f"recognition: {hlo.count('kind=kInput')} reduction fusions, {hlo.count('kind=kLoop')} loop fusions")
