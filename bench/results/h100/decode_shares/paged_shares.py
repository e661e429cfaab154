"""pallas_decode's share count on short paged caches under the old and new floors of key
tiles per share (`decode._MIN_TILES` 4 and 8), one query, GQA 32:8, head dim 128, bf16,
pages of 16 in random order, full caches; three passes interleaved, beside the same
call on the contiguous cache and cuDNN."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxtile
from bench.decode import Case, _inputs, _page_table, _to_pages
from bench.timing import time_jitted
from jaxtile.triton import decode

print(jaxtile.__file__, jax.__version__, jax.devices()[0].device_kind)
t = decode.DEFAULTS[2]
sms = jax.devices()[0].core_count
for kv in (2048, 4096, 8192):
    for batch in (1, 2, 4, 8, 16):
        shares = {}
        for floor in (4, 8):
            decode._MIN_TILES = floor
            shares[floor] = decode._shares(batch * 8, kv // t.block_k, sms, paged=True)
        decode._MIN_TILES = 8
        if shares[4] == shares[8]:
            continue
        case = Case(batch, 1, kv)
        q, k, v = _inputs(case)
        table = _page_table(case, 16)
        k_pages, v_pages, table = _to_pages(k, table), _to_pages(v, table), jnp.asarray(table)
        lengths = jnp.full((batch,), kv, jnp.int32)
        calls = {
            f"paged s{s}": (
                lambda q, kp, vp, tb, n, s=s: jaxtile.paged_attention(
                    q, kp, vp, tb, n, tuning=decode.Tuning(t, t, t, num_splits=s)
                ),
                (q, k_pages, v_pages, table, lengths),
            )
            for s in shares.values()
        }
        calls["contiguous"] = (lambda q, k, v: jaxtile.flash_attention(q, k, v), (q, k, v))
        calls["cudnn"] = (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"), (q, k, v))
        ms = {}
        for _pass in range(3):
            for name, (f, args) in calls.items():
                ms.setdefault(name, []).append(time_jitted(f, args, 0.3).ms * 1e3)
        med = {name: float(np.median(x)) for name, x in ms.items()}
        print(
            f"b{batch} kv{kv}: floor 4 -> {shares[4]} shares {med[f'paged s{shares[4]}']:.1f} us, "
            f"floor 8 -> {shares[8]} shares {med[f'paged s{shares[8]}']:.1f} us, "
            f"contiguous {med['contiguous']:.1f} us, cudnn {med['cudnn']:.1f} us"
        )
