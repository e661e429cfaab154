"""``python -m bench.stress``: stress and soak jaxtile's Pallas kernels on a GPU.

Three phases, bounded together by ``--max-seconds``; each gets its share of the time
left, in this order:

1. **Soak** (45%): forward+backward of pallas_v2 at batch 4, 4096 tokens, 16 heads of 128,
   causal bf16, ``--repeats`` times (1000); every repetition must equal the first one
   bitwise, and the device memory in use after the loop must equal that before it
   (within `LEAK_TOLERANCE_BYTES`). Running out of time before the last repetition fails.
2. **Sweep** (40%, split evenly between the sweeps): causal bf16 attention at batch 1,
   8 heads of 128, the sequence length doubling from 2K up to 8K (forward) and 4K
   (forward+backward) for pallas_v1, which runs one program per (batch, head) by design,
   and from 64K for pallas_v2, until out of memory, out of time (the next length would
   take about 4× the last), or the cap. Each length records compile and run times, peak
   device memory and checks: every result finite, and the first and last 16 query rows
   of the forward output equal the materialised reference computed on those rows alone
   (the bf16 tolerances of `parity.compare`). The batch-1 forward must reach 256K tokens.
3. **Memory limit** (the rest): the forward pass at 4096 tokens with the batch doubling
   until out of memory: the most tokens that fit on the device.

"Out of memory" is JAX's allocator's limit: 75% of the device unless
``XLA_PYTHON_CLIENT_MEM_FRACTION`` says otherwise. Device memory is read from
``jax.devices()[0].memory_stats()`` (``peak_bytes_in_use`` is the process's high-water
mark, so it is exact only for the largest shape so far); backends without allocator
statistics (the CPU) record None and skip the leak check.

Writes one JSON file (``--out``): the device, every step's shape, status, times, memory
and checks, the soak's outcome, and ``passed``. Exit status 0 iff passed.

``--quick`` runs every phase in miniature on whatever device there is (on a CPU, the
kernels run in interpret mode): tiny shapes, three soak repetitions. Example::

    python -m bench.stress --out bench/results/stress.json
    python -m bench.stress --quick --out /tmp/stress.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxtile
from bench._worker import classify
from bench.probe import git_state
from parity.compare import TOLERANCES, compare

CHECK_ROWS = 16
LEAK_TOLERANCE_BYTES = 1 << 20  # the allocator's own bookkeeping; any per-call leak is far larger


@dataclasses.dataclass(frozen=True)
class Shape:
    """``[batch, seq_len, num_heads, head_dim]`` causal attention (no GQA)."""

    batch: int
    seq_len: int
    num_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    def grown(self, dimension: str) -> Shape:
        return dataclasses.replace(self, **{dimension: 2 * getattr(self, dimension)})


@dataclasses.dataclass(frozen=True)
class Sweep:
    """Doubles ``grow`` (``"seq_len"`` or ``"batch"``) of ``start`` up to ``limit`` (or
    until out of memory or time)."""

    implementation: str
    mode: str  # "fwd" or "fwdbwd"
    start: Shape
    grow: str = "seq_len"
    limit: int | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
    sweeps: tuple[Sweep, ...]
    soak: Shape
    memory_limit: Sweep
    repeats: int
    min_tokens: int  # the batch-1 forward length the sweep must reach
    memory_every: int  # soak repetitions between memory readings


FULL = Plan(
    sweeps=(
        Sweep("pallas_v1", "fwd", Shape(1, 2048, 8, 128), limit=8192),
        Sweep("pallas_v1", "fwdbwd", Shape(1, 2048, 8, 128), limit=4096),
        Sweep("pallas_v2", "fwdbwd", Shape(1, 65536, 8, 128)),
        Sweep("pallas_v2", "fwd", Shape(1, 65536, 8, 128)),
    ),
    soak=Shape(4, 4096, 16, 128),
    memory_limit=Sweep("pallas_v2", "fwd", Shape(16, 4096, 8, 128), grow="batch"),
    repeats=1000,
    min_tokens=262144,
    memory_every=100,
)
QUICK = Plan(
    sweeps=(
        Sweep("pallas_v1", "fwd", Shape(1, 32, 2, 16), limit=32),
        Sweep("pallas_v2", "fwd", Shape(1, 32, 2, 16), limit=64),
        Sweep("pallas_v2", "fwdbwd", Shape(1, 32, 2, 16), limit=32),
    ),
    soak=Shape(1, 32, 2, 16),
    memory_limit=Sweep("pallas_v2", "fwd", Shape(1, 32, 2, 16), grow="batch", limit=2),
    repeats=3,
    min_tokens=64,
    memory_every=1,
)
# Shares of --max-seconds, in the order the phases run: the soak's fixed amount of work
# first, then the sweeps (each stops when out of time), then the memory limit.
PHASE_SHARES = {"soak": 0.45, "sweep": 0.40, "memory_limit": 0.15}
SLOW_CALL_S = 1.0  # calls slower than this are timed once


def _memory() -> dict | None:
    """The allocator's statistics (None on backends without them, e.g. the CPU)."""
    try:
        return jax.devices()[0].memory_stats()
    except Exception:  # a backend without allocator statistics
        return None


