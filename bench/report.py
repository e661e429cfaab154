"""The README's performance section, generated from a run's JSON (never typed by hand)::

    python -m bench.report bench/results/h100/results.json [--baseline jax.cudnn ...]

For each suite: a summary (geometric means over its shapes) and, folded, one table per
shape with every implementation's time, TFLOP/s and speed relative to the baselines
(cuDNN through ``jax.nn.dot_product_attention``, JAX's bundled Pallas ``mha`` and
PyTorch's flash backend, where the run has them). A sweep run until OOM also gets a
table of peak memory by sequence length.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from bench import catalog
from bench.suites import MODES
from bench.table import gib, group, status_text

BASELINES = ("jax.cudnn", "tokamax.mosaic", "pallas.mha", "torch.flash")


def _geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _num(x: float) -> str:
    """Three significant digits, keeping trailing zeros; whole numbers from 100 up."""
    return f"{x:.0f}" if x >= 100 else f"{x:#.3g}"


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}×"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    align = ["---"] + ["--:"] * (len(header) - 1)
    return [_row(header), _row(align), *(_row(r) for r in rows)]


def _ok(record: dict | None) -> bool:
    return record is not None and record["status"] == "ok"


def _speedup(record: dict | None, baseline: dict | None) -> float | None:
    """How many times faster than the baseline on the same shape (>1: faster)."""
    return baseline["ms"] / record["ms"] if _ok(record) and _ok(baseline) else None


def _summary(blocks: dict, modes: list[str], baselines: list[str]) -> list[str]:
    impls = catalog.order(impl for by_impl in blocks.values() for impl in by_impl)
    header = ["implementation"]
    for mode in modes:
        header += [f"{mode} TFLOP/s"] + [f"{mode} vs {b}" for b in baselines]
    rows = []
    for impl in impls:
        row = [impl]
        for mode in modes:
            runs = [by_impl.get(impl, {}).get(mode) for by_impl in blocks.values()]
            runs = [r for r in runs if r is not None and r["status"] != "unsupported"]
            ok = [r for r in runs if _ok(r)]
            tflops = _geomean([r["tflops"] for r in ok])
            cell = "" if tflops is None else _num(tflops)
            if runs and len(ok) < len(runs):
                cell += f" ({len(ok)}/{len(runs)} ran)"
            row.append(cell or "n/a")
            for b in baselines:
                pairs = [
                    _speedup(by_impl.get(impl, {}).get(mode), by_impl.get(b, {}).get(mode))
                    for by_impl in blocks.values()
                ]
                row.append("" if impl == b else _ratio(_geomean([x for x in pairs if x is not None])))
        rows.append(row)
    return _table(header, rows)


def _shape(by_impl: dict, modes: list[str], baselines: list[str]) -> list[str]:
    header = ["implementation"]
    for mode in modes:
        header += [f"{mode} ms", f"{mode} TFLOP/s"] + [f"{mode} vs {b}" for b in baselines]
    rows = []
    for impl in catalog.order(by_impl):
        row = [impl]
        for mode in modes:
            r = by_impl[impl].get(mode)
            if _ok(r):
                row += [_num(r["ms"]), _num(r["tflops"])]
            else:
                row += [status_text(r) if r else "", ""]
            for b in baselines:
                row.append("" if impl == b else _ratio(_speedup(r, by_impl.get(b, {}).get(mode))))
        rows.append(row)
    return _table(header, rows)


def _focus(blocks: dict, impl: str, modes: list[str], baselines: list[str]) -> list[str]:
    """One row per shape: ``impl``'s TFLOP/s and its speed relative to each baseline."""
    header = ["shape"]
    for mode in modes:
        header += [f"{mode} TFLOP/s"] + [f"{mode} vs {b}" for b in baselines]
    rows = []
    for problem, by_impl in blocks.items():
        row = [problem.describe()]
        for mode in modes:
            r = by_impl.get(impl, {}).get(mode)
            row.append(_num(r["tflops"]) if _ok(r) else status_text(r) if r else "")
            row += [_ratio(_speedup(r, by_impl.get(b, {}).get(mode))) for b in baselines]
        rows.append(row)
    return _table(header, rows)


def _memory(records: list[dict], mode: str) -> list[str]:
    seqs = sorted({r["seq_len"] for r in records})
    header = ["implementation"] + [f"seq {s}" for s in seqs]
    rows = []
    for impl in catalog.order(r["impl"] for r in records):
        by_seq = {r["seq_len"]: r for r in records if r["impl"] == impl and r["mode"] == mode}
        cells = []
        for s in seqs:
            r = by_seq.get(s)
            if _ok(r) and r["peak_bytes"] is not None:
                cells.append(("≤" if r["peak_exact"] is False else "") + gib(r["peak_bytes"]))
            elif r is not None and r["status"] in ("oom", "error", "timeout"):
                cells.append(status_text(r))
            else:
                cells.append("—")
        rows.append([impl, *cells])
    return _table(header, rows)


