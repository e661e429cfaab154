"""What the XLA op before a ragged decode call costs (the lengths' clip and stack into
``[batch, 2]``): in one process, in turn, jaxtile's call with ``kv_lengths`` as
`bench.decode` times it ("call"), the same compiled attention given the stacked lengths
as an argument, so that nothing runs before its kernel ("stacked"), and cuDNN.

    PYTHONPATH=. python bench/results/h200/decode_prelude/prelude_cost.py
"""

import statistics

import jax
import jax.numpy as jnp

import jaxtile
from bench import decode as bd
from bench.timing import time_jitted
from jaxtile import api

CASES = (bd.Case(64, 1, 4096), bd.Case(8, 1, 32768), bd.Case(1, 1, 131072))
PASSES = 6


def _call(q, k, v, kv_lengths):
    return jaxtile.flash_attention(q, k, v, kv_lengths=kv_lengths)


def _stacked(attention, config):
    """The compiled attention of a prepared call, given its `Inputs` (lengths stacked)."""
    return lambda inputs: attention(inputs, config)[0]


def in_turn(title: str, variants: dict) -> None:
    """Times each of ``variants`` (``{name: (fn, args)}``, cuDNN's named "cudnn") in turn,
    `PASSES` times, and prints each one's median, the passes' range and cuDNN's ratio."""
    ms = {name: [] for name in variants}
    for _ in range(PASSES):
        for name, (fn, args) in variants.items():
            ms[name].append(time_jitted(fn, args, 0.5).ms)
    median = {name: statistics.median(times) for name, times in ms.items()}
    print(f"== {title}")
    for name, times in ms.items():
        spread = f"{min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}"
        ratio = median["cudnn"] / median[name]
        print(f"  {name:9s} {median[name] * 1e3:7.1f} us (passes {spread})  cuDNN / this {ratio:.3f}")


def main():
    print("jaxtile from", jaxtile.__file__, "on", jax.devices()[0].device_kind, "jax", jax.__version__)
    for case in CASES:
        q, k, v = bd._inputs(case)
        lengths = jnp.asarray(bd._kv_lengths(case))
        options = dict(causal=False, window=None, segment_ids=None, mask=None, bias=None, logits_soft_cap=None)
        chosen, inputs, config, _ = api.prepare(
            q,
            k,
            v,
            implementation=None,
            return_lse=False,
            block_q=None,
            block_k=None,
            q_lengths=None,
            kv_lengths=lengths,
            scale=None,
            tuning=None,
            **options,
        )
        attention = api.compiled(chosen)
        variants = {
            "call": (_call, [q, k, v, lengths]),
            "stacked": (_stacked(attention, config), [inputs]),
            "cudnn": (bd._cudnn, [q, k, v, lengths]),
        }
        in_turn(f"{case.name} ragged, {chosen.name}", variants)


if __name__ == "__main__":
    main()