def _bytes_in_use() -> int | None:
    stats = _memory()
    return None if stats is None else int(stats["bytes_in_use"])


def _inputs(shape: Shape, mode: str, seed: int = 0) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(seed), 4)
    dims = (shape.batch, shape.seq_len, shape.num_heads, shape.head_dim)
    count = 4 if mode == "fwdbwd" else 3
    return tuple(jax.random.normal(key, dims, jnp.dtype(shape.dtype)) for key in keys[:count])


def _attend(implementation: str):
    return functools.partial(jaxtile.flash_attention, causal=True, implementation=implementation)


def _program(implementation: str, mode: str):
    """``(q, k, v) -> out`` or ``(q, k, v, dout) -> (out, dq, dk, dv)``."""
    attend = _attend(implementation)
    if mode == "fwd":
        return attend

    def forward_backward(q, k, v, dout):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(dout))

    return forward_backward


@jax.jit
def _all_finite(values) -> jax.Array:
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(values)]))


def _row_error(out: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array) -> float:
    """Worst of `parity.compare`'s relative errors, over the first and last `CHECK_ROWS`
    query rows, against the reference run on those rows alone (bottom-right causal
    alignment makes the last rows see every key and the first rows only the first keys)."""
    rows = min(CHECK_ROWS, q.shape[1])
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    reference = _attend("reference")
    checks = (
        (out[:, :rows], reference(q[:, :rows], k[:, :rows], v[:, :rows])),
        (out[:, -rows:], reference(q[:, -rows:], k, v)),
    )
    worst = 0.0
    tol = TOLERANCES[str(out.dtype)]
    for got, expected in checks:
        error = compare(np.asarray(got.astype(jnp.float32)), np.asarray(expected), tol)
        worst = max(worst, error.rel_l2 / tol.rel_l2, error.max_err / tol.max_err)
    return worst


def _measure(sweep: Sweep, shape: Shape, repeats: int) -> dict:
    """Compiles and runs one step of a sweep; raises on failure (out of memory included)."""
    args = _inputs(shape, sweep.mode)
    start = time.perf_counter()
    compiled = jax.jit(_program(sweep.implementation, sweep.mode)).lower(*args).compile()
    compile_s = time.perf_counter() - start
    seconds = []
    while len(seconds) < repeats and sum(seconds) < SLOW_CALL_S:
        start = time.perf_counter()
        result = jax.block_until_ready(compiled(*args))
        seconds.append(time.perf_counter() - start)
    stats = _memory()
    step = dict(
        status="ok",
        compile_s=compile_s,
        ms=1e3 * float(np.median(seconds)),
        peak_bytes_in_use=None if stats is None else int(stats["peak_bytes_in_use"]),
        finite=bool(_all_finite(result)),
    )
    if sweep.mode == "fwd":
        step["row_error_over_tolerance"] = _row_error(result, *args[:3])
    step["passed"] = step["finite"] and step.get("row_error_over_tolerance", 0.0) <= 1.0
    return step


def run_sweep(sweep: Sweep, deadline: float, repeats: int) -> dict:
    """Doubles the shape until out of memory, out of time, or past the limit."""
    steps, shape, stopped, last_s = [], sweep.start, "limit", 0.0
    growth = 4.0 if sweep.grow == "seq_len" else 2.0  # causal FLOPs are quadratic in seq_len
    while sweep.limit is None or getattr(shape, sweep.grow) <= sweep.limit:
        if time.monotonic() + growth * last_s > deadline:
            stopped = "time"
            break
        started = time.monotonic()
        record = dict(dataclasses.asdict(shape), tokens=shape.tokens)
        try:
            record |= _measure(sweep, shape, repeats)
        except Exception as error:  # out of memory ends the sweep; anything else fails it
            status = classify(error)
            record |= dict(status=status, error=f"{type(error).__name__}: {str(error)[:300]}", passed=status == "oom")
        gc.collect()
        record["bytes_in_use_after"] = _bytes_in_use()
        last_s = time.monotonic() - started
        record["wall_s"] = last_s
        steps.append(record)
        print(f"  {sweep.implementation} {sweep.mode} {shape}: {record['status']} ({last_s:.1f} s)", file=sys.stderr)
        if record["status"] != "ok":
            stopped = record["status"]
            break
        shape = shape.grown(sweep.grow)
    largest = max((s["tokens"] for s in steps if s["status"] == "ok"), default=0)
    return dict(dataclasses.asdict(sweep), steps=steps, stopped=stopped, largest_ok_tokens=largest)


