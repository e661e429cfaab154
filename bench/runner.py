"""Runs the measurements in worker processes and collects one record per measurement.

JAX and PyTorch never share a process. JAX's implementations of each problem and mode
are timed together, in one worker, against each other in interleaved rounds (so their
ratios are measured in one process); on a GPU a suite that sweeps memory (``stop_at_oom``)
gives each JAX implementation workers of its own instead, its tasks ordered by growing
size, so that the allocator's high-water mark (which JAX cannot reset) reads each task's
peak. The PyTorch backends share one worker, as PyTorch resets its peak statistics. A
worker that runs out of memory exits and the rest of its tasks continue in a fresh one; a
measurement that outlives ``timeout_s`` is killed and recorded as ``"timeout"``; past the
run's deadline the remaining tasks are ``"skipped"``. Every record has the same keys
(`RESULT_FIELDS` after the task's own), so an out-of-memory or failed run is a row with a
status, never a made-up number.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from bench import catalog
from bench.suites import MODES, Problem, Suite

STATUSES = ("ok", "oom", "unsupported", "error", "timeout", "skipped")
RESULT_FIELDS = (
    "status",
    "error",
    "ms",
    "ms_lo",
    "ms_hi",
    "reps",
    "timer",
    "tflops",
    "compile_s",
    "peak_bytes",
    "peak_source",
    "peak_exact",
    "compiled_bytes",
)
_ROOT = Path(__file__).resolve().parents[1]
_STARTUP_S = 120.0  # importing a framework and initialising the device, before the first task
_GRACE_S = 30.0  # a measurement begun before the deadline may run this much past it


@dataclasses.dataclass(frozen=True)
class Task:
    id: int
    suite: str
    impl: str
    mode: str
    problem: Problem
    stop_at_oom: bool

    def record(self) -> dict:
        return dict(
            suite=self.suite,
            impl=self.impl,
            framework=catalog.framework(self.impl),
            mode=self.mode,
            **self.problem.as_dict(),
            flops=self.problem.flops(self.mode),
        )

    def payload(self) -> dict:
        return dict(id=self.id, impl=self.impl, mode=self.mode, problem=self.problem.as_dict())

    def size(self) -> float:
        """Bytes the measurement is expected to hold at its peak (for ordering only)."""
        p = self.problem
        itemsize = 4 if p.dtype == "float32" else 2
        q = p.batch * p.seq_len * p.num_heads * p.head_dim
        kv = p.batch * p.seq_len * p.num_kv_heads * p.head_dim
        arrays = (2 * q + 2 * kv) * (2 if self.mode == "fwdbwd" else 1)  # inputs and outputs
        scores = p.batch * p.num_heads * p.seq_len**2 * 4 if catalog.materialising(self.impl) else 0
        return arrays * itemsize + scores * (2 if self.mode == "fwdbwd" else 1)


def plan(suites: Iterable[Suite], impls: list[str], env: dict) -> tuple[list[Task], dict[int, dict]]:
    """Every (suite, problem, mode, implementation), and the results already known: the
    combinations an implementation does not support here."""
    tasks, known = [], {}
    for suite in suites:
        for problem in suite.problems():
            for mode in suite.modes:
                for impl in impls:
                    task = Task(len(tasks), suite.name, impl, mode, problem, suite.stop_at_oom)
                    tasks.append(task)
                    reason = catalog.unsupported(impl, problem, mode, env)
                    if reason:
                        known[task.id] = dict(status="unsupported", error=reason)
    return tasks, known


def _groups(tasks: list[Task], on_gpu: bool) -> list[tuple[str, list[Task], bool]]:
    """``(worker module, tasks, together)`` in running order: the JAX tasks in one group
    whose worker times each problem and mode's implementations together, except on a GPU
    those of suites that sweep memory, a group per implementation; PyTorch's in one."""
    by_key: dict[str, list[Task]] = {}
    for task in tasks:
        if catalog.framework(task.impl) == "torch":
            key = "torch"
        elif on_gpu and task.stop_at_oom:
            key = task.impl
        else:
            key = "jax"
        by_key.setdefault(key, []).append(task)

    def priority(key: str) -> float:
        return max(catalog.priority(t.impl) for t in by_key[key]) if key == "jax" else catalog.priority(key)

    # On a GPU the fastest first: if the deadline cuts the run short, the slow ones are lost.
    # Smallest first, a problem and mode's tasks by the largest of them, next to each other.
    sizes: dict[tuple, float] = {}
    for task in tasks:
        run = (task.suite, task.problem, task.mode)
        sizes[run] = max(sizes.get(run, 0.0), task.size())
    groups = []
    for key in sorted(by_key, key=lambda k: -priority(k)):
        ordered = sorted(by_key[key], key=lambda t: (sizes[t.suite, t.problem, t.mode], MODES.index(t.mode), t.id))
        module = "bench.torch_worker" if key == "torch" else "bench.jax_worker"
        groups.append((module, ordered, key == "jax"))
    return groups


