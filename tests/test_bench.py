"""The benchmark suite: FLOP counts, the plan of what runs where, OOM handling, and one
tiny run of ``python -m bench`` end to end (JSON schema, table, plots, report)."""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import __main__ as cli
from bench import _worker, catalog, report, runner
from bench.suites import MEMORY, MODES, STANDARD, Problem

ROOT = Path(__file__).resolve().parents[1]
GPU_ENV = dict(
    platform="gpu",
    device="NVIDIA H100",
    nvidia=True,
    jaxtile=["scan_v2", "pallas_v1"],
    pallas_mha=None,
    torch={"version": "2.11.0", "cuda": True},
)


def _problem(**changes) -> Problem:
    base = dict(
        batch=2, seq_len=256, num_heads=4, num_kv_heads=4, head_dim=64, causal=False, window=None, dtype="bfloat16"
    )
    return Problem(**{**base, **changes})


@pytest.mark.parametrize(
    "seq_len, causal, window",
    [(64, False, (7, 3)), (64, True, (15, None)), (96, False, (0, 0)), (50, False, (None, 5)), (33, True, (100, None))],
)
def test_window_flops_count_exactly_the_visible_pairs(seq_len, causal, window):
    p = _problem(seq_len=seq_len, causal=causal, window=window)
    rows = np.arange(seq_len)[:, None]
    visible = int(p.mask().visible(rows, rows.T).sum())
    assert p.visible_pairs() == visible
    assert p.flops("fwd") == 4 * p.batch * p.num_heads * p.head_dim * visible


def test_flops_follow_the_flashattention_convention():
    p = _problem(num_kv_heads=1)  # GQA: the query heads count
    full = 4 * 2 * 256 * 256 * 4 * 64
    assert p.flops("fwd") == full
    assert p.flops("fwdbwd") == 3.5 * full
    assert _problem(causal=True).flops("fwd") == full / 2


def test_presets_match_the_issue():
    standard = STANDARD.problems()
    assert {(p.head_dim, p.num_heads) for p in standard} == {(64, 32), (128, 16)}
    assert {p.batch * p.seq_len for p in standard} == {16384}
    assert {p.seq_len for p in standard} == {1024, 4096, 16384}
    assert {p.causal for p in standard} == {False, True}
    assert {p.dtype for p in standard} == {"bfloat16"}
    assert STANDARD.modes == MODES
    memory = MEMORY.problems()
    assert [p.seq_len for p in memory] == [512, 1024, 2048, 4096, 8192, 16384]
    assert {(p.batch, p.num_heads, p.head_dim) for p in memory} == {(4, 12, 64)}
    assert MEMORY.modes == ("fwdbwd",) and MEMORY.stop_at_oom


def test_command_line_replaces_preset_values():
    memory = cli.suites(cli.parser().parse_args(["--preset", "memory", "--max-seq-len", "4096", "--dtype", "fp16"]))
    assert [s.name for s in memory] == ["memory"]
    assert memory[0].seq_lens == (512, 1024, 2048, 4096) and memory[0].dtype == "float16"
    (standard,) = cli.suites(cli.parser().parse_args(["--preset", "--head-dim", "128", "--causal", "--mode", "fwd"]))
    assert {(p.num_heads, p.causal) for p in standard.problems()} == {(16, True)}
    assert standard.modes == ("fwd",)
    (window,) = cli.suites(cli.parser().parse_args(["--window", "128", "--causal", "--non-causal"]))
    assert {p.window for p in window.problems()} == {(127, 0), (64, 64)}  # FlashTile's window_size


def test_plan_records_what_cannot_run_here():
    gqa = _problem(num_kv_heads=2, seq_len=1000)
    # jaxtile's own implementations answer from their records.
    wide = _problem(head_dim=512)
    assert catalog.unsupported("pallas_v1", wide, "fwd", GPU_ENV).startswith("pallas_v1 supports head dims up to 256")
    assert catalog.unsupported("scan_v2", wide, "fwd", GPU_ENV) is None
    assert (
        catalog.unsupported("pallas_v1", gqa, "fwd", dict(GPU_ENV, platform="tpu")) == "pallas_v1 does not run on tpu"
    )
    assert catalog.unsupported("scan_v2", gqa, "fwd", GPU_ENV) is None
    assert "grouped-query" in catalog.unsupported("pallas.mha", gqa, "fwd", GPU_ENV)
    assert "multiple of its block 128" in catalog.unsupported("pallas.mha", _problem(seq_len=1000), "fwd", GPU_ENV)
    assert catalog.unsupported("pallas.mha", _problem(seq_len=64), "fwdbwd", GPU_ENV) is None
    assert "float32" in catalog.unsupported("jax.cudnn", _problem(dtype="float32"), "fwd", GPU_ENV)
    assert "window" in catalog.unsupported("torch.flash", _problem(window=(8, 0)), "fwd", GPU_ENV)
    assert catalog.defaults(GPU_ENV) == [
        "scan_v2",
        "pallas_v1",
        "jax.xla",
        "jax.cudnn",
        "pallas.mha",
        "torch.flash",
        "torch.cudnn",
        "torch.efficient",
    ]
    cpu = dict(GPU_ENV, platform="cpu", nvidia=False, torch={"version": "2.13.0", "cuda": False})
    assert catalog.defaults(cpu) == ["scan_v2", "pallas_v1", "jax.xla", "torch.math"]
    assert catalog.unsupported("jax.cudnn", _problem(), "fwd", cpu) == "needs a GPU"


