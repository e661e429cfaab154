"""The terminal table: one block per problem, one row per implementation, and each mode's
time, throughput and peak memory side by side. Also the formatting shared with the
Markdown report."""

from __future__ import annotations

from bench import catalog
from bench.suites import MODES, Problem

_STATUS = {"oom": "OOM", "unsupported": "n/a", "error": "error", "timeout": "timeout", "skipped": "skipped"}


def problem_of(record: dict) -> Problem:
    return Problem.from_dict(record)


def status_text(record: dict) -> str:
    return _STATUS[record["status"]]


def gib(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def time_cell(record: dict | None) -> str:
    """``"1.23 ±4%"`` (median and half the spread), or the status of a failed run."""
    if record is None:
        return ""
    if record["status"] != "ok":
        return _STATUS[record["status"]]
    spread = (record["ms_hi"] - record["ms_lo"]) / 2 / record["ms"] * 100
    return f"{record['ms']:.4g} ±{spread:.0f}%"


def tflops_cell(record: dict | None) -> str:
    return f"{record['tflops']:.3g}" if record and record["status"] == "ok" else ""


def memory_cell(record: dict | None) -> str:
    """Peak bytes; ``≤`` marks an upper bound (a JAX peak below an earlier high-water mark)."""
    if record is None or record["status"] != "ok" or record["peak_bytes"] is None:
        return ""
    return ("" if record["peak_exact"] else "≤") + gib(record["peak_bytes"])


def group(records: list[dict]) -> dict[tuple, dict[str, dict[str, dict]]]:
    """``{(suite, problem): {impl: {mode: record}}}`` in the records' order."""
    blocks: dict[tuple, dict[str, dict[str, dict]]] = {}
    for r in records:
        blocks.setdefault((r["suite"], problem_of(r)), {}).setdefault(r["impl"], {})[r["mode"]] = r
    return blocks


def _format(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def render(records: list[dict]) -> str:
    """The whole table, one block per (suite, problem)."""
    out = []
    for (suite, problem), impls in group(records).items():
        modes = [m for m in MODES if any(m in by_mode for by_mode in impls.values())]
        header = ["implementation"]
        for mode in modes:
            header += [f"{mode} ms", f"{mode} TFLOP/s", f"{mode} peak"]
        header.append("compile s")
        rows = [header]
        for impl in catalog.order(impls):
            by_mode = impls[impl]
            row = [impl]
            for mode in modes:
                r = by_mode.get(mode)
                row += [time_cell(r), tflops_cell(r), memory_cell(r)]
            compile_s = [
                f"{by_mode[m]['compile_s']:.1f}" for m in modes if m in by_mode and by_mode[m]["compile_s"] is not None
            ]
            row.append("/".join(compile_s))
            rows.append(row)
        out += [f"[{suite}] {problem.describe()}", *_format(rows), ""]
    return "\n".join(out)


def live_row(record: dict) -> str:
    """One line per finished measurement, printed while the run goes on."""
    p = problem_of(record)
    shape = f"B{p.batch} T{p.seq_len} N{p.num_heads}/{p.num_kv_heads} H{p.head_dim}{' causal' if p.causal else ''}"
    if record["status"] == "ok":
        result = f"{time_cell(record):>14} ms {tflops_cell(record):>7} TFLOP/s {memory_cell(record):>11}"
    else:
        result = f"{_STATUS[record['status']]}: {record['error'] or ''}"[:100]
    return f"{record['suite']:8} {record['impl']:15} {record['mode']:6} {shape:32} {result}"
