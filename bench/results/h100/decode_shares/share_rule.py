"""pallas_decode's share count under two rules for the partial last wave (the fraction of
the SMs that reads at full bandwidth, `decode._SATURATING`: 0.7 against 0.95), on the
decode shapes where they differ (one query, GQA 32:8, head dim 128, bf16, full caches),
three passes interleaved, beside cuDNN."""

import jax
import numpy as np

import jaxtile
from bench.decode import Case, _inputs
from bench.timing import time_jitted
from jaxtile.triton import decode

print(jaxtile.__file__, jax.__version__, jax.devices()[0].device_kind)
t = decode.DEFAULTS[2]
decode._MIN_TILES = 4  # the value when this ran; both rules take it
sms = jax.devices()[0].core_count
wins = []
for kv in (4096, 32768, 131072):
    for batch in (1, 2, 3, 4, 5, 6, 10, 12, 13, 14, 20):
        programs, kv_tiles = batch * 8, kv // t.block_k
        shares = {}
        for rule in (0.7, 0.95):
            decode._SATURATING = rule
            shares[rule] = decode._shares(programs, kv_tiles, sms, paged=False)
        if shares[0.7] == shares[0.95]:
            continue
        q, k, v = _inputs(Case(batch, 1, kv))
        calls = {
            f"s{s}": lambda q, k, v, s=s: jaxtile.flash_attention(q, k, v, tuning=decode.Tuning(t, t, t, num_splits=s))
            for s in shares.values()
        }
        calls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
        ms = {}
        for _pass in range(3):
            for name, f in calls.items():
                ms.setdefault(name, []).append(time_jitted(f, (q, k, v), 0.3).ms * 1e3)
        med = {name: float(np.median(x)) for name, x in ms.items()}
        old, new = med[f"s{shares[0.7]}"], med[f"s{shares[0.95]}"]
        wins.append(old / new)
        print(
            f"b{batch} kv{kv}: 0.7 -> {shares[0.7]} shares {old:.1f} us, 0.95 -> {shares[0.95]} shares {new:.1f} us"
            f" (new/old speed {old / new:.3f}), cudnn {med['cudnn']:.1f} us"
        )
print(f"geomean speed of the 0.95 rule over the 0.7 rule: {np.exp(np.mean(np.log(wins))):.3f} over {len(wins)} shapes")
