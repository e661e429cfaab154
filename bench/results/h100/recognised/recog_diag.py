"""Where the recognised Flax mask's forward loses time (d64_4k_dense_causal: 0.94 ms
against 0.70 for the causal call): the recognition alone (and as it was up to 139eda0), a
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
from bench import check
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


def recognition_before(q, k, v, mask, index):  # MaskSpec.recognise up to 139eda0: three passes
    q_idx = jnp.arange(spec.q_len, dtype=jnp.int32)[:, None]
    kv_idx = jnp.arange(spec.kv_len, dtype=jnp.int32)[None, :]
    seen = jnp.broadcast_to(spec.visible(q_idx, kv_idx, dense=mask[None, None]), (1, 1, spec.q_len, spec.kv_len))

    def extent(used):
        n = used.shape[-1]
        return jnp.where(jnp.any(used, axis=-1), n - jnp.argmax(used[:, ::-1], axis=-1), 0).astype(jnp.int32)

    q_length, kv_length = extent(jnp.any(seen, axis=(1, 3))), extent(jnp.any(seen, axis=(1, 2)))
    lengths = (q_length[:, None, None, None], kv_length[:, None, None, None])
    same = jnp.all(seen == spec.recognised().visible(q_idx, kv_idx, lengths=lengths))
    return jnp.stack([q_length, kv_length], axis=-1), same


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
    recognition_before=recognition_before,
    switch_given=switch_given,
    switch_recognised=switch_recognised,
    cudnn=cudnn,
)
ms = {}
for _pass in range(2):
    for name, fn in VARIANTS.items():
        jax.clear_caches()
        ms.setdefault(name, []).append(check.time_jitted(fn, [q, k, v, mask, index], 0.5).ms)
        print(name, ms[name][-1], flush=True)
for name, values in ms.items():
    print(
        f"{name:18s} "
        + " ".join(f"{x:.4f}" for x in values)
        + f"  ms; cuDNN / this {min(ms['cudnn']) / min(values):.3f}"
    )
hlo = jax.jit(recognised).lower(q, k, v, mask, index).compile().as_text()
print("conditionals in the compiled recognised call:", hlo.count(" conditional("), "copies:", hlo.count(" copy("))
for name in ("recognition", "recognition_before"):
    hlo = jax.jit(VARIANTS[name]).lower(q, k, v, mask, index).compile().as_text()
    print(f"{name}: {hlo.count('kind=kInput')} reduction fusions, {hlo.count('kind=kLoop')} loop fusions")