def _processes(records: list[dict]) -> str | None:
    """How a suite's JAX implementations were timed, from their records' timers: against
    each other in one process, or each in a process of its own."""
    timers = [r["timer"] for r in records if r["framework"] != "torch" and _ok(r)]
    if not timers:
        return None
    torch = any(r["framework"] == "torch" and _ok(r) for r in records)
    if all("interleaved" in timer for timer in timers):
        return "The JAX implementations of each shape ran in one process, timed against each other in " + (
            "interleaved rounds; PyTorch's in another process." if torch else "interleaved rounds."
        )
    return (
        "Each JAX implementation ran in a process of its own"
        + (" (PyTorch's in another)" if torch else "")
        + ": its ratios to the others are between processes."
    )


def _suite_title(suite: dict) -> str:
    parts = []
    if suite["tokens"]:
        parts.append(f"batch × seq = {suite['tokens']}")
    else:
        parts.append(f"batch {suite['batch_size']}")
    if suite["model_dim"]:
        parts.append(f"heads × head_dim = {suite['model_dim']}")
    else:
        parts.append(f"{suite['num_heads']} heads")
    if suite["num_kv_heads"]:
        parts.append(f"{suite['num_kv_heads']} kv heads")
    if suite["window"] is not None:
        parts.append(f"window {suite['window']}")
    parts.append(suite["dtype"])
    return f"{suite['name']} suite: " + ", ".join(parts)


def _measured_code(git: dict | None) -> str:
    """What the numbers measured: the jaxtile commit, and whether its tree was dirty."""
    if not git or not git.get("commit"):
        return "The jaxtile commit measured was not recorded."
    state = "with uncommitted changes" if git.get("dirty") else "clean tree"
    return f"jaxtile at commit `{git['commit'][:12]}` ({state})."


def render(results: dict, baselines: tuple[str, ...] = BASELINES, focus: str | None = None) -> str:
    """The Markdown section; with ``focus``, also one row per shape for that
    implementation against the baselines."""
    records = results["measurements"]
    env = results["environment"]
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if k != "jax_platform")
    lines = [
        f"Measured on **{env['device']}** on {results['date'][:10]} with `{results['command']}` ({versions}).",
        _measured_code(env.get("git")),
        "",
        "FLOPs: " + results["conventions"]["flops"],
        "`vs X` is speed relative to X on the same shape (X's time / this time; above 1 is faster);",
        "summaries are geometric means over the shapes both ran. `n/a`: not supported by that implementation.",
    ]
    if not results.get("complete", True):
        lines += ["", "**This run did not finish: its results are partial.**"]
    for suite in results["config"]["suites"]:
        rs = [r for r in records if r["suite"] == suite["name"]]
        if not rs:
            continue
        blocks = {problem: by_impl for (name, problem), by_impl in group(rs).items()}
        modes = [m for m in MODES if m in suite["modes"]]
        present = [b for b in baselines if any(r["impl"] == b and _ok(r) for r in rs)]
        lines += ["", f"### {_suite_title(suite)}", ""]
        processes = _processes(rs)
        lines += [processes, ""] if processes else []
        lines += _summary(blocks, modes, present)
        if focus is not None and not suite["stop_at_oom"]:
            lines += ["", f"`{focus}` shape by shape:", "", *_focus(blocks, focus, modes, present)]
        if suite["stop_at_oom"]:
            for mode in modes:
                lines += ["", f"Peak memory, {mode} (inputs and outputs included):", "", *_memory(rs, mode)]
        lines += ["", f"<details><summary>Every shape of the {suite['name']} suite</summary>"]
        for problem, by_impl in blocks.items():
            lines += ["", f"**{problem.describe()}**", "", *_shape(by_impl, modes, present)]
        lines += ["", "</details>"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.report", description="Markdown tables from a bench results.json.")
    p.add_argument("results", type=Path)
    p.add_argument("--baseline", action="append", metavar="NAME", help=f"repeatable; default: {', '.join(BASELINES)}")
    p.add_argument("--focus", metavar="NAME", help="also a shape-by-shape table of this implementation")
    args = p.parse_args(argv)
    results = json.loads(args.results.read_text())
    print(render(results, tuple(args.baseline or BASELINES), args.focus), end="")


if __name__ == "__main__":
    main()
