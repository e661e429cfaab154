"""The parity suite: the quick set through the code the CLI runs, the CLI itself, and
proof that the suite fails deliberately wrong implementations."""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import jaxtile
from parity.__main__ import _runnable, main
from parity.case import make_inputs
from parity.cases import QUICK
from parity.entries import ENTRIES
from parity.merge import main as merge_main
from parity.run import Problem, jaxtile_function
from parity.second_opinions import SECOND_OPINIONS
from parity.suite import run_suite

ROOT = Path(__file__).resolve().parents[1]
QUICK_BY_NAME = {case.name: case for case in QUICK}


@pytest.mark.parametrize("case", QUICK, ids=lambda c: c.name)
def test_quick_set(impl, case):
    _check_quick_case(impl.name, case)


def _check_quick_case(implementation, case):
    report = run_suite([case], [implementation], second_opinions=False)
    (result,) = report.results
    if result.unsupported:  # what the implementation declares it cannot run (as `conftest` does)
        pytest.skip(f"unsupported: {result.raised}")
    assert result.ok, result.describe()


@pytest.mark.parametrize("case", QUICK, ids=lambda c: c.name)
@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.__name__)
def test_quick_set_through_the_entries(entry, case):
    """jaxtile's other entry points (jax.nn's semantics), where they can express the case."""
    _check_quick_case(entry, case)


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.__name__)
def test_entries_express_most_of_the_quick_set(entry):
    """A skipped entry checks nothing: each must express most quick cases."""
    expressed = []
    for case in QUICK:
        try:
            run, args = jaxtile_function(case, make_inputs(case), entry)
            jax.eval_shape(run, *args)
        except NotImplementedError:
            continue
        expressed.append(case.name)
    assert len(expressed) >= len(QUICK) * 3 // 4, f"{entry.__name__} runs only on {expressed}"


@pytest.mark.parametrize("case", QUICK, ids=lambda c: c.name)
def test_second_opinions_match_the_reference(case):
    """Checks the oracle and the mapping of each case onto PyTorch's and JAX's semantics."""
    report = run_suite([case], [])
    for result in report.second_opinions:
        assert result.ok, result.describe()


def test_second_opinions_cover_most_of_the_quick_set():
    """A skipped second opinion checks nothing: each must express most quick cases."""
    problems = [Problem.create(case) for case in QUICK]
    for opinion in SECOND_OPINIONS:
        expressed = [p.case.name for p in problems if opinion.unsupported(p) is None]
        assert len(expressed) >= len(QUICK) // 2, f"{opinion.name} runs only on {expressed}"


# Deliberately wrong implementations: scan_v2 behind wrappers with flash_attention's signature.


def _scan_v2(q, k, v, **options):
    return jaxtile.flash_attention(q, k, v, implementation="scan_v2", **options)


def scale_off_by_one_percent(q, k, v, *, scale=None, **options):
    """scan_v2 with the softmax scale 1% too large."""
    scale = (1 / math.sqrt(q.shape[-1]) if scale is None else scale) * 1.01
    return _scan_v2(q, k, v, scale=scale, **options)


def causal_mask_off_by_one(q, k, v, *, causal=False, window=None, **options):
    """scan_v2 whose causal mask lets each query also see the next key."""
    if not causal:
        return _scan_v2(q, k, v, window=window, **options)
    left = window[0] if isinstance(window, tuple) else window
    return _scan_v2(q, k, v, window=(left, 1), **options)


def dk_drops_a_query_head(q, k, v, **options):
    """scan_v2 whose dK sums every query head of a GQA group but the last."""
    attend = functools.partial(_scan_v2, **options)
    group = q.shape[-2] // k.shape[-2]
    kept = (jnp.arange(q.shape[-2]) % group != group - 1)[:, None]  # [num_heads, 1]

    @jax.custom_vjp
    def attention(q, k, v):
        return attend(q, k, v)

    def forward(q, k, v):
        return jax.vjp(attend, q, k, v)

    def backward(vjp, cotangents):
        dout, dlse = cotangents
        dq, _, dv = vjp(cotangents)
        _, dk, _ = vjp((jnp.where(kept, dout, 0), jnp.where(kept, dlse, 0)))
        return dq, dk, dv

    attention.defvjp(forward, backward)
    return attention(q, k, v)


