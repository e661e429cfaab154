"""JAX calls timed on this process's device: each compiled once and called once (so
that a call that cannot run raises before it is timed), then timed alone
(`_worker.time_batches`) or against each other in interleaved rounds
(`_worker.time_rounds`), ``jax.block_until_ready`` ending each batch.

The perf check (`bench.check`), the decode benchmark (`bench.decode`), the tuner
(`bench.tune`) and the record scripts under ``bench/results/`` time through these."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Hashable, Sequence

import jax

from bench import _worker


def compiled_call(fn: Callable, args: Sequence) -> Callable[[], object]:
    """``jax.jit(fn)(*args)`` as a call of no arguments: compiled once (Triton's
    deprecation warning filtered) and called once, so that a call that cannot run raises
    here, not while it is timed."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Triton.*", category=DeprecationWarning)
        compiled = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    return functools.partial(compiled, *args)


def time_jitted(fn: Callable, args: Sequence, budget_s: float) -> _worker.Timing:
    """``jax.jit(fn)(*args)``, compiled once, timed after warm-up (`_worker.time_batches`)."""
    return _worker.time_batches(compiled_call(fn, args), jax.block_until_ready, budget_s)


def time_together(builds: dict[Hashable, Callable[[], Callable[[], object]]], budget_s: float) -> dict:
    """Each of ``builds`` (``{key: build}``, ``build()`` giving its `compiled_call`) built,
    then those that built timed against each other in interleaved rounds
    (`_worker.time_rounds`): ``{key: Timing}``, or for a build that raised (compiling or
    in its first call) `_worker.failure` of it, in the order of ``builds``."""
    calls, results = {}, {}
    for key, build in builds.items():
        try:
            calls[key] = build()
        except Exception as exc:  # recorded in the row
            results[key] = _worker.failure(exc)
    results.update(_worker.time_rounds(calls, jax.block_until_ready, budget_s))
    return {key: results[key] for key in builds}
