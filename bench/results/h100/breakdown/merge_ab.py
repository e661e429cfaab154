"""What the split-KV merge costs a decode step: pallas_decode with its merge, without it
(the first share's partial result, wrong but timed), and with the merge written as one
pass of sums over the shares; jax's caches cleared between variants."""

import re
import types

import jax
import jax.numpy as jnp

import jaxtile
from bench.decode import Case, _inputs
from bench.timing import time_jitted
from jaxtile import _softmax as sm
from jaxtile.triton import decode


def _sums(out, lse):
    peak = jnp.max(lse, axis=0)
    base = jnp.where(peak == -jnp.inf, 0.0, peak)
    weight = jnp.exp(lse - base)
    num = jnp.sum(out.astype(jnp.float32) * jnp.swapaxes(weight, -1, -2)[..., None], axis=0)
    total = jnp.sum(weight, axis=0)
    empty = total == 0.0
    safe = jnp.where(empty, 1.0, total)
    return num / jnp.swapaxes(safe, -1, -2)[..., None], jnp.where(empty, -jnp.inf, base + jnp.log(safe))


VARIANTS = {
    "merge": sm,
    "no_merge": types.SimpleNamespace(merge=lambda out, lse: (out[0], lse[0])),
    "sums": types.SimpleNamespace(merge=_sums),
}
print(jaxtile.__file__, jax.__version__, jax.devices()[0].device_kind)
for case in (Case(1, 1, 131072), Case(8, 1, 32768), Case(8, 16, 32768)):
    q, k, v = _inputs(case)
    lengths = jnp.full((case.batch,), case.kv_len * 3 // 4, jnp.int32)
    for _rep in range(2):
        for name, module in VARIANTS.items():
            decode.sm = module
            jax.clear_caches()
            f = lambda q, k, v, n: jaxtile.flash_attention(q, k, v, kv_lengths=n)  # noqa: E731
            entry = jax.jit(f).lower(q, k, v, lengths).compile().as_text().split("ENTRY")[1]
            fusions = len(re.findall(r"= \S+ fusion\(", entry))
            ms = [time_jitted(f, (q, k, v, n), 1.0).ms for n in (None, lengths)]
            print(f"{case.name} {name:9s} fusions={fusions} full {ms[0] * 1e3:.1f} us, ragged {ms[1] * 1e3:.1f} us")
    decode.sm = sm
    jax.clear_caches()
    c = lambda q, k, v, n: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=n, implementation="cudnn")  # noqa: E731
    ms = [time_jitted(c, (q, k, v, n), 1.0).ms for n in (None, lengths)]
    print(f"{case.name} cudnn     full {ms[0] * 1e3:.1f} us, ragged {ms[1] * 1e3:.1f} us")
