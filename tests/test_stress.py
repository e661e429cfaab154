"""``bench/stress.py``: its quick mode end to end, and the checks it relies on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from bench import stress

ROOT = Path(__file__).resolve().parents[1]


def test_quick_mode_end_to_end(tmp_path):
    out = tmp_path / "stress.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.stress", "--quick", "--out", str(out), "--max-seconds", "60"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["passed"] and not report["failures"]
    plan = stress.QUICK
    assert [(s["implementation"], s["mode"]) for s in report["sweeps"]] == [
        (s.implementation, s.mode) for s in plan.sweeps
    ]
    for sweep in (*report["sweeps"], report["memory_limit"]):
        assert sweep["steps"] and all(step["status"] == "ok" and step["finite"] for step in sweep["steps"]), sweep
        assert all(step["compile_s"] > 0 and step["ms"] > 0 for step in sweep["steps"])
    forward = [step for s in report["sweeps"] if s["mode"] == "fwd" for step in s["steps"]]
    assert all(step["row_error_over_tolerance"] <= 1.0 for step in forward)
    soak = report["soak"]
    assert soak["completed"] and soak["repeats_done"] == plan.repeats and soak["mismatches"] == 0


def test_bitwise_comparison_sees_one_ulp():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)), jnp.bfloat16)
    y = x.at[2, 3].set(jnp.nextafter(x[2, 3], jnp.inf))
    assert int(stress._differs((x, x), (x, x))) == 0
    assert int(stress._differs((x, x), (x, y))) == 1


def test_sweep_stops_at_out_of_memory(monkeypatch):
    """An out-of-memory error ends the sweep as a pass; the largest shape that ran is kept."""

    def measure(sweep, shape, repeats):
        if shape.batch > 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.00GiB")
        return dict(status="ok", finite=True, passed=True)

    monkeypatch.setattr(stress, "_measure", measure)
    sweep = stress.Sweep("pallas_v2", "fwd", stress.Shape(1, 64, 2, 16), grow="batch")
    result = stress.run_sweep(sweep, deadline=float("inf"), repeats=1)
    assert result["stopped"] == "oom"
    assert [step["status"] for step in result["steps"]] == ["ok", "ok", "oom"]
    assert result["largest_ok_tokens"] == 128 and result["steps"][-1]["passed"]