@jax.jit
def _differs(a, b) -> jax.Array:
    """1 if any leaf of ``a`` differs bitwise from ``b``'s, else 0 (int32)."""

    def bits(x):
        return jax.lax.bitcast_convert_type(x, jnp.uint16 if x.dtype.itemsize == 2 else jnp.uint32)

    same = [jnp.array_equal(bits(x), bits(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
    return jnp.int32(1) - jnp.all(jnp.stack(same)).astype(jnp.int32)


def run_soak(shape: Shape, repeats: int, deadline: float, memory_every: int) -> dict:
    """Forward+backward of pallas_v2 ``repeats`` times: bitwise equal to the first run,
    and the device memory in use back to its level before the loop."""
    args = _inputs(shape, "fwdbwd", seed=1)
    step = jax.jit(_program("pallas_v2", "fwdbwd"))
    first = jax.block_until_ready(step(*args))
    jax.block_until_ready(_differs(step(*args), first))  # compile the comparison too
    gc.collect()
    before = _bytes_in_use()
    mismatches, trace, done, start = 0, [], 0, time.perf_counter()
    for done in range(1, repeats + 1):
        mismatches += int(_differs(step(*args), first))  # int(): one repetition in flight at a time
        if done % memory_every == 0:
            trace.append(dict(repetition=done, bytes_in_use=_bytes_in_use()))
        if time.monotonic() > deadline:
            break
    gc.collect()
    after = _bytes_in_use()
    leak = None if before is None else after - before
    record = dict(
        dataclasses.asdict(shape),
        implementation="pallas_v2",
        repeats=repeats,
        repeats_done=done,
        completed=done == repeats,
        seconds=time.perf_counter() - start,
        mismatches=mismatches,
        bytes_in_use_before=before,
        bytes_in_use_after=after,
        leaked_bytes=leak,
        memory_trace=trace,
        finite=bool(_all_finite(first)),
    )
    leak_ok = leak is None or abs(leak) <= LEAK_TOLERANCE_BYTES
    record["passed"] = record["completed"] and mismatches == 0 and leak_ok and record["finite"]
    return record


def _failures(report: dict, plan: Plan) -> list[str]:
    failures = []
    for sweep in (*report["sweeps"], report["memory_limit"]):
        for step in sweep["steps"]:
            if not step["passed"]:
                failures.append(f"{sweep['implementation']} {sweep['mode']} at {step['tokens']} tokens: {step}")
    batch1_fwd = [s["largest_ok_tokens"] for s in report["sweeps"] if s["mode"] == "fwd" and s["start"]["batch"] == 1]
    if max(batch1_fwd, default=0) < plan.min_tokens:
        failures.append(f"the batch-1 forward sweep stopped below {plan.min_tokens} tokens")
    if not report["soak"]["passed"]:
        soak = {k: v for k, v in report["soak"].items() if k != "memory_trace"}
        failures.append(f"soak: {soak}")
    return failures


def run(plan: Plan, max_seconds: float, quick: bool) -> dict:
    """All three phases; returns the report (see the module docstring)."""
    started = time.monotonic()
    end = started + max_seconds

    def deadline(phase: str) -> float:
        """This phase's share of the time left, the later phases' shares kept for them."""
        phases = list(PHASE_SHARES)
        later = sum(PHASE_SHARES[p] for p in phases[phases.index(phase) :])
        now = time.monotonic()
        return now + max(end - now, 0.0) * PHASE_SHARES[phase] / later

    soak = run_soak(plan.soak, plan.repeats, deadline("soak"), plan.memory_every)
    sweep_end, sweeps = deadline("sweep"), []
    for left, sweep in zip(range(len(plan.sweeps), 0, -1), plan.sweeps):
        # An equal share of the phase's time left: capped sweeps leave theirs to later ones.
        sweep_deadline = time.monotonic() + max(sweep_end - time.monotonic(), 0.0) / left
        sweeps.append(run_sweep(sweep, sweep_deadline, 1 if quick else 3))
    memory_limit = run_sweep(plan.memory_limit, deadline("memory_limit"), 1)
    device = jax.devices()[0]
    report = dict(
        quick=quick,
        device=f"{device.platform}: {device.device_kind}",
        jax=jax.__version__,
        git=git_state(),
        started=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        max_seconds=max_seconds,
        sweeps=sweeps,
        soak=soak,
        memory_limit=memory_limit,
    )
    report["failures"] = _failures(report, plan)
    report["passed"] = not report["failures"]
    report["wall_s"] = time.monotonic() - started
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.stress", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="where to write the JSON report")
    p.add_argument("--quick", action="store_true", help="tiny shapes on any device (interpret mode on a CPU)")
    p.add_argument("--max-seconds", type=float, default=240.0, help="wall-time bound of the whole run")
    p.add_argument("--repeats", type=int, help="soak repetitions (default 1000; 3 with --quick)")
    args = p.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.repeats is not None:
        plan = dataclasses.replace(plan, repeats=args.repeats)
    report = run(plan, args.max_seconds, args.quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str))
    verdict = "passed" if report["passed"] else "FAILED:\n  " + "\n  ".join(report["failures"])
    print(f"stress {verdict} in {report['wall_s']:.0f} s; report in {args.out}", file=sys.stderr)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