def worker_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH")) if p)
    # JAX takes memory as it needs it (not 75% up front), up to most of the GPU, so that
    # its out-of-memory limit is comparable with PyTorch's.
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    return env


def probe(log) -> dict:
    """`bench.probe`'s description of this machine."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.probe"],
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


class Runner:
    """Runs tasks in workers; ``on_start(task)`` and ``on_record(task, record)`` see each
    measurement begin and each record arrive."""

    def __init__(
        self,
        env: dict,
        *,
        log,
        budget_s: float,
        timeout_s: float,
        deadline: float,
        seed: int,
        on_record: Callable[[Task, dict], None],
        on_start: Callable[[Task], None] = lambda task: None,
    ):
        self.env = env
        self.log = log
        self.budget_s = budget_s
        self.timeout_s = timeout_s
        self.deadline = deadline
        self.seed = seed
        self.on_record = on_record
        self.on_start = on_start
        self.records: dict[int, dict] = {}

    def run(self, tasks: list[Task], known: dict[int, dict]) -> list[dict]:
        """One record per task, in the order of ``tasks``."""
        for task in tasks:
            if task.id in known:
                self._record(task, known[task.id])
        todo = [t for t in tasks if t.id not in known]
        for module, group, together in _groups(todo, catalog.on_gpu(self.env)):
            self.run_group(module, group, together)
        return [self.records[t.id] for t in tasks]

    def run_group(self, module: str, tasks: list[Task], together: bool = False) -> None:
        """Runs ``tasks`` in order in workers ``python -m module``, a fresh one after each
        out-of-memory error, crash or time-out; with ``together``, each problem and mode's
        tasks timed against each other (`bench._worker.serve`)."""
        pending = tasks
        while pending:
            if time.time() > self.deadline:
                for task in pending:
                    self._record(task, dict(status="skipped", error="the run's time limit passed"))
                return
            pending = self._worker(module, pending, together)

    def _record(self, task: Task, result: dict) -> None:
        record = task.record()
        record.update({field: result.get(field) for field in RESULT_FIELDS})
        if record["status"] == "ok" and record["ms"]:
            record["tflops"] = record["flops"] / (record["ms"] * 1e-3) / 1e12
        self.records[task.id] = record
        self.on_record(task, record)

    def _skip_longer(self, failed: Task, pending: dict[int, Task]) -> None:
        """After an OOM in a stop-at-OOM sweep: the same implementation's longer lengths."""
        for task in list(pending.values()):
            same = dataclasses.replace(task.problem, seq_len=failed.problem.seq_len, batch=failed.problem.batch)
            longer = task.problem.seq_len > failed.problem.seq_len
            if longer and (task.suite, task.impl, task.mode, same) == (
                failed.suite,
                failed.impl,
                failed.mode,
                failed.problem,
            ):
                del pending[task.id]
                self._record(task, dict(status="skipped", error=f"out of memory at seq_len={failed.problem.seq_len}"))

    def _worker(self, module: str, tasks: list[Task], together: bool) -> list[Task]:
        """Runs ``tasks`` in one worker process; returns those it did not finish."""
        pending = {t.id: t for t in tasks}
        request = dict(
            tasks=[t.payload() for t in tasks],
            deadline=self.deadline,
            budget_s=self.budget_s,
            seed=self.seed,
            together=together,
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", module],
            env=worker_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        try:
            proc.stdin.write(json.dumps(request))
            proc.stdin.close()
        except BrokenPipeError:  # it died on start-up; its exit is handled below
            pass
        current, wait = None, _STARTUP_S + self.timeout_s
        while pending:
            limit = min(wait, self.deadline + _GRACE_S - time.time())
            try:
                line = lines.get(timeout=max(limit, 1.0))
            except queue.Empty:
                proc.kill()
                proc.wait()
                if current is None:  # stuck before its first task
                    current = next(iter(pending.values()))
                error = f"no result within {wait:.0f} s" if limit == wait else "still running at the run's time limit"
                self._record(current, dict(status="timeout", error=error + "; worker killed"))
                del pending[current.id]
                return list(pending.values())
            if line is None:  # the worker exited
                code = proc.wait()
                if current is not None and current.id in pending:
                    error = f"worker exited with code {code} during this measurement (see bench.log)"
                    self._record(current, dict(status="error", error=error))
                    del pending[current.id]
                elif current is None and len(pending) == len(tasks):  # it never started: do not retry forever
                    for task in pending.values():
                        self._record(
                            task, dict(status="error", error=f"worker exited with code {code} (see bench.log)")
                        )
                    return []
                return list(pending.values())
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                self.log.write(f"[bench] unexpected worker output: {line}")
                continue
            wait = self.timeout_s
            task = pending.get(event.get("id"))
            if task is None:
                continue
            if event["event"] == "start":
                current = task
                self.on_start(task)
                continue
            del pending[task.id]
            current = None
            self._record(task, event)
            if event["status"] == "oom" and task.stop_at_oom:
                self._skip_longer(task, pending)
        proc.wait()
        return []


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def deadline_after(minutes: float | None) -> float:
    return time.time() + (minutes * 60 if minutes else math.inf)
