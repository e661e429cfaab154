"""Persistent programs dealt their tiles on the host as they free (`_ring.Schedule.dealt`)
against the rounds `Schedule.balanced` took before dealing existed, on the perf check's
causal rows, beside cuDNN and tokamax: the calls of a row timed together in
interleaved rounds (`bench.timing.time_together`), two passes. Each jaxtile variant
patches `_ring.Schedule` while its call is traced and compiled, jax's caches cleared
first; the line names the schedule each took (programs, dealt or not, and the busiest
program's key tiles as `Schedule.busiest` counts them)::

    PYTHONPATH=. python bench/results/dealt/variants.py

* ``rounds``: `Schedule.balanced` among rounds alone (dealing never wins);
* ``dealt``: every persistent schedule dealt to as many programs as multiprocessors;
* ``heaviest``: dealt likewise, the tiles taken heaviest first over the whole grid
  (longest processing time first: the most even shares, but a round's programs read the
  K and V of more heads than in place order);
* ``place``: dealt likewise in place order, as `Schedule.dealt` did up to d978c17 (since
  then it deals them heaviest first within stretches of one round's heads, which
  ``dealt`` times).

Rows other than `ROWS` may be named on the command line::

    PYTHONPATH=. python bench/results/dealt/variants.py d64_4k_causal gqa_32_8_causal_8k
"""

import contextlib
import json
import math
import sys

import jax
import numpy as np

from bench import check
from bench.probe import git_state
from bench.timing import time_together
from jaxtile.mosaic import _ring, v3

ROWS = (
    "d128_16k_causal",
    "d64_16k_causal",
    "gqa_32_8_causal_8k",
    "sinks_gqa_64_8_causal_8k",
    "d128_1k_causal",
    "d64_1k_causal",
    "d64_4k_causal",
    "d128_4k_causal",
    "mqa_16_1_causal_8k",
)

_balanced = _ring.Schedule.balanced.__func__


def _rounds_only(cls, tiles, work, most, queries_first=False, dealing=0.0):
    dealt = cls.dealt
    cls.dealt = classmethod(lambda cls, tiles, work, programs, queries_first=False: cls(tiles, programs))
    try:
        return _balanced(cls, tiles, work, most, queries_first)
    finally:
        cls.dealt = dealt


def _always_dealt(cls, tiles, work, most, queries_first=False, dealing=0.0):
    return cls.dealt(tiles, work, min(most, math.prod(tiles)), queries_first)


def _dealt_in(order):
    """A `Schedule.balanced` that deals every persistent schedule to as many programs as
    multiprocessors, the places taken in ``order(work at each place)``."""

    def balanced(cls, tiles, work, most, queries_first=False, dealing=0.0):
        programs = min(most, math.prod(tiles))
        at_place = cls(tiles, programs, queries_first=queries_first)._work(work)
        return cls._deal(tiles, at_place, programs, queries_first, order(at_place))

    return balanced


VARIANTS = {
    "rounds": _rounds_only,
    "dealt": _always_dealt,
    "place": _dealt_in(lambda at_place: np.arange(at_place.size)),
    "heaviest": _dealt_in(lambda at_place: np.argsort(-at_place, kind="stable")),
}


@contextlib.contextmanager
def _variant(balanced, taken: list):
    """`Schedule.balanced` replaced by ``balanced`` and `v3._schedule` recording what it
    takes in ``taken``."""
    schedule = v3._schedule

    def recording(spec, tuning, tiles, rows, bounds):
        chosen, operands = schedule(spec, tuning, tiles, rows, bounds)
        work = v3._key_tiles(spec, tiles[1], rows, tuning.block_k)
        taken.append(f"{chosen.programs} {'dealt' if chosen.plan else 'rounds'} {chosen.busiest(work):.0f}")
        return chosen, operands

    _ring.Schedule.balanced, v3._schedule = classmethod(balanced), recording
    try:
        yield
    finally:
        _ring.Schedule.balanced, v3._schedule = classmethod(_balanced), schedule


def _build(shape, label, inputs, taken):
    def build():
        jax.clear_caches()
        with _variant(VARIANTS[label], taken):
            return check._runnable(check._jaxtile(shape), "fwd", inputs)

    return build


def main():
    print(json.dumps(git_state()), jax.__version__, jax.devices()[0].device_kind, flush=True)
    shapes = {shape.name: shape for shape in check.SHAPES}
    results = {}
    for name in sys.argv[1:] or ROWS:
        shape = shapes[name]
        inputs = check._inputs(shape, "fwd")
        taken = {label: [] for label in VARIANTS}
        builds = {label: _build(shape, label, inputs, taken[label]) for label in VARIANTS}
        builds.update(cudnn=check._cudnn(shape), tokamax=check._tokamax(shape))
        calls = {}
        for label, build in builds.items():  # compiled once, timed in both passes
            try:
                calls[label] = build() if label in VARIANTS else check._runnable(build, "fwd", inputs)
            except Exception as exc:  # the row goes on without it
                print(f"{name} {label}: {type(exc).__name__}: {exc}", flush=True)
        passes = []
        for i in range(2):
            timings = time_together({label: lambda call=call: call for label, call in calls.items()}, 0.5)
            ms = {label: getattr(t, "ms", None) for label, t in timings.items()}
            passes.append(ms)
            cells = " ".join(f"{label}={t:.4f}" if t else f"{label}=err" for label, t in ms.items())
            print(
                f"{name:26s} pass {i} {cells}  schedules {dict((k, v[-1]) for k, v in taken.items() if v)}", flush=True
            )
        results[name] = dict(passes=passes, schedules={k: v[-1] for k, v in taken.items() if v})
    print(json.dumps(dict(git=git_state(), device=jax.devices()[0].device_kind, rows=results)))


if __name__ == "__main__":
    main()
