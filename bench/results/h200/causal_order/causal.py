"""Whether the rows whose mask bounds positions (causal, windows) would gain from
persistent programs taking whole heads' query tiles in a round (`_ring.Schedule`'s
``queries_first``), as the non-causal rows do. Each jaxtile variant patches `v3` while
its call is traced and compiled; jax's caches are cleared before each call; two passes,
beside cuDNN and tokamax::

    PYTHONPATH=. python causal.py

* ``tile``: one program per query tile (`v3._persistent` says no);
* ``persistent``: persistent programs in rounds, heads fastest (`v3._persistent` says
  yes, `v3._queries_first` no);
* ``persistent.q_first``: persistent programs in rounds of whole heads' query tiles
  (both say yes, so `Schedule.balanced` takes ``queries_first``).
"""

import contextlib
import json

import jax

from bench import check
from bench.probe import git_state
from jaxtile.mosaic import v3

SHAPES = (
    check.Shape("d128_16k_causal", 1, 16384, 16, 128, causal=True),
    check.Shape("d128_4k_causal", 4, 4096, 16, 128, causal=True),
    check.Shape("d64_16k_causal", 1, 16384, 32, 64, causal=True),
    check.Shape("gqa_32_8_causal_8k", 2, 8192, 32, 128, kv_heads=8, causal=True),
    check.Shape("window_1023_causal_16k", 1, 16384, 16, 128, causal=True, window=(1023, 0)),
)

VARIANTS = {
    "tile": {"_persistent": lambda spec, rows: False},
    "persistent": {"_persistent": lambda spec, rows: True, "_queries_first": lambda spec, rows: False},
    "persistent.q_first": {"_persistent": lambda spec, rows: True, "_queries_first": lambda spec, rows: True},
}


@contextlib.contextmanager
def _patched(patches: dict):
    kept = {name: getattr(v3, name) for name in patches}
    for name, value in patches.items():
        setattr(v3, name, value)
    try:
        yield
    finally:
        for name, value in kept.items():
            setattr(v3, name, value)


def main():
    print(json.dumps(git_state()), jax.__version__, jax.devices()[0].device_kind, flush=True)
    for shape in SHAPES:
        ms = {label: [] for label in (*VARIANTS, "cudnn", "tokamax")}
        peers = {"cudnn": check._cudnn(shape), "tokamax": check._tokamax(shape)}
        for _pass in range(2):
            for label, patches in VARIANTS.items():
                jax.clear_caches()
                with _patched(patches):
                    ms[label].append(check._timed(check._jaxtile(shape), shape, "fwd", 0.5).get("ms"))
            for label, attend in peers.items():
                if attend is not None:
                    jax.clear_caches()
                    ms[label].append(check._timed(attend, shape, "fwd", 0.5).get("ms"))
        best = {label: min((t for t in runs if t), default=None) for label, runs in ms.items()}
        tile = best["tile"]
        print(
            f"{shape.name:24s} "
            + " | ".join(
                f"{label} {t:.3f} ({tile / t:.3f})" if t and tile else f"{label} -" for label, t in best.items()
            )
            + f"   {ms}",
            flush=True,
        )


if __name__ == "__main__":
    main()
