"""Ragged single-query decode with each number of split-KV shares, against jaxtile's
default and cuDNN, the variants in turn over several passes in one process: whether
finer shares even out caches of uneven length (``kv_lengths`` uniform in
``[kv/2, kv]``, as `bench.decode`'s ragged layout).

    PYTHONPATH=. python bench/results/h200/decode_prelude/ragged_shares.py
"""

import functools

import jax
import jax.numpy as jnp
from prelude_cost import in_turn  # this folder's: the variants timed in turn

import jaxtile
from bench import decode as bd
from jaxtile.triton import decode

CASES = (bd.Case(64, 1, 4096), bd.Case(8, 1, 32768), bd.Case(1, 1, 131072))
SHARES = {
    bd.Case(64, 1, 4096): (1, 2, 3, 4),
    bd.Case(8, 1, 32768): (1, 2, 3, 4, 6),
    bd.Case(1, 1, 131072): (8, 16, 24, 32),
}


def _shared(q, k, v, kv_lengths, *, shares):
    t = decode.DEFAULTS[2]
    tuning = decode.Tuning(t, t, t, num_splits=shares)
    return jaxtile.flash_attention(q, k, v, kv_lengths=kv_lengths, implementation="pallas_decode", tuning=tuning)


def _default(q, k, v, kv_lengths):
    return jaxtile.flash_attention(q, k, v, kv_lengths=kv_lengths)


def main():
    print("jaxtile from", jaxtile.__file__, "on", jax.devices()[0].device_kind, "jax", jax.__version__)
    for case in CASES:
        q, k, v = bd._inputs(case)
        variants = {"default": _default, "cudnn": bd._cudnn}
        variants |= {f"shares={s}": functools.partial(_shared, shares=s) for s in SHARES[case]}
        args = [q, k, v, jnp.asarray(bd._kv_lengths(case))]
        in_turn(f"{case.name} ragged", {name: (fn, args) for name, fn in variants.items()})


if __name__ == "__main__":
    main()
