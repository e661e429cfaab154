"""Why a persistent mosaic_v3 forward's step costs more than a one-program-per-tile one's
at long rows (`costs.py`): four variants timed at 4096 and 8192 keys (the queries of
`costs.py`), the slope between them being the cost of a step. Each variant patches
jaxtile while its call is traced and compiled; jax's caches are cleared before each
call; two passes::

    PYTHONPATH=. python persistent.py OUT.json [LABEL...]

* ``tile``: one program per tile (the default at these lengths);
* ``tile.own_output``: the same with the output in a tile of shared memory of its own,
  as persistent programs have it (`v3.Tuning.own_output`): 32 KiB more shared memory,
  and so less L1;
* ``persistent``: 132 programs in rounds (`v3._schedule`);
* ``persistent.128``: 128 programs, 16 tiles each, no partial round;
* ``persistent.snake``: 132 programs, every other round backwards;
* ``persistent.q_fastest``: 132 programs in rounds, the query tiles fastest in the order
  (a round takes ~4 heads' 32 tiles, which share their K and V, rather than 8 tiles of
  every head), as tokamax's persistent programs take them (``nd_loop`` over (heads,
  query tiles)).

Labels after ``OUT.json`` time those variants only (tokamax's persistent kernel always).
"""

import contextlib
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from costs import BATCH, BLOCK_K, HEAD_DIM, HEADS, Q_LEN, _tokamax
from jax import lax

import jaxtile
from bench import timing
from jaxtile.mosaic import _ring, v3

KV_LENS = (4096, 8192)


@contextlib.contextmanager
def _patched(target, name, value):
    kept = target.__dict__[name]
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, kept)


def _snaking(cls, tiles, work, most):
    return cls(tiles, min(most, math.prod(tiles)), snake=True)


def _q_fastest(self, i, order=None):
    heads, q_tiles, _ = (jnp.int32(n) for n in self.tiles)
    linear = self._linear(i)
    return lax.rem(lax.div(linear, q_tiles), heads), lax.rem(linear, q_tiles), lax.div(linear, heads * q_tiles)


VARIANTS = {
    "tile": (False, None),
    "tile.own_output": (False, (v3.Tuning, "own_output", lambda self, head_dim, head_dim_v: True)),
    "persistent": (True, None),
    "persistent.128": (True, (_ring, "multiprocessors", lambda: 128)),
    "persistent.snake": (True, (_ring.Schedule, "balanced", classmethod(_snaking))),
    "persistent.q_fastest": (True, (_ring.Schedule, "index", _q_fastest)),
}


def main():
    stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
    print(jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind)
    variants = {label: VARIANTS[label] for label in sys.argv[2:]} or VARIANTS
    ms = {label: {kv: [] for kv in KV_LENS} for label in (*variants, "tokamax.persistent")}
    tokamax = _tokamax(True)
    for _pass in range(2):
        for kv_len in KV_LENS:
            keys = jax.random.split(jax.random.key(kv_len), 3)
            q = jax.random.normal(keys[0], (BATCH, Q_LEN, HEADS, HEAD_DIM), jnp.bfloat16)
            k, v = (jax.random.normal(key, (BATCH, kv_len, HEADS, HEAD_DIM), jnp.bfloat16) for key in keys[1:])
            for label, (persistent, patch) in variants.items():
                tuning = v3.Tuning(persistent=persistent)

                def attend(q, k, v, tuning=tuning):
                    return jaxtile.flash_attention(q, k, v, implementation="mosaic_v3", tuning=tuning)

                jax.clear_caches()
                with _patched(*patch) if patch else contextlib.nullcontext():
                    ms[label][kv_len].append(timing.time_jitted(attend, [q, k, v], 0.5).ms)
                print(f"{label:20s} kv {kv_len:5d} {ms[label][kv_len]}", flush=True)
            if tokamax is not None:
                jax.clear_caches()
                ms["tokamax.persistent"][kv_len].append(timing.time_jitted(tokamax, [q, k, v], 0.5).ms)
    print("\nlabel                µs per step   ms at kv " + " ".join(f"{kv:>7d}" for kv in KV_LENS))
    for label, runs in ms.items():
        if all(runs.values()):
            times = [min(runs[kv]) for kv in KV_LENS]
            slope = (times[1] - times[0]) / ((KV_LENS[1] - KV_LENS[0]) // BLOCK_K)
            print(f"{label:20s} {slope * 1e3:11.2f}   " + " ".join(f"{t:7.3f}" for t in times) + f"   {runs}")
    Path(sys.argv[1]).write_text(
        json.dumps(dict(stamp=stamp, ms={k: {str(kv): t for kv, t in r.items()} for k, r in ms.items()}))
    )


if __name__ == "__main__":
    main()