def test_tokamax_runs_where_it_imports_on_nvidia_gpus():
    assert catalog.unsupported("tokamax.mosaic", _problem(), "fwd", GPU_ENV) == "does not import: not probed"
    missing = dict(GPU_ENV, tokamax="ModuleNotFoundError: No module named 'tokamax'")
    assert "No module named 'tokamax'" in catalog.unsupported("tokamax.mosaic", _problem(), "fwd", missing)
    assert "tokamax.mosaic" not in catalog.defaults(missing)
    hopper = dict(GPU_ENV, tokamax=None)
    assert catalog.defaults(hopper)[4:6] == ["pallas.mha", "tokamax.mosaic"]
    assert catalog.unsupported("tokamax.mosaic", _problem(num_kv_heads=2, window=(63, 0)), "fwdbwd", hopper) is None
    assert "float32" in catalog.unsupported("tokamax.mosaic", _problem(dtype="float32"), "fwd", hopper)
    assert catalog.unsupported("tokamax.mosaic", _problem(), "fwd", dict(hopper, nvidia=False)) == "needs an NVIDIA GPU"
    cpu = dict(hopper, platform="cpu", nvidia=False)
    assert catalog.unsupported("tokamax.mosaic", _problem(), "fwd", cpu) == "needs a GPU"
    assert catalog.framework("tokamax.mosaic") == "jax"


def test_the_jax_worker_calls_tokamax_as_the_check_does(monkeypatch):
    """``tokamax.dot_product_attention`` with the problem's causal flag, its window as
    two ints (an unbounded side: the whole sequence) and the Mosaic GPU kernel."""
    from bench import jax_worker

    calls = []
    fake = type(sys)("tokamax")
    fake.dot_product_attention = lambda q, k, v, **kwargs: calls.append(kwargs) or q
    monkeypatch.setitem(sys.modules, "tokamax", fake)
    attend = jax_worker.attention("tokamax.mosaic", _problem(seq_len=128, causal=True, window=(15, None)))
    assert attend("q", "k", "v") == "q"
    assert calls == [dict(is_causal=True, local_window_size=(15, 128), implementation="mosaic")]


@pytest.mark.parametrize(
    "message, status",
    [
        ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 34359738368 bytes.", "oom"),
        ("CUDA out of memory. Tried to allocate 32.00 GiB", "oom"),
        ("No available kernel. Aborting execution.", "unsupported"),
        ("INTERNAL: something broke", "error"),
    ],
)
def test_errors_are_classified(message, status):
    assert _worker.classify(RuntimeError(message)) == status


def test_an_oom_in_a_sweep_skips_its_longer_lengths():
    tasks, _ = runner.plan([MEMORY.replace(seq_lens=(512, 1024, 2048))], ["scan_v2", "jax.xla"], GPU_ENV)
    seen = []
    run = runner.Runner(
        GPU_ENV, log=None, budget_s=0, timeout_s=0, deadline=0, seed=0, on_record=lambda t, r: seen.append(r)
    )
    pending = {t.id: t for t in tasks}
    failed = next(t for t in tasks if t.impl == "jax.xla" and t.problem.seq_len == 1024)
    del pending[failed.id]
    run._skip_longer(failed, pending)
    assert [(r["impl"], r["seq_len"], r["status"]) for r in seen] == [("jax.xla", 2048, "skipped")]
    assert len(pending) == 4


def test_jax_workers_time_each_shape_s_implementations_together_but_a_gpu_memory_sweep_s_apart():
    """On a GPU: one JAX worker times each problem and mode's implementations against each
    other (fastest group first, by the fastest implementation in it), a memory sweep
    (stop_at_oom) gives each JAX implementation its own, PyTorch's share one; each group's
    tasks smallest first, a problem and mode's tasks next to each other."""
    impls = ["scan_v2", "jax.xla", "torch.flash", "torch.cudnn"]
    tasks, _ = runner.plan([STANDARD, MEMORY], impls, GPU_ENV)
    groups = runner._groups(tasks, on_gpu=True)
    assert [(module, {(t.suite, t.impl) for t in ts}, together) for module, ts, together in groups] == [
        ("bench.torch_worker", {(s, i) for s in ("standard", "memory") for i in ("torch.flash", "torch.cudnn")}, False),
        ("bench.jax_worker", {("standard", "scan_v2"), ("standard", "jax.xla")}, True),
        ("bench.jax_worker", {("memory", "scan_v2")}, False),
        ("bench.jax_worker", {("memory", "jax.xla")}, False),
    ]
    together, alone = groups[1][1], groups[2][1]
    assert [t.size() for t in alone] == sorted(t.size() for t in alone)
    largest = [max(u.size() for u in together if (u.problem, u.mode) == (t.problem, t.mode)) for t in together]
    assert largest == sorted(largest)
    runs = [(t.mode, t.problem) for t in together]
    assert len(runs) == 2 * len(set(runs))
    assert all(runs[k] == runs[k + 1] for k in range(0, len(runs), 2))
    cpu = runner._groups(tasks, on_gpu=False)
    assert [(module, together) for module, _, together in cpu] == [
        ("bench.torch_worker", False),
        ("bench.jax_worker", True),
    ]


def _record(
    impl: str, mode: str, ms: float, timer: str = "10 rounds of 20 calls, interleaved with 1 other call", **problem
) -> dict:
    p = _problem(**problem)
    r = dict(
        suite="standard", impl=impl, framework=catalog.framework(impl), mode=mode, **p.as_dict(), flops=p.flops(mode)
    )
    r.update(dict.fromkeys(runner.RESULT_FIELDS), status="ok", ms=ms, ms_lo=ms, ms_hi=ms, peak_exact=True, timer=timer)
    r["tflops"] = r["flops"] / ms / 1e9
    return r


def test_report_ratios_are_speed_relative_to_the_baseline():
    records = [_record("scan_v2", "fwd", 2.0), _record("jax.cudnn", "fwd", 1.0)]
    records += [_record("scan_v2", "fwd", 4.0, seq_len=512), _record("jax.cudnn", "fwd", 1.0, seq_len=512)]
    results = dict(
        date="2026-11-22T00:00:00+00:00",
        command="python -m bench",
        environment=dict(device="NVIDIA H100", versions={"jax": "0.11.2"}),
        conventions=cli.CONVENTIONS,
        config=dict(suites=[STANDARD.replace(modes=("fwd",)).as_dict()]),
        measurements=records,
    )
    text = report.render(results)
    summary = next(line for line in text.splitlines() if line.startswith("| scan_v2 |"))
    assert summary.endswith("| 0.35× |")  # geometric mean of 0.5 and 0.25
    assert "| jax.cudnn |" in text and "vs jax.cudnn" in text
    assert "ran in one process, timed against each other in interleaved rounds." in text

    results["measurements"] = [{**r, "timer": "5 batches of 20 calls"} for r in records]
    assert "Each JAX implementation ran in a process of its own" in report.render(results)


