"""Persistent programs on the long rows that run one program per query tile by default
(`v3._persistent`: only query tiles over at most 2048 keys), now that the persistent
forward loads the next tile's queries under the last step of the one before (729309a).
In one process, three rounds of: mosaic_v3's default tiling, the same tiling persistent,
cuDNN; forward only. Prints the ``jaxtile`` imported and each row's median per variant.
Usage: PYTHONPATH=. python persistent_long.py"""

import dataclasses
import statistics

import jax

import jaxtile
from bench import check
from jaxtile.mosaic import v3

ROWS = ("d64_4k_full", "d64_16k_full", "d128_4k_full", "d128_16k_full", "d128_16k_causal", "gqa_32_8_causal_8k")


def main():
    print(jaxtile.__file__, jax.__version__, jax.devices()[0].device_kind, flush=True)
    for name in ROWS:
        shape = next(s for s in check.SHAPES if s.name == name)
        (q, k, v), _, _ = check._inputs(shape, "fwd")
        tuning = dataclasses.replace(v3.default_tuning(shape.head_dim, shape.head_dim, 2), persistent=True)
        variants = {
            "default": check._jaxtile(shape),
            "persistent": lambda q, k, v, causal=shape.causal, tuning=tuning: jaxtile.flash_attention(
                q, k, v, causal=causal, implementation="mosaic_v3", tuning=tuning
            ),
            "cudnn": check._cudnn(shape),
        }
        calls = {}
        for label, attend in variants.items():
            compiled = jax.jit(lambda q, k, v, attend=attend: attend(q, k, v)).lower(q, k, v).compile()
            calls[label] = lambda c=compiled, a=(q, k, v): c(*a)
        times = {label: [] for label in calls}
        for _ in range(3):
            for label, call in calls.items():
                times[label].append(check._worker.time_batches(call, jax.block_until_ready, 0.5).ms)
        median = {label: statistics.median(t) for label, t in times.items()}
        print(
            f"{name:20} default {median['default']:.4f} ms  persistent {median['persistent']:.4f} ms "
            f"({median['default'] / median['persistent']:.3f}x)  cudnn {median['cudnn']:.4f} ms  "
            f"tuning {tuning}  runs {times}",
            flush=True,
        )


if __name__ == "__main__":
    main()