@pytest.mark.parametrize(
    ("wrong", "case_name", "caught_in"),
    [
        (scale_off_by_one_percent, "flashtile_causal_block64", {"out", "lse", "dq", "dk", "dv"}),
        (causal_mask_off_by_one, "flashtile_prime_127", {"out", "lse", "dq", "dk", "dv"}),
        (dk_drops_a_query_head, "flashtile_gqa_8q_2kv_causal_segments", {"dk"}),
    ],
    ids=lambda x: getattr(x, "__name__", None),
)
def test_suite_catches_wrong_implementations(wrong, case_name, caught_in):
    report = run_suite([QUICK_BY_NAME[case_name]], [wrong])
    (result,) = report.jaxtile
    assert not report.ok
    assert {name for name, e in result.errors.items() if not e.ok} == caught_in, result.describe()
    assert result.agrees, "no second opinion ran"
    assert not any(result.agrees.values()), result.describe()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "parity", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_cli_end_to_end(tmp_path):
    path = tmp_path / "parity.json"
    done = _cli("--impl", "scan_v2", "-k", "flashtile_tile_", "--device", "cpu", "--json", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed, 0 failed" in done.stdout
    report = json.loads(path.read_text())
    for key in ("date", "jax", "torch", "jax_backend", "jax_device", "torch_device", "summary"):
        assert report[key], key
    assert report["ok"] is True
    assert report["implementations"] == ["scan_v2"]
    rows = [row for row in report["rows"] if not row["second_opinion"]]
    assert [row["case"] for row in rows] == ["flashtile_tile_minus_one", "flashtile_tile_plus_one_d96"]
    for row in rows:
        assert row["ok"] and set(row["errors"]) == {"out", "lse", "dq", "dk", "dv"}
        assert row["agrees"] == {"torch.sdpa": True, "jax.nn.dpa": True}
        assert all(e["rel_l2"] <= row["tolerance"]["rel_l2"] for e in row["errors"].values())


def test_cli_fails_a_wrong_implementation(tmp_path):
    path = tmp_path / "parity.json"
    wrong = "tests.test_parity:scale_off_by_one_percent"
    done = _cli("--impl", wrong, "-k", "tile_minus_one", "--no-second-opinions", "--json", str(path))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL" in done.stdout
    report = json.loads(path.read_text())
    assert report["ok"] is False
    assert [(row["implementation"], row["ok"]) for row in report["rows"]] == [("scale_off_by_one_percent", False)]


def test_cli_shards_merge_into_the_whole_run(tmp_path):
    """``--shard`` parts of a run (here split further by ``--impl``) merge into the rows
    and summary of the run in one piece; the JSON of each part is complete."""
    common = ["-k", "flashtile_tile_", "--device", "cpu"]
    whole, parts = tmp_path / "whole.json", [tmp_path / f"part{i}.json" for i in range(3)]
    assert main([*common, "--impl", "scan_v2", "--impl", "scan_v1", "--json", str(whole)]) == 0
    for path, (impl, shard) in zip(parts, [("scan_v2", "1/2"), ("scan_v2", "2/2"), ("scan_v1", "1/1")]):
        assert main([*common, "--impl", impl, "--shard", shard, "--json", str(path)]) == 0
    merged = tmp_path / "merged.json"
    assert merge_main([str(merged), *map(str, parts)]) == 0
    expected, got = json.loads(whole.read_text()), json.loads(merged.read_text())
    assert got["complete"] and got["ok"] and [p["shard"] for p in got["parts"]] == ["1/2", "2/2", "1/1"]
    assert sorted((r["case"], r["implementation"]) for r in got["rows"]) == sorted(
        (r["case"], r["implementation"]) for r in expected["rows"]
    )
    assert got["summary"].split(" | ")[:3] == expected["summary"].split(" | ")[:3]  # all but the seconds
    with pytest.raises(SystemExit):
        merge_main([str(merged), str(parts[0]), str(parts[0])])


def test_default_implementations_are_those_that_run_here(capsys):
    """Without ``--impl`` the report runs every implementation whose record says it runs
    on this machine, and names each one it leaves out with the record's reason."""
    platform = jax.default_backend()
    names = _runnable()
    printed = capsys.readouterr().out
    assert names and all(jaxtile.registry.get(name).unable(platform) is None for name in names)
    for record in jaxtile.registry.implementations():
        if record.name not in names:
            assert f"left out: {record.unable(platform)}" in printed


@pytest.mark.parametrize(
    "argv",
    [["-k", "no such case"], ["--impl", "no_such_implementation"], ["--shard", "3/2"], ["--shard", "1"]],
    ids=["filter", "implementation", "shard_index", "shard_format"],
)
def test_cli_rejects_bad_arguments(argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
