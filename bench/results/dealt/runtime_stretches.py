"""The runtime order of persistent programs (`_ring.tile_order`: heaviest first over the
whole grid, taken in snaking rounds) against sorting within stretches of place order, as
`_ring.Schedule.dealt` does on the host: the busiest program's key tiles, counted as
`Schedule.busiest` counts them (a tile's key tiles plus one), for mosaic_v3's forward
with lengths. A model on the CPU, no GPU::

    PYTHONPATH=. python bench/results/dealt/runtime_stretches.py

* ``global``: `tile_order`'s (the default);
* ``round``: heaviest first within stretches of one round's places (whole units);
* ``sequence``: heaviest first within stretches of one sequence's units (or as many
  sequences as one round holds), `Schedule.dealt`'s rule.
"""

import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from bench.probe import git_state
from jaxtile.mask import MaskSpec
from jaxtile.mosaic import _ring, v3

PROGRAMS = 132  # an H100's multiprocessors

# persistent_lengths.py's cases and lengths, and two more of whole sequences.
sys.path.insert(0, str(Path(__file__).parents[1] / "h200" / "lengths"))
from persistent_lengths import CASES, lengths_cases  # noqa: E402

CASES = (*CASES, ("full_16x1k_d64", 16, 1024, 32, 64, True, False), ("full_4x4k_d128", 4, 4096, 16, 128, True, False))


def _busiest(order: np.ndarray, steps: np.ndarray, repeat: int) -> float:
    """The most work of a program taking the places of ``order`` (each unit ``repeat``
    heads) in snaking rounds, as `Schedule(snake=True, ordered=True)` does."""
    work = np.repeat(steps[order], repeat) + 1
    programs = min(PROGRAMS, work.size)
    rounds, column = np.divmod(np.arange(work.size), programs)
    program = np.where(rounds % 2 == 1, programs - 1 - column, column)
    return np.bincount(program, work, programs).max()


def main():
    print(json.dumps(git_state()), flush=True)
    for shape, lengths in lengths_cases(CASES):
        spec = MaskSpec.create(shape.seq, shape.seq, causal=shape.causal, has_lengths=True)
        tuning = v3.default_tuning(shape.head_dim, shape.head_dim, 2, spec)
        rows = 2 * tuning.block_q
        bounds = spec.tile_bounds(rows, tuning.block_k, lengths=jnp.stack([lengths, lengths], -1))
        q_tiles, repeat = bounds.shape[-2], shape.heads // bounds.shape[1]
        order = np.asarray(_ring.tile_order(spec, bounds, shape.batch, rows, tuning.block_k))
        spans = spec.kv_spans(jnp.arange(q_tiles), rows, tuning.block_k, tuple(bounds[..., i] for i in range(4)))
        steps = np.broadcast_to(np.asarray(spans[-1].stop - spans[0].start), bounds.shape[:-1]).ravel()
        even = (np.repeat(steps, repeat) + 1).sum() / min(PROGRAMS, steps.size * repeat)
        stretches = {
            "global": order,
            "round": np.lexsort((-steps, np.arange(steps.size) // max(1, PROGRAMS // repeat))),
            "sequence": np.lexsort(
                (-steps, np.arange(steps.size) // (max(1, PROGRAMS // (repeat * q_tiles)) * q_tiles))
            ),
        }
        cells = " ".join(f"{label}={_busiest(o, steps, repeat):.0f}" for label, o in stretches.items())
        print(f"{shape.name:28s} lengths {np.asarray(lengths).tolist()}\n{'':28s} even={even:.0f} {cells}", flush=True)


if __name__ == "__main__":
    main()