def test_tiny_run_end_to_end(tmp_path):
    """``python -m bench --quick`` shrunk further (both suites, five implementations), then
    its JSON, table, plots and the report made from it."""
    impls = ["reference", "scan_v2", "jax.xla", "torch.math", "pallas.mha"]
    command = [
        sys.executable,
        "-m",
        "bench",
        "--quick",
        "--seq-lens",
        "32",
        "64",
        "--head-dim",
        "16",
        "--save-dir",
        str(tmp_path),
    ]
    for impl in impls:
        command += ["--impl", impl]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]

    results = json.loads((tmp_path / "results.json").read_text())
    assert results["schema"] == "jaxtile-bench/1" and results["complete"]
    assert {"date", "command", "wall_s", "config", "environment", "conventions"} <= results.keys()
    env = results["environment"]
    assert env["platform"] == "cpu" and {"jax", "jaxlib", "torch"} <= env["versions"].keys()
    assert [s["name"] for s in results["config"]["suites"]] == ["standard", "memory"]
    records = results["measurements"]
    # standard: 2 lengths × 2 modes, memory: 2 lengths × forward+backward; 5 implementations
    assert len(records) == (2 * 2 + 2) * len(impls)
    for r in records:
        assert r["status"] in runner.STATUSES
        assert set(runner.RESULT_FIELDS) <= r.keys()
        assert r["flops"] == Problem.from_dict(r).flops(r["mode"])
        if r["impl"] == "pallas.mha":
            assert r["status"] == "unsupported" and r["error"] == "needs a GPU"
            continue
        assert r["status"] == "ok", r
        assert 0 < r["ms_lo"] <= r["ms"] <= r["ms_hi"]
        assert r["tflops"] == pytest.approx(r["flops"] / r["ms"] / 1e9)
        if r["framework"] == "torch":
            assert r["peak_bytes"] is None
        else:
            assert r["compile_s"] > 0 and r["peak_source"] == "compiled"
            # timed against the shape's other JAX implementations that run here
            assert r["timer"].endswith("interleaved with 2 other calls"), r["timer"]
            inputs = (
                (4 if r["mode"] == "fwdbwd" else 3) * r["batch"] * r["seq_len"] * r["num_heads"] * r["head_dim"] * 4
            )
            assert r["peak_bytes"] > inputs
    assert "[memory] batch 1 · seq 64" in done.stdout and "fwdbwd TFLOP/s" in done.stdout
    for name in ("time.png", "tflops.png", "memory.png", "dashboard.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name

    command = [sys.executable, "-m", "bench.report", str(tmp_path / "results.json"), "--baseline", "jax.xla"]
    text = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
    assert "### standard suite" in text and "### memory suite" in text
    assert "| implementation | fwd TFLOP/s | fwd vs jax.xla | fwdbwd TFLOP/s | fwdbwd vs jax.xla |" in text
    assert "Peak memory, fwdbwd" in text
    for impl in ("reference", "scan_v2", "jax.xla", "torch.math"):
        assert f"| {impl} |" in text
    assert "| pallas.mha | n/a |" in text


FAKE_WORKER = """
import os, time
from bench import _worker

def measure(task, request):
    kind = task["impl"]
    if kind == "oom":
        raise MemoryError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1 bytes.")
    if kind == "crash":
        os._exit(3)
    if kind == "hang":
        time.sleep(60)
    return dict(status="ok", ms=1.0, ms_lo=1.0, ms_hi=1.0, pid=os.getpid())

_worker.serve(measure)
"""


def _runner(timeout_s: float, on_record=lambda task, record: None) -> runner.Runner:
    """A runner of fake workers (on ``PYTHONPATH``), with no deadline."""
    return runner.Runner(
        GPU_ENV,
        log=sys.stderr,
        budget_s=0,
        timeout_s=timeout_s,
        deadline=runner.deadline_after(None),
        seed=0,
        on_record=on_record,
    )


def test_runner_survives_oom_crash_and_hang(tmp_path, monkeypatch):
    """A fresh worker after each OOM, crash and time-out; every task gets a record."""
    (tmp_path / "fake_worker.py").write_text(FAKE_WORKER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    kinds = ["ok", "oom", "ok", "crash", "ok", "hang", "ok"]
    tasks = [runner.Task(i, "standard", kind, "fwd", _problem(), False) for i, kind in enumerate(kinds)]
    seen = []
    run = _runner(timeout_s=3, on_record=lambda task, record: seen.append((task.impl, record["status"])))
    run.run_group("fake_worker", tasks)
    assert seen == [
        ("ok", "ok"),
        ("oom", "oom"),
        ("ok", "ok"),
        ("crash", "error"),
        ("ok", "ok"),
        ("hang", "timeout"),
        ("ok", "ok"),
    ]
    assert "exited with code 3" in run.records[3]["error"]


def test_a_worker_that_cannot_measure_together_refuses_such_a_request(tmp_path, monkeypatch, capfd):
    """A request for runs measured together, to a worker with no ``together``, ends it at
    start with the reason: each task is an error, none is measured alone."""
    (tmp_path / "fake_worker.py").write_text(FAKE_WORKER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    tasks = [runner.Task(i, "standard", "ok", "fwd", _problem(), False) for i in range(2)]
    run = _runner(timeout_s=30)
    run.run_group("fake_worker", tasks, together=True)
    assert [run.records[t.id]["status"] for t in tasks] == ["error", "error"]
    assert "exited with code 1" in run.records[0]["error"]
    assert "asks for runs measured together" in capfd.readouterr().err


FAKE_TOGETHER_WORKER = """
import os
from bench import _worker

def together(tasks, request, started):
    results = {}
    for task in tasks:
        started(task)
        if task["impl"] == "crash":
            os._exit(3)
        results[task["id"]] = dict(status="ok", ms=1.0, ms_lo=1.0, ms_hi=1.0, timer=f"with {len(tasks)}, pid {os.getpid()}")
    return results

_worker.serve(None, together)
"""


def test_a_together_worker_measures_each_run_of_a_problem_and_mode_at_once(tmp_path, monkeypatch):
    """`_worker.serve` with ``"together"``: each run of consecutive tasks of one problem and
    mode goes to ``together`` at once; a crash in a run costs the task that was running,
    and the rest of the run is measured together in a fresh worker."""
    (tmp_path / "fake_together.py").write_text(FAKE_TOGETHER_WORKER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    runs = [("a", "fwd", 64), ("b", "fwd", 64), ("c", "fwdbwd", 64)]
    runs += [("crash", "fwd", 128), ("d", "fwd", 128), ("e", "fwd", 128)]
    tasks = [
        runner.Task(i, "standard", impl, mode, _problem(seq_len=n), False) for i, (impl, mode, n) in enumerate(runs)
    ]
    run = _runner(timeout_s=30)
    run.run_group("fake_together", tasks, together=True)
    records = [run.records[t.id] for t in tasks]
    assert [r["status"] for r in records] == ["ok", "ok", "ok", "error", "ok", "ok"]
    timers = [r["timer"] for r in records]
    assert [t.split(",")[0] for t in timers[:3]] == ["with 2", "with 2", "with 1"]
    assert timers[0] == timers[1] != timers[2]
    assert "exited with code 3" in records[3]["error"]
    # after the crash, d and e (already started with it or not) run together in a fresh worker
    assert timers[4] == timers[5] and timers[4].startswith("with 2") and timers[4] != timers[0]


def test_time_rounds_interleaves_batches_of_every_call():
    """`_worker.time_rounds`: two warm-up calls each, then rounds that each time one batch
    of every call in turn, in the calls' order, a batch ending in one sync; a Timing per
    call whose median lies within its spread."""
    events = []

    def call(name):
        def run():
            events.append(name)
            return name

        return run

    synced = []
    timings = _worker.time_rounds({"a": call("a"), "b": call("b")}, synced.append, budget_s=0.05, rounds=4)
    assert events[:4] == ["a", "a", "b", "b"], "two warm-up calls each, in turn"
    batches, last = [], None
    for name in events[4:]:
        if name != last:
            batches.append([])
        batches[-1].append(name)
        last = name
    assert [batch[0] for batch in batches] == ["a", "b"] * 4, "4 rounds, each a batch of a then one of b"
    sizes = {name: {len(batch) for batch in batches if batch[0] == name} for name in "ab"}
    assert all(len(s) == 1 and 1 <= min(s) <= 20 for s in sizes.values()), sizes
    assert len(synced) == 4 + len(batches), "a sync after each warm-up call and each batch"
    for name, timing in timings.items():
        assert timing.ms_lo <= timing.ms <= timing.ms_hi and timing.reps == 4 * min(sizes[name])
        assert "interleaved with 1 other call" in timing.timer


def test_time_rounds_keeps_three_rounds_of_a_slow_call():
    """A call slower than the budget's share of a round is timed alone in each batch, in
    3 rounds (the least), and the quick call beside it in as many rounds."""
    import time

    timings = _worker.time_rounds(
        {"slow": lambda: time.sleep(0.02), "quick": lambda: None}, lambda out: out, budget_s=0.05
    )
    assert timings["slow"].reps == 3 and timings["slow"].ms >= 20
    assert timings["quick"].reps == 3 * 20 and timings["quick"].timer.startswith("3 rounds of 20 calls")


def test_time_together_records_what_failed_to_build_and_times_the_rest():
    """`timing.time_together`: a build that raises is its `_worker.failure`, the others are
    timed in rounds, and the results keep the builds' order."""
    from bench import timing

    def broken():
        raise ValueError("no kernel")

    timings = timing.time_together({"a": lambda: lambda: None, "b": broken, "c": lambda: lambda: None}, 0.01)
    assert list(timings) == ["a", "b", "c"]
    assert timings["b"] == {"status": "error", "error": "ValueError: no kernel"}
    assert all(isinstance(timings[key], _worker.Timing) for key in "ac")


def test_timed_passes_time_each_variant_per_pass_on_cleared_caches(monkeypatch):
    """`check.timed_passes`: every variant once per pass, in turn, jax's caches cleared
    before each, an error recorded as None."""
    from bench import check

    events = []
    monkeypatch.setattr(check.jax, "clear_caches", lambda: events.append("clear"))

    def timed(attend, shape, mode, budget_s):
        events.append(attend)
        return {} if attend == "b" else {"ms": float(len(events))}

    monkeypatch.setattr(check, "_timed", timed)
    ms = check.timed_passes({"first": "a", "second": "b"}, None, "fwd", passes=2)
    assert events == ["clear", "a", "clear", "b", "clear", "a", "clear", "b"]
    assert ms == {"first": [2.0, 6.0], "second": [None, None]}


def test_passes_together_print_each_pass_of_the_variants_that_run(monkeypatch, capsys):
    """`check.print_passes_together`: the variants that run here timed together once per
    pass, a line each, an error shown as such."""
    from bench import check

    calls = []

    def timed_together(attends, shape, mode, budget_s):
        calls.append(list(attends))
        return {"a": {"ms": 1.5 * len(calls), "tflops": 100.0 * len(calls)}, "b": {"error": "ValueError"}}

    monkeypatch.setattr(check, "_timed_together", timed_together)
    shape = check.Shape("row", 1, 128, 2, 64)
    check.print_passes_together({"a": "a", "b": "b", "peer": None}, shape, "fwd", passes=2)
    assert calls == [["a", "b"], ["a", "b"]]
    lines = capsys.readouterr().out.splitlines()
    assert [line.split() for line in lines] == [
        ["row", "fwd", "pass", "0", "a=1.5000ms/100", "b=err"],
        ["row", "fwd", "pass", "1", "a=3.0000ms/200", "b=err"],
    ]


def test_check_compares_with_the_peer_against_committed_floors(monkeypatch):
    """``python -m bench.check``'s verdicts: the ratio peer / jaxtile against the floor;
    a missing jaxtile number fails; every committed floor names a case that exists."""
    from bench import check

    floors = json.loads(check.FLOORS.read_text())["floors"]
    assert set(floors) == {shape.name for shape in check.SHAPES}
    shapes = [check.Shape("slow", 1, 64, 2, 16, causal=True), check.Shape("broken", 1, 64, 2, 16)]
    ms = {"jaxtile:slow": 2.0, "cudnn:slow": 1.0, "cudnn:broken": 1.0}
    monkeypatch.setattr(check, "_jaxtile", lambda shape: f"jaxtile:{shape.name}")
    monkeypatch.setattr(check, "_cudnn", lambda shape: f"cudnn:{shape.name}")
    monkeypatch.setattr(check, "_tokamax", lambda shape: None)
    monkeypatch.setattr(
        check,
        "_timed_together",
        lambda attends, shape, mode, budget: {
            name: {"ms": ms[attend]} if attend in ms else {"error": "boom"} for name, attend in attends.items()
        },
    )
    seen = []
    rows = check.run(
        shapes, ["fwd"], 0.1, {"slow": {"fwd": 0.4}, "broken": {"fwd": 0.4}}, on_row=lambda rows: seen.append(len(rows))
    )
    assert [(r["ratio"], r["status"]) for r in rows] == [(0.5, "ok"), (None, "FAIL (no number)")]
    assert seen == [1, 2], "the rows so far are handed on after each one, for a run cut short"
    rows = check.run(shapes[:1], ["fwd"], 0.1, {"slow": {"fwd": 0.6}})
    assert rows[0]["status"] == "FAIL"
    results = dict(
        environment=dict(device="GPU", date="2026-11-27", git={"commit": "abc"}, versions={"jax": "0.11.2"}),
        summary=check._summary(rows, 1),
        rows=rows,
    )
    table = check.render(results)
    assert "| slow | fwd | 2 | " in table and "| **0.50 FAIL** | 0.60 |" in table, table
    assert "0 of 1 rows with a floor at or above it" in table, table
    unmeasured = dict(rows[0], ratio=None, status="no peer")
    table = check.render(dict(results, rows=[unmeasured], summary=check._summary([unmeasured], 1)))
    assert "0 of 1 rows with a floor at or above it" in table, "a row without a peer's number is not at its floor"


def test_check_reports_the_hopper_issue_s_lines_over_the_standard_grid():
    """`bench.check.STANDARD` is the Hopper issue's grid (1K, 4K and 16K tokens, head dims
    64 and 128, causal and not), and the report states its lines over the standard rows a
    run has: geometric means against cuDNN, the lowest ratio against tokamax."""
    from bench import check

    assert len(check.STANDARD) == 12 and set(check.STANDARD) <= set(check.SHAPES)
    assert {(s.seq, s.head_dim, s.causal) for s in check.STANDARD} == {
        (seq, d, c) for seq in (1024, 4096, 16384) for d in (64, 128) for c in (False, True)
    }
    assert all(s.batch * s.seq == 16384 and s.heads * s.head_dim == 2048 for s in check.STANDARD)

    def row(case, mode, mine, cudnn, tokamax=None):
        peers = dict(cudnn={"ms": cudnn}, **({"tokamax": {"ms": tokamax}} if tokamax else {}))
        return dict(case=case, mode=mode, jaxtile={"ms": mine}, **peers)

    rows = [
        row("d64_1k_full", "fwd", 1.0, 2.0, 1.0),
        row("d128_16k_causal", "fwd", 1.0, 0.5, 0.8),
        row("d64_1k_full", "fwdbwd", 1.0, 0.9),
        row("gqa_32_8_causal_8k", "fwd", 1.0, 0.1, 0.1),  # not a standard row
    ]
    assert check._standard_lines(rows) == [
        "",
        "The standard grid's rows in this run (2 of 12): forward 1.00× cuDNN (line 1.0), lowest against tokamax "
        "0.80× (d128_16k_causal; line 1.0); forward+backward 0.90× cuDNN (line 0.95).",
    ]
    assert check._standard_lines(rows[3:]) == []


def test_check_runs_in_parts_merged_into_one_table():
    """``--part K/N`` splits the cases (after ``--only``) into N disjoint parts that
    cover them; ``--report`` merges the parts of one run back in `SHAPES`' order and
    refuses parts of different runs or rows measured twice."""
    from bench import check

    halves = [check.select(None, (k, 2)) for k in (1, 2)]
    assert sorted(s.name for s in halves[0] + halves[1]) == sorted(s.name for s in check.SHAPES)
    assert not {s.name for s in halves[0]} & {s.name for s in halves[1]}
    gqa = check.select(["gqa"], (2, 2))
    assert gqa == check.select(["gqa"])[1::2] and all("gqa" in s.name for s in gqa)
    assert check._part("2/3") == (2, 3)
    for bad in ("3/2", "0/1", "half"):
        with pytest.raises(argparse.ArgumentTypeError, match="--part"):
            check._part(bad)

    def part(shapes, commit="abc"):
        rows = [
            dict(
                case=s.name,
                mode=m,
                jaxtile={"ms": 1.0},
                cudnn={"ms": 0.5},
                peer="cudnn",
                ratio=0.5,
                floor=None,
                status="ok",
            )
            for s in shapes
            for m in reversed(check.MODES)
        ]
        env = dict(device="GPU", date="2026-11-28", git={"commit": commit, "dirty": False}, versions={"jax": "0.11.2"})
        return dict(environment=env, summary=check._summary(rows, len(rows)), rows=rows)

    merged = check.merge([part(halves[1]), part(halves[0])])
    assert [(r["case"], r["mode"]) for r in merged["rows"]] == [
        (s.name, m) for s in check.SHAPES for m in check.MODES
    ], "rows in the order of the cases and modes"
    assert merged["summary"]["rows"] == merged["summary"]["planned"] == 2 * len(check.SHAPES)
    assert merged["summary"]["geomean_vs_cudnn"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="share a commit"):
        check.merge([part(halves[0]), part(halves[1], commit="def")])
    with pytest.raises(ValueError, match="measured twice"):
        check.merge([part(halves[0]), part(halves[0][:1])])


def test_check_completes_a_run_cut_short_after_its_results(monkeypatch):
    """``--after`` plans only the rows that earlier results of the same commit, tree and GPU
    lack, `run` skips the others, and `merge` counts a row as planned once, however many
    parts planned it: a run cut short and its completion report as one whole run."""
    from bench import check

    shapes = [check.Shape("a", 1, 64, 2, 16, causal=True), check.Shape("b", 1, 64, 2, 16)]
    monkeypatch.setattr(check, "_jaxtile", lambda shape: "jaxtile")
    monkeypatch.setattr(check, "_cudnn", lambda shape: "cudnn")
    monkeypatch.setattr(check, "_tokamax", lambda shape: None)
    monkeypatch.setattr(
        check, "_timed_together", lambda attends, shape, mode, budget: {name: {"ms": 1.0} for name in attends}
    )
    env = dict(device="GPU", date="2026-12-07", git={"commit": "abc", "dirty": False}, versions={"jax": "0.11.2"})
    everything = [(s.name, m) for s in shapes for m in check.MODES]
    first = check.run(shapes[:1], check.MODES, 0.1, {})  # cut short after case "a"
    cut = dict(environment=env, summary=check._summary(first, everything), rows=first)
    rest = check._rest(shapes, check.MODES, [cut], env)
    assert rest == [("b", "fwd"), ("b", "fwdbwd")]
    with pytest.raises(ValueError, match="not"):
        check._rest(shapes, check.MODES, [cut], dict(env, git={"commit": "def", "dirty": False}))
    second = check.run(shapes, check.MODES, 0.1, {}, skip=set(everything) - set(rest))
    assert [(r["case"], r["mode"]) for r in second] == rest
    completion = dict(environment=env, summary=check._summary(second, rest), rows=second)
    merged = check.merge([cut, completion])
    assert merged["summary"]["rows"] == merged["summary"]["planned"] == 4
    assert "cut short" not in check.render(merged)
    assert "cut short: 2 of its 4 rows" in check.render(check.merge([cut]))


def test_check_times_every_kind_of_case_and_its_jaxtile_peers():
    """Each kind of case of ``python -m bench.check`` (packed documents, sinks, a bias, a
    dense mask recognised or not) runs forward and forward+backward, and so do the peers
    that are jaxtile calls (the documents as a batch, the call without sinks): a number,
    not an error, at toy size on this machine."""
    from bench import check

    toy = functools.partial(check.Shape, batch=1, seq=64, heads=2, head_dim=16, causal=True)
    cases = {
        "documents": toy(name="documents", documents=2),
        "sinks": toy(name="sinks", sinks=True),
        "bias": toy(name="bias", bias=True),
        "flax": toy(name="flax", dense_mask="flax"),
        "unrecognised": toy(name="unrecognised", dense_mask="unrecognised"),
    }
    for name, shape in cases.items():
        for attend in (check._jaxtile(shape), *check._jaxtile_peers(shape).values()):
            for mode in check.MODES:
                assert "ms" in check._timed(attend, shape, mode, budget_s=0.01), (name, mode)


def test_documents_count_as_separate_sequences():
    from bench import check

    packed = check.Shape("docs", 2, 1024, 4, 64, causal=True, documents=4)
    separate = check.Shape("separate", 8, 256, 4, 64, causal=True)
    assert packed.flops("fwdbwd") == separate.flops("fwdbwd")


def test_ab_compares_the_versions_and_their_ratios_to_cudnn():
    """`bench.ab`'s row: B's speed over A's, and over each run's cuDNN (a GPU 10% slower in
    B's process, with the same kernels, reads 0.9 and 1.0); None where a number is missing."""
    from bench import ab

    def row(mine, cudnn):
        return dict(case="d64", mode="fwd", jaxtile={"ms": mine} if mine else {"error": "boom"}, cudnn={"ms": cudnn})

    slower = ab._compare(row(1.0, 2.0), row(1.1, 2.2))
    assert slower["speedup"] == pytest.approx(1 / 1.1) and slower["speedup_vs_cudnn"] == pytest.approx(1.0)
    assert ab._compare(row(1.0, 2.0), row(0.5, 2.0))["speedup_vs_cudnn"] == pytest.approx(2.0)
    missing = ab._compare(row(1.0, 2.0), row(None, 2.0))
    assert missing["speedup"] is None and missing["speedup_vs_cudnn"] is None
    assert ab._compare(row(1.0, 2.0), dict(row(1.0, 2.0), cudnn={}))["speedup_vs_cudnn"] is None


def test_ab_runs_each_version_from_its_own_directory(tmp_path):
    """`bench.ab` lays out a git ref and a directory each with its own jaxtile and this
    tree's harness; a process started there imports that jaxtile and says which, and a
    directory stamped by ``bench.probe --stamp`` names its commit."""
    from bench import ab

    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    plain, stamped = tmp_path / "plain", tmp_path / "stamped"
    for source in (plain, stamped):
        shutil.copytree(ROOT / "jaxtile", source / "jaxtile", ignore=shutil.ignore_patterns("__pycache__"))
    (stamped / "VERSION.json").write_text(json.dumps(dict(version="stamped", commit="c0ffee", dirty=False)))
    versions = (("HEAD", "ref", head.stdout.strip()), (str(plain), "dir", None), (str(stamped), "stamp", "c0ffee"))
    for version, label, commit in versions:
        where = tmp_path / "laid_out" / label
        described = ab._materialise(version, where)
        assert (where / "jaxtile" / "__init__.py").exists() and (where / "bench" / "check.py").exists()
        state = _git_state_in(where)
        assert state["jaxtile_file"] == str(where / "jaxtile" / "__init__.py")
        assert state["commit"] == commit == described["commit"]


def _git_state_in(where: Path, pythonpath: Path | None = None) -> dict:
    """`bench.probe.git_state` in a process started in ``where`` (so that it imports
    ``where/jaxtile``), with this tree's harness on ``pythonpath``."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath)} if pythonpath else None
    probe = "import json; from bench.probe import git_state; print(json.dumps(git_state()))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=where, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout)


def test_git_state_trusts_a_stamp_of_these_sources_then_a_checkout_then_any_stamp(tmp_path):
    """A stamp whose fingerprint matches the sources names them, whatever ``.git`` the
    tree carries (a GPU machine's copy may hold an older one); without such a stamp, git
    answers in a checkout of its own, whatever stale ``VERSION.json`` lies there; a copy
    inside another checkout is named by its stamp (dirty if its sources changed since)
    or by nothing, never by the checkout around it."""
    from bench.probe import _fingerprint

    repo = tmp_path / "repo"
    (repo / "jaxtile").mkdir(parents=True)
    (repo / "jaxtile" / "__init__.py").write_text("first = 1\n")
    (repo / ".gitignore").write_text("VERSION.json\nout/\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "x"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    stale = dict(version="stamped", commit="c0ffee", dirty=False)
    (repo / "VERSION.json").write_text(json.dumps(stale))
    stamped, plain, changed = (repo / "out" / name for name in ("stamped", "plain", "changed"))
    for copy in (stamped, plain, changed):
        shutil.copytree(repo / "jaxtile", copy / "jaxtile")
    (stamped / "VERSION.json").write_text(json.dumps(stale))
    (changed / "VERSION.json").write_text(json.dumps(stale | dict(fingerprint=_fingerprint(changed))))
    (changed / "jaxtile" / "__init__.py").write_text("second = 2\n")
    cases = [(repo, (commit, False)), (stamped, ("c0ffee", False)), (plain, (None, None)), (changed, ("c0ffee", True))]
    for where, expected in cases:
        state = _git_state_in(where, ROOT)
        assert state["jaxtile_file"] == str(where.resolve() / "jaxtile" / "__init__.py")
        assert (state["commit"], state["dirty"]) == expected, where
    (repo / "jaxtile" / "__init__.py").write_text("second = 2\n")  # the files of a later commit, under the old .git
    (repo / "VERSION.json").write_text(json.dumps(dict(stale, commit="beef", fingerprint=_fingerprint(repo))))
    state = _git_state_in(repo, ROOT)
    assert (state["commit"], state["dirty"]) == ("beef", False)


def test_decode_smoke_run_on_cpu(tmp_path):
    """``python -m bench.decode --smoke``: every layout and implementation has a row with
    its bytes, bandwidth and ratios; cuDNN, absent on CPU (and refusing the smoke's
    float32 on a GPU), is recorded as unsupported."""
    from bench import decode

    out = tmp_path / "decode.json"
    command = [sys.executable, "-m", "bench.decode", "--smoke", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert {"git", "device", "versions", "date", "copy_bandwidth_gbs", "rows"} <= results.keys()
    assert {"commit", "dirty"} <= results["git"].keys() and {"jax", "jaxlib"} <= results["versions"].keys()
    assert results["copy_bandwidth_gbs"] > 0
    rows = {(r["layout"], r["impl"]): r for r in results["rows"]}
    assert set(rows) == {(layout, "jaxtile") for layout in decode.LAYOUTS} | {("dense", "cudnn"), ("ragged", "cudnn")}
    case = decode.SMOKE[0]
    assert rows["dense", "jaxtile"]["bytes"] == case.moved_bytes([case.kv_len] * case.batch)
    for (layout, impl), row in rows.items():
        if impl == "cudnn":
            assert row["status"] == "unsupported" and ("cuDNN" in row["error"] or "float32" in row["error"])
            continue
        assert row["status"] == "ok" and 0 < row["ms_lo"] <= row["ms"] <= row["ms_hi"], row
        assert row["gbs"] == pytest.approx(row["bytes"] / row["ms"] / 1e6)
        assert row["of_copy"] == pytest.approx(row["gbs"] / results["copy_bandwidth_gbs"])
        assert row["vs_cudnn"] is None
        if layout.startswith("paged"):
            assert row["bytes"] == rows["ragged", impl]["bytes"] < rows["dense", impl]["bytes"]
            assert row["vs_contiguous"] == pytest.approx(rows["ragged", impl]["ms"] / row["ms"])
        assert ("targets" in row) == (impl == "jaxtile")
    assert decode.render(results).splitlines()[2] in done.stdout  # the table's header


def test_decode_variants_time_every_candidate_and_share_count_on_every_layout():
    """``--tiles`` and ``--splits``: pallas_decode with each autotuning candidate (named
    by its key tile and stages) and each share count, by the same names on every layout:
    through ``flash_attention`` on the contiguous ones, ``paged_attention`` on the paged."""
    from bench import decode
    from jaxtile.triton.decode import CANDIDATES

    tiled = {f"pallas_decode {t.block_k}x{t.num_stages}" for t in CANDIDATES}
    split = {f"pallas_decode splits={s}" for s in decode.SPLITS}
    variants = decode._variants(tiles=True, splits=True)
    assert set(variants) == tiled | split and len(tiled) == len(CANDIDATES)
    assert [variants[name].num_splits for name in sorted(split)] == [int(n.split("=")[1]) for n in sorted(split)]
    assert decode._variants(tiles=False, splits=False) == {}
    for layout in decode.LAYOUTS:
        attends = decode._attends(layout, (), None, variants)
        assert set(variants) <= set(attends) and "jaxtile" in attends
        assert not set(variants) & set(decode._attends(layout, (), None))
        call = decode._paged if layout.startswith("paged") else decode._jaxtile
        for name, tuning in variants.items():
            assert attends[name].func is call, (layout, name)
            assert attends[name].keywords == dict(implementation="pallas_decode", tuning=tuning), (layout, name)


def test_decode_variants_read_the_pages_in_their_tiles_and_shares(monkeypatch):
    """A ``--tiles`` and a ``--splits`` variant on a paged layout of the smoke case
    (interpreted on CPU): pallas_decode reads the pages in the variant's key tiles and
    shares, and gives the default's output."""
    from bench import decode
    from jaxtile.triton import decode as pallas_decode

    seen = []
    forward_pass = pallas_decode.v2.forward_pass

    def spy(inputs, config, tuning, **options):
        out, lse = forward_pass(inputs, config, tuning, **options)
        seen.append((tuning.block_k, out.shape[0], options["paged"] is not None))
        return out, lse

    monkeypatch.setattr(pallas_decode.v2, "forward_pass", spy)
    case = decode.SMOKE[0]
    q, k, v = decode._inputs(case)
    args = decode._arguments(case, "paged16", q, k, v, decode._kv_lengths(case))
    variants = decode._variants(tiles=True, splits=True)
    chosen = {name: variants[name] for name in ("pallas_decode 32x2", "pallas_decode splits=3")}
    attends = decode._attends("paged16", (), None, chosen)
    want = np.asarray(attends["jaxtile"](*args))
    for name in chosen:
        np.testing.assert_allclose(np.asarray(attends[name](*args)), want, rtol=1e-5, atol=1e-5, err_msg=name)
    # 32-key tiles in the shares pages take (8 tiles: one share of `_MIN_TILES`), the
    # 16-bit default's 128 in 3.
    assert seen == [(32, 256 // 32 // pallas_decode._MIN_TILES, True), (128, 3, True)]


def test_decode_moves_the_filled_cache_once():
    """Bytes of a decode step: q and the output, and K and V up to each sequence's length."""
    from bench import decode

    case = decode.Case(batch=2, q_len=4, kv_len=64, heads=4, kv_heads=2, head_dim=8, dtype="bfloat16")
    queries = 2 * (2 * 4 * 4 * 8) * 2  # q and out, 2 bytes each
    assert case.moved_bytes([10, 64]) == queries + 2 * (10 + 64) * 2 * 8 * 2
    assert case.moved_bytes([64, 64]) == queries + 2 * (2 * 64) * 2 * 8 * 2
    lengths = decode._kv_lengths(decode.CASES[0])
    assert lengths.shape == (8,) and (lengths >= 16384).all() and (lengths <= 32768).all()


def test_decode_pages_hold_the_contiguous_cache():
    """The paged layouts' pages, gathered through the page table, are the contiguous cache."""
    from bench import decode

    case = decode.Case(batch=3, q_len=1, kv_len=64, heads=2, kv_heads=2, head_dim=4, dtype="float32")
    k = decode._inputs(case)[1]
    for page_size in decode.PAGE_SIZES:
        table = decode._page_table(case, page_size)
        assert sorted(table.ravel()) == list(range(case.batch * case.kv_len // page_size))
        pages = np.asarray(decode._to_pages(k, table))
        assert pages.shape == (case.kv_heads, table.size, page_size, case.head_dim)
        gathered = pages[:, table].reshape(case.kv_heads, case.batch, case.kv_len, case.head_dim)
        np.testing.assert_array_equal(gathered.transpose(1, 2, 0, 3), np.asarray(k))


def test_decode_table_judges_the_issue_targets(monkeypatch):
    """Ratios to cuDNN (its ragged time for paged rows) and to the ragged contiguous cache,
    the targets met or missed, and the Markdown table."""
    from bench import decode

    ms = {("dense", "jaxtile"): 1.0, ("dense", "cudnn"): 1.5, ("ragged", "jaxtile"): 1.0}
    ms |= {("ragged", "cudnn"): 0.9, ("paged16", "jaxtile"): 1.05}

    def timed(calls, budget_s):
        def timing(took):
            return (
                {"status": "ok", "ms": took, "ms_lo": took, "ms_hi": took}
                if took
                else _worker.failure(ValueError("no"))
            )

        return {key: timing(ms.get(key)) for key in calls}

    assert list(decode._attends("ragged", ["reference"], None)) == ["jaxtile", "reference", "cudnn"]
    assert list(decode._attends("paged16", ["reference"], None)) == ["jaxtile", "reference"]
    monkeypatch.setattr(decode, "_timings", timed)
    case = decode.Case(batch=2, q_len=1, kv_len=64, heads=2, kv_heads=1, head_dim=4, dtype="float32")
    dense_gbs = case.moved_bytes([64, 64]) / 1e6
    lines = []
    rows = decode.run([case], [], 0.1, copy_gbs=dense_gbs / 0.9, emit=lines.append)
    assert [(r["layout"], r["impl"], r["status"]) for r in rows] == [
        ("dense", "jaxtile", "ok"),
        ("dense", "cudnn", "ok"),
        ("ragged", "jaxtile", "ok"),
        ("ragged", "cudnn", "ok"),
        ("paged16", "jaxtile", "ok"),
        ("paged64", "jaxtile", "error"),
    ]
    verdicts = [{metric: t["met"] for metric, t in r["targets"].items()} for r in rows if r["impl"] == "jaxtile"]
    assert verdicts == [
        {"of_copy": True, "vs_cudnn": True},
        {"of_copy": False, "vs_cudnn": False},
        {"vs_contiguous": True},
        {"vs_contiguous": False},  # no number
    ]
    assert decode._goals({"layout": "ragged", "q_len": 16}) == {"vs_cudnn": 1.2}
    assert rows[4]["vs_cudnn"] == pytest.approx(0.9 / 1.05) and rows[4]["vs_contiguous"] == pytest.approx(1 / 1.05)
    results = dict(
        git={"commit": "0123456789abcdef", "dirty": True},
        device="NVIDIA H100",
        versions={"jax": "0.11.2", "jaxlib": "0.11.2"},
        date="2026-11-23T10:00:00+00:00",
        copy_bandwidth_gbs=dense_gbs / 0.9,
        rows=rows,
    )
    text = decode.render(results)
    assert "jaxtile at commit `0123456789ab` (with uncommitted changes)" in text
    assert lines == text.splitlines()[4:-2]  # the rows, printed as they are measured
    assert (
        "| b2_q1_kv64 | dense | jaxtile | 1.000 | 0.0 | 0 | 0.90 | 1.50 | — | copy ≥ 0.85 ok, cuDNN ≥ 1.00 ok |" in text
    )
    assert "| b2_q1_kv64 | paged16 | jaxtile | 1.050 |" in text and "| 0.86 | 0.95 | contiguous ≥ 0.91 ok |" in text
    assert "| b2_q1_kv64 | paged64 | jaxtile | error |" in text and "| ValueError: no |" in text
    assert text.endswith("jaxtile's default met 3 of 6 targets (3 missed, 0 without a peer's number).\n")
