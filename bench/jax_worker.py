"""Times JAX attention: jaxtile's implementations, ``jax.nn.dot_product_attention`` (XLA
and cuDNN), JAX's bundled Pallas-Triton ``mha`` and tokamax's Mosaic GPU kernel. Run by
`bench.runner` as ``python -m bench.jax_worker`` (protocol in `bench._worker`).

Each task compiles its function once (``jit(f).lower(...).compile()``, timed as the
compile time) and calls it once for memory. The runner asks for the implementations of
each problem and mode together (`measure_together`): on the same inputs, timed against
each other in interleaved rounds (`bench._worker.time_rounds`), so that their ratios come
from one process. A task alone in its process (`measure`) is timed in batches
(`bench._worker.time_batches`).

Memory: where a task has the process to itself on a GPU (the runner's memory sweeps), the
allocator's ``peak_bytes_in_use`` after the first call, inputs and outputs included. JAX
cannot reset that high-water mark, so the runner gives each such worker one
implementation and orders its tasks by growing size; a task that does not raise the mark
gets ``peak_exact=False`` (its peak is at most the number given). Otherwise it is the
compiled program's footprint: arguments + outputs + temporaries - aliased bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp

import jaxtile
from bench import _worker
from bench.suites import Problem


def _memory_stats() -> dict | None:
    try:
        return jax.devices()[0].memory_stats()
    except Exception:  # backends without allocator statistics
        return None


@functools.cache
def _baseline() -> int:
    """Bytes in use before the first measurement (the runtime's own buffers)."""
    return (_memory_stats() or {}).get("bytes_in_use", 0)


def _pallas_mha():
    with warnings.catch_warnings():
        # Deprecated (with the rest of Pallas' Triton lowering) since jax 0.11; expected here.
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu.attention import mha
    return mha


def attention(impl: str, p: Problem):
    """``attend(q, k, v) -> out`` with q ``[batch, seq, heads, head_dim]`` for ``impl``."""
    if impl in jaxtile.registry.names():
        return functools.partial(jaxtile.flash_attention, causal=p.causal, window=p.window, implementation=impl)
    window = None
    if p.window is not None:  # both sides as ints: None (unbounded) is the whole sequence
        window = tuple(p.seq_len if side is None else side for side in p.window)
    if impl in ("jax.xla", "jax.cudnn"):
        return functools.partial(
            jax.nn.dot_product_attention, is_causal=p.causal, local_window_size=window, implementation=impl[4:]
        )
    if impl == "tokamax.mosaic":
        import tokamax

        return functools.partial(
            tokamax.dot_product_attention, is_causal=p.causal, local_window_size=window, implementation="mosaic"
        )
    if impl == "pallas.mha":
        return functools.partial(_pallas_mha(), segment_ids=None, causal=p.causal, sm_scale=p.head_dim**-0.5)
    raise ValueError(f"unknown JAX implementation {impl!r}")


def _forward_backward(attend):
    """``(q, k, v, dout) -> (out, dq, dk, dv)``."""

    def step(q, k, v, dout):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(dout))

    return step


def inputs(p: Problem, mode: str, seed: int) -> tuple[jax.Array, ...]:
    """Standard normal q, k, v (and dout for forward+backward), drawn on the device."""
    keys = jax.random.split(jax.random.key(seed), 4)
    q_shape = (p.batch, p.seq_len, p.num_heads, p.head_dim)
    kv_shape = (p.batch, p.seq_len, p.num_kv_heads, p.head_dim)
    shapes = [q_shape, kv_shape, kv_shape] + ([q_shape] if mode == "fwdbwd" else [])
    return tuple(jax.random.normal(key, shape, jnp.dtype(p.dtype)) for key, shape in zip(keys, shapes))


def _footprint(compiled) -> int | None:
    """Arguments + outputs + temporaries - aliased bytes of a compiled program."""
    try:
        m = compiled.memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)
    except Exception:  # no memory analysis on this backend
        return None


def _prepared(task: dict, args: tuple, own_process: bool) -> tuple[Callable[[], object], dict]:
    """``task``'s function compiled for ``args`` and called once: the call (of no
    arguments) and its compile time and memory. Memory is the allocator's high-water mark
    on a GPU where the task has the process to itself (``own_process``), and the compiled
    program's footprint otherwise."""
    baseline = _baseline()
    stats = _memory_stats() if own_process else None
    mark = stats["peak_bytes_in_use"] if stats else None
    attend = attention(task["impl"], Problem.from_dict(task["problem"]))
    fn = attend if task["mode"] == "fwd" else _forward_backward(attend)
    with warnings.catch_warnings():
        # jax >= 0.11 deprecates lowering Pallas kernels through Triton; expected here.
        warnings.filterwarnings("ignore", message=".*Triton.*", category=DeprecationWarning)
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        compile_s = time.perf_counter() - start
    footprint = _footprint(compiled)
    jax.block_until_ready(compiled(*args))
    stats = _memory_stats() if own_process else None
    if stats:
        peak = dict(peak_bytes=stats["peak_bytes_in_use"] - baseline, peak_source="device")
        peak["peak_exact"] = stats["peak_bytes_in_use"] > mark
    else:
        peak = dict(peak_bytes=footprint, peak_source="compiled" if footprint is not None else None, peak_exact=True)
    return functools.partial(compiled, *args), dict(compile_s=compile_s, compiled_bytes=footprint, **peak)


def _args(task: dict, request: dict) -> tuple[jax.Array, ...]:
    return inputs(Problem.from_dict(task["problem"]), task["mode"], request["seed"])


def measure(task: dict, request: dict) -> dict:
    """One task in a process of its own: compiled, called once for memory, then timed in
    batches (`_worker.time_batches`)."""
    call, fields = _prepared(task, _args(task, request), own_process=True)
    timing = _worker.time_batches(call, jax.block_until_ready, request["budget_s"], warm=1)
    return dict(status="ok", **fields, **dataclasses.asdict(timing))


def measure_together(tasks: list[dict], request: dict, started: Callable[[dict], None]) -> dict:
    """The tasks of one problem and mode (one implementation each) on the same inputs:
    each compiled and called once, then those that ran timed against each other in
    interleaved rounds (`_worker.time_rounds`); ``{id: result}``, a task that raised
    compiling or in its first call recorded as its `_worker.failure`."""
    args = _args(tasks[0], request)
    calls, fields, results = {}, {}, {}
    for task in tasks:
        started(task)
        try:
            calls[task["id"]], fields[task["id"]] = _prepared(task, args, own_process=False)
        except Exception as exc:  # recorded in its row; the others are still timed
            results[task["id"]] = _worker.failure(exc)
    for key, timing in _worker.time_rounds(calls, jax.block_until_ready, request["budget_s"]).items():
        results[key] = dict(status="ok", **fields[key], **dataclasses.asdict(timing))
    return results


if __name__ == "__main__":
    _worker.serve(measure, measure_together)
