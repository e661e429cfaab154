"""mosaic_v3's forward tilings on the check's window rows, beside tokamax and cuDNN in
one process, two passes (A B ... A B ...)."""

import itertools

import jax

import jaxtile
from bench import check
from jaxtile.mosaic import v3

print(jaxtile.__file__, jax.__version__, jax.devices()[0].device_kind)
SHAPES = {s.name: s for s in check.SHAPES}
for name in ("window_256_256_16k", "window_1023_causal_16k"):
    shape = SHAPES[name]
    variants = {"default": None}
    for bk, stages, persistent in itertools.product((64, 128), (2, 3, 4), (False, True)):
        variants[f"bk{bk}_s{stages}_{'p' if persistent else 'g'}"] = v3.Tuning(
            block_k=bk, num_stages=stages, persistent=persistent
        )
    peers = {"tokamax": check._tokamax(shape), "cudnn": check._cudnn(shape)}
    results = {}
    for _pass in range(2):
        for label, tuning in variants.items():
            options = dict(causal=shape.causal, window=shape.window, implementation="mosaic_v3", tuning=tuning)

            def attend(q, k, v, bias=None, mask=None, options=options):
                return jaxtile.flash_attention(q, k, v, **options)

            row = check._timed(attend, shape, "fwd", 0.5)
            results.setdefault(label, []).append(row.get("ms", float("nan")))
        for label, attend in peers.items():
            if attend is not None:
                results.setdefault(label, []).append(check._timed(attend, shape, "fwd", 0.5).get("ms", float("nan")))
    best = min(min(v) for v in results.values())
    for label, ms in sorted(results.items(), key=lambda kv: min(kv[1])):
        print(f"{name} {label:14s} " + " ".join(f"{m:.4f}" for m in ms) + f"  best/this {best / min(ms):.3f}")
