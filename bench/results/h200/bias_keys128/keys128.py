"""Whether 128-key tiles pay for a bias at head dim 128 (mosaic_v3's forward), now that
the forward writes its lse from registers (no tile of shared memory): Mosaic GPU counts
231544 bytes for them, under its 232448, but `jaxtile.mosaic._ring.SHARED_MEMORY`'s
4 KiB margin still refuses them, so here the margin is dropped for one variant. The
check's bias row, forward and forward+backward, beside cuDNN and tokamax; one process,
two passes, jax's caches cleared between variants."""

import contextlib
import json
from pathlib import Path

import jax

import jaxtile
from bench import check
from jaxtile.mosaic import v3

SHAPE = next(s for s in check.SHAPES if s.name == "bias_d128_causal_8k")


@contextlib.contextmanager
def _no_margin():
    kept = v3.SHARED_MEMORY
    v3.SHARED_MEMORY = 232448
    try:
        yield
    finally:
        v3.SHARED_MEMORY = kept


def call(tuning=None, margin=True):
    def attend(q, k, v, bias=None, mask=None):
        with contextlib.nullcontext() if margin else _no_margin():
            return jaxtile.flash_attention(q, k, v, bias=bias, causal=True, implementation="mosaic_v3", tuning=tuning)

    return attend


def main():
    stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
    print(jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind)
    for mode in check.MODES:
        variants = {
            "default": call(),
            "keys128": call(v3.Tuning(block_k=128), margin=False),
            "keys64x3": call(v3.Tuning(block_k=64, num_stages=3)),
            "cudnn": check._cudnn(SHAPE),
            "tokamax": check._tokamax(SHAPE),
        }
        ms = check.timed_passes({k: f for k, f in variants.items() if f is not None}, SHAPE, mode)
        for label, runs in ms.items():
            print(
                f"{SHAPE.name:22s} {mode:6s} {label:10s} {','.join(f'{x:.4f}' if x else 'err' for x in runs)}",
                flush=True,
            )


if __name__ == "__main__":
    main()
