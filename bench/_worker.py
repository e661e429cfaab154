"""What both workers share: the task loop, error classes and the batch timer.

A worker reads ``{"tasks": [...], "deadline": ..., "budget_s": ..., "seed": ...}`` as JSON
on stdin and writes one JSON line per event on the stdout it started with: ``{"event":
"start", "id": ...}`` before a measurement and ``{"event": "result", "id": ..., ...}``
after it; a request with ``"together": true`` has each run of consecutive tasks of one
mode and problem measured together (each started in turn, then all timed against each
other, then their results). Everything else the process prints (the frameworks' own
logging included) goes to stderr, which the runner keeps in ``bench.log``. After an
out-of-memory error the worker exits, so that the runner continues in a fresh process
with clean allocator statistics.

This module imports neither JAX nor PyTorch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Hashable

_OOM_TEXT = ("resource_exhausted", "out of memory", "outofmemory")
_UNSUPPORTED_TEXT = ("no available kernel", "not supported", "unsupported", "notimplemented")


def classify(exc: BaseException) -> str:
    """``"oom"``, ``"unsupported"`` or ``"error"`` for an exception from a measurement."""
    text = f"{type(exc).__name__}: {exc}".lower()
    if isinstance(exc, MemoryError) or any(t in text for t in _OOM_TEXT):
        return "oom"
    if isinstance(exc, NotImplementedError) or any(t in text for t in _UNSUPPORTED_TEXT):
        return "unsupported"
    return "error"


def failure(exc: BaseException) -> dict:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    message = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return {"status": classify(exc), "error": message[:400]}


@dataclasses.dataclass(frozen=True)
class Timing:
    """Milliseconds per call: the median and the spread (``ms_lo``..``ms_hi``) of the
    timed samples; ``reps`` calls were timed in all (None where the timer hides it)."""

    ms: float
    ms_lo: float
    ms_hi: float
    reps: int | None
    timer: str


def time_batches(
    call: Callable[[], object], sync: Callable[[object], object], budget_s: float, *, warm: int = 2
) -> Timing:
    """Times ``call`` in batches: ``warm`` warm-up calls each followed by ``sync``, then
    calls for a fifth of ``budget_s`` (at most 0.1 s) ending in one ``sync``, then up to
    five batches of up to 20 calls, each batch ending in one ``sync``.

    The last warm-up call estimates the cost of a call, which sizes the batches so that
    the timed calls take about ``budget_s``. The second warm-up keeps the device busy
    before timing: a GPU left idle while the next function compiled ran its first
    calls slower. Time-boxed: a call slower than half the budget is timed once more,
    and the last warm-up call is the second sample.
    """
    estimate = 0.0
    for _ in range(warm):
        start = time.perf_counter()
        sync(call())
        estimate = time.perf_counter() - start
    slow = 2 * estimate > budget_s
    if not slow:
        out = None
        for _ in range(int(min(0.1, budget_s / 5) / max(estimate, 1e-6))):
            out = None
            out = call()
        sync(out)
    calls = min(20, max(1, int(budget_s / (5 * max(estimate, 1e-6)))))
    batches = 1 if slow else min(5, max(2, int(budget_s / (calls * estimate))))
    samples = [estimate * 1e3] if slow else []
    for _ in range(batches):
        out = None
        start = time.perf_counter()
        for _ in range(calls):
            out = None  # drop the previous result before the next call allocates its own
            out = call()
        sync(out)
        samples.append((time.perf_counter() - start) / calls * 1e3)
    timer = "last warm-up call and 1 call" if slow else f"{batches} batches of {calls} calls"
    return Timing(statistics.median(samples), min(samples), max(samples), len(samples) * calls, timer)


def time_rounds(
    calls: dict[Hashable, Callable[[], object]], sync: Callable[[object], object], budget_s: float, *, rounds: int = 10
) -> dict[Hashable, Timing]:
    """Times ``calls`` against each other, interleaved: after two warm-up calls of each
    (each followed by ``sync``; the second estimates its cost), up to ``rounds`` rounds
    (at least 3; fewer where the slowest call would take more than ``budget_s`` in all)
    each time one batch of every call in turn, ending in one ``sync``. A call's batches
    hold up to 20 calls, sized so that together they take about ``budget_s``.

    Whatever drifts while a process runs (clocks, temperature, the host) then falls on
    every call alike, where timed one call after another it lands between them (the
    ratios of identical decode kernels to cuDNN moved 3-5% between runs on an H200,
    `bench/NOTES.md`)."""
    estimates = {}
    for name, call in calls.items():
        for _ in range(2):
            start = time.perf_counter()
            sync(call())
            estimates[name] = max(time.perf_counter() - start, 1e-6)
    rounds = max(3, min(rounds, int(budget_s / max(estimates.values(), default=1.0))))
    sizes = {name: max(1, min(20, int(budget_s / (rounds * estimate)))) for name, estimate in estimates.items()}
    samples = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            out = None
            start = time.perf_counter()
            for _ in range(sizes[name]):
                out = None  # drop the previous result before the next call allocates its own
                out = call()
            sync(out)
            samples[name].append((time.perf_counter() - start) / sizes[name] * 1e3)
    others = len(calls) - 1
    return {
        name: Timing(
            statistics.median(ms),
            min(ms),
            max(ms),
            rounds * sizes[name],
            f"{rounds} rounds of {sizes[name]} calls, interleaved with {others} other call{'s' * (others != 1)}",
        )
        for name, ms in samples.items()
    }


def _runs(request: dict) -> list[list[dict]]:
    """The request's tasks one by one or, where it says ``"together"``, in runs of
    consecutive tasks of one mode and problem."""
    runs: list[list[dict]] = []
    for task in request["tasks"]:
        last = runs[-1][0] if runs else None
        if request.get("together") and last and (last["mode"], last["problem"]) == (task["mode"], task["problem"]):
            runs[-1].append(task)
        else:
            runs.append([task])
    return runs


def serve(
    measure: Callable[[dict, dict], dict],
    together: Callable[[list[dict], dict, Callable[[dict], None]], dict] | None = None,
) -> None:
    """Runs ``measure(task, request)`` on each task from stdin or, where the request says
    ``"together"``, ``together(tasks, request, started)`` on each run of tasks of one mode
    and problem (`_runs`), which calls ``started(task)`` as it begins each one and returns
    ``{id: result}``; see the module doc."""
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    request = json.load(sys.stdin)
    if request.get("together") and together is None:
        raise ValueError("the request asks for runs measured together, which this worker cannot do")

    def emit(event: dict) -> None:
        protocol.write(json.dumps(event) + "\n")

    def started(task: dict) -> None:
        emit({"event": "start", "id": task["id"]})
        print(f"[bench] {task['impl']} {task['mode']} {task['problem']}", file=sys.stderr, flush=True)

    for run in _runs(request):
        if time.time() > request["deadline"]:
            for task in run:
                emit({"event": "result", "id": task["id"], "status": "skipped", "error": "the run's time limit passed"})
            continue
        try:
            if request.get("together"):
                results = together(run, request, started)
            else:
                started(run[0])
                results = {run[0]["id"]: measure(run[0], request)}
        except Exception as exc:  # in timing, where every task of the run shares the failure
            results = {task["id"]: failure(exc) for task in run}
        for task in run:
            emit({"event": "result", "id": task["id"], **results[task["id"]]})
        if any(result["status"] == "oom" for result in results.values()):
            return
