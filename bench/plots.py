"""PNG plots of a run (matplotlib, Agg backend).

* ``time.png``: time per call vs sequence length, one panel per problem family and mode.
* ``tflops.png``: TFLOP/s vs sequence length, the same panels.
* ``memory.png``: peak memory vs sequence length on a log scale (the memory suite when
  there is one); an ``x`` at the top of a panel marks an out-of-memory run.
* ``dashboard.png``: one page with the headline panels, the memory panel and the
  throughput of every implementation at the longest sequence.
* ``v1_vs_v2.png``: TFLOP/s of FlashAttention-1's and -2's loop orders alone, as scan
  and as Pallas kernels (when the run has both kernels).

Colours are fixed per implementation; jaxtile's are solid lines, JAX peers dashed and
PyTorch peers dotted.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.transforms import blended_transform_factory

from bench import catalog
from bench.suites import MODES
from bench.table import gib, status_text
from jaxtile import registry

_COLOURS = {
    "mosaic_v3": "#0b2a5b",
    "pallas_v2": "#1f4e9c",
    "pallas_v1": "#4fa3e0",
    "scan_v2": "#2b8a3e",
    "scan_v1": "#8fd19e",
    "reference": "#8c564b",  # registered implementations not named here are drawn black
    "jax.cudnn": "#d62728",
    "pallas.mha": "#9467bd",
    "tokamax.mosaic": "#17becf",
    "jax.xla": "#f28e8e",
    "torch.flash": "#ff7f0e",
    "torch.cudnn": "#e377c2",
    "torch.efficient": "#bcbd22",
    "torch.math": "#7f7f7f",
}
_LINE = {"jaxtile": ("-", "o"), "jax": ("--", "s"), "torch": (":", "^")}
_MODE = {"fwd": "forward", "fwdbwd": "forward + backward"}
_METRIC = {
    "ms": ("time per call (ms, log scale)", "Time per call (lower is better)"),
    "tflops": ("TFLOP/s", "Throughput (higher is better)"),
    "peak_bytes": ("peak memory (log scale)", "Peak memory (lower is better)"),
}
FILES = ("time.png", "tflops.png", "memory.png", "dashboard.png")


def _style(impl: str) -> dict:
    line, marker = _LINE[catalog.framework(impl)]
    return dict(
        color=_COLOURS.get(impl, "black"),
        linestyle=line,
        marker=marker,
        linewidth=2.2 if impl in _COLOURS and catalog.framework(impl) == "jaxtile" else 1.6,
    )


def _family(r: dict) -> tuple:
    """What stays fixed along a line: all but the sequence length (and a batch that moves with it)."""
    window = tuple(r["window"]) if r["window"] else None
    return (r["suite"], r["head_dim"], r["num_heads"], r["num_kv_heads"], r["causal"], window, r["dtype"])


def _panels(records: list[dict], suites=None, modes=None) -> list[tuple[tuple, str, list[dict]]]:
    """``(family, mode, records)`` for each panel, in the records' order."""
    panels: dict[tuple, list[dict]] = {}
    for r in records:
        if (suites is None or r["suite"] in suites) and (modes is None or r["mode"] in modes):
            panels.setdefault((_family(r), r["mode"]), []).append(r)
    return [(family, mode, rs) for (family, mode), rs in panels.items()]


def _title(family: tuple, mode: str, records: list[dict]) -> str:
    suite, head_dim, heads, kv_heads, causal, window, dtype = family
    mask = ("causal" if causal else "non-causal") + (f", window {window}" if window else "")
    heads_text = f"{heads} heads" + (f" ({kv_heads} kv)" if kv_heads != heads else "")
    tokens = {r["batch"] * r["seq_len"] for r in records}
    batches = {r["batch"] for r in records}
    batch = (
        f"batch {batches.pop()}"
        if len(batches) == 1
        else f"batch × seq = {tokens.pop()}"
        if len(tokens) == 1
        else "batch varies"
    )
    return f"{_MODE[mode]} · head_dim {head_dim} · {mask}\n[{suite}] {heads_text}, {batch}, {dtype}"


def _seq_label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _draw(ax, records: list[dict], metric: str, title: str) -> None:
    seqs = sorted({r["seq_len"] for r in records})
    top = blended_transform_factory(ax.transData, ax.transAxes)
    for impl in catalog.order(r["impl"] for r in records):
        rs = sorted((r for r in records if r["impl"] == impl), key=lambda r: r["seq_len"])
        ok = [r for r in rs if r["status"] == "ok" and r[metric] is not None]
        style = _style(impl)
        if ok:
            ys = [r[metric] for r in ok]
            ax.plot([r["seq_len"] for r in ok], ys, label=impl, markersize=5, **style)
            if metric == "peak_bytes":  # hollow markers: upper bounds
                bounds = [(r["seq_len"], y) for r, y in zip(ok, ys) if not r["peak_exact"]]
                if bounds:
                    ax.scatter(*zip(*bounds), s=60, facecolors="white", edgecolors=style["color"], zorder=3)
        for r in rs:
            if r["status"] == "oom":
                ax.plot([r["seq_len"]], [0.97], transform=top, marker="x", markersize=9, color=style["color"], mew=2.5)
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqs, [_seq_label(s) for s in seqs])
    ax.minorticks_off()
    if metric == "ms":
        ax.set_yscale("log")
    elif metric == "peak_bytes":
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_formatter(lambda y, _: gib(y))
    else:
        ax.set_ylim(bottom=0)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel(_METRIC[metric][0])
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)


def _legend(fig, axes, extra: list[Line2D], *, right: bool = False) -> None:
    """One legend for the figure: beneath the panels, or on the right of a single one."""
    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    labels = catalog.order(handles)
    fig.legend(
        [handles[label] for label in labels] + extra,
        labels + [h.get_label() for h in extra],
        loc="outside right center" if right else "outside lower center",
        ncol=1 if right else min(7, len(labels) + len(extra)),
        frameon=False,
    )


def _markers(records: list[dict], metric: str) -> list[Line2D]:
    extra = []
    if any(r["status"] == "oom" for r in records):
        extra.append(Line2D([], [], color="black", marker="x", linestyle="none", mew=2, label="out of memory"))
    if metric == "peak_bytes" and any(r["status"] == "ok" and r["peak_exact"] is False for r in records):
        extra.append(
            Line2D([], [], color="black", marker="o", markerfacecolor="white", linestyle="none", label="upper bound")
        )
    return extra


def _grid_figure(panels, metric: str, headline: str, path: Path) -> None:
    """Up to four panels a row (4.6 × 3.9 inches each; 7 × 4.5 alone, legend beside)."""
    n = len(panels)
    cols = min(4, n)
    rows = math.ceil(n / cols)
    size = (9.6, 5.2) if n == 1 else (4.6 * cols, 3.9 * rows + 1.6)
    fig, axes = plt.subplots(rows, cols, figsize=size, squeeze=False, layout="constrained")
    used = []
    for ax, (family, mode, rs) in zip(axes.flat, panels):
        _draw(ax, rs, metric, _title(family, mode, rs))
        used.append(ax)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    _legend(fig, used, _markers([r for _, _, rs in panels for r in rs], metric), right=n == 1)
    fig.suptitle(f"{_METRIC[metric][1]}\n{headline}", fontsize=12, fontweight="bold")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _headline(results: dict) -> str:
    env = results["environment"]
    v = env["versions"]
    parts = [f"jax {v.get('jax')}"] + [f"{k} {v[k]}" for k in ("torch", "triton") if k in v]
    cuda = next((v[k] for k in ("jax-cuda13-plugin", "jax-cuda12-plugin") if k in v), None)
    if cuda:
        parts.append(f"CUDA plugin {cuda}")
    return f"{env['device']} · {results['date'][:10]} · " + " · ".join(parts)


def _memory_panels(records: list[dict]):
    memory = [p for p in _panels(records, suites={"memory"}) if any(r["peak_bytes"] for r in p[2])]
    return memory or [p for p in _panels(records) if any(r["peak_bytes"] for r in p[2])]


def _bars(ax, panels) -> None:
    """TFLOP/s of every implementation at the longest sequence, one bar per mode."""
    width = 0.8 / max(1, len(panels))
    impls = catalog.order(r["impl"] for _, _, rs in panels for r in rs)
    for i, (_, _, rs) in enumerate(panels):
        seq = max(r["seq_len"] for r in rs)
        by_impl = {r["impl"]: r for r in rs if r["seq_len"] == seq}
        for j, impl in enumerate(impls):
            r = by_impl.get(impl)
            x = j + (i - (len(panels) - 1) / 2) * width
            if r and r["status"] == "ok":
                ax.bar(x, r["tflops"], width, color=_COLOURS.get(impl, "black"), alpha=1.0 if i == 0 else 0.55)
            elif r:
                ax.text(x, 0, " " + status_text(r), rotation=90, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(impls)), impls, rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("TFLOP/s")
    family = panels[0][0]
    modes = " / ".join(f"{_MODE[m]}{' (faded)' if i else ''}" for i, (_, m, _) in enumerate(panels))
    ax.set_title(
        f"At the longest sequence: {modes}\nhead_dim {family[1]}, {'causal' if family[4] else 'non-causal'}",
        fontsize=10,
    )
    ax.grid(True, axis="y", alpha=0.3)


def _dashboard(results: dict, records: list[dict], path: Path) -> None:
    """TFLOP/s of the main suite's largest head_dim (rows: modes, columns: masks; with a
    single row, time per call beneath it), peak memory, and the longest sequence's bars."""
    suites = list(dict.fromkeys(r["suite"] for r in records))
    main = "standard" if "standard" in suites else suites[0]
    panels = _panels(records, suites={main})
    head_dim = max(family[1] for family, _, _ in panels)
    heroes = [p for p in panels if p[0][1] == head_dim]
    families = list(dict.fromkeys(family for family, _, _ in heroes))[:2]
    modes = [m for m in MODES if any(mode == m for _, mode, _ in heroes)]
    heroes = [p for p in heroes if p[0] in families]
    fig = plt.figure(figsize=(19, 10.5), layout="constrained")
    grid = fig.add_gridspec(2, 3)
    used = []
    cells = [(family, mode) for mode in modes for family in families]
    one_row = len(cells) <= 2
    for family, mode, rs in heroes:
        k = cells.index((family, mode))
        for row, metric in ((0, "tflops"), (1, "ms")) if one_row else ((k // 2, "tflops"),):
            ax = fig.add_subplot(grid[row, k % 2])
            _draw(ax, rs, metric, _title(family, mode, rs))
            used.append(ax)
    memory = _memory_panels(records)
    if memory:
        ax = fig.add_subplot(grid[0, 2])
        family, mode, rs = memory[0]
        _draw(ax, rs, "peak_bytes", "Peak memory · " + _title(family, mode, rs))
        used.append(ax)
    _bars(fig.add_subplot(grid[1, 2]), [p for p in heroes if p[0] == families[0]])
    _legend(fig, used, _markers(records, "peak_bytes"))
    fig.suptitle(f"jaxtile attention benchmark\n{_headline(results)}", fontsize=14, fontweight="bold")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _loop_orders(records: list[dict]) -> list[dict]:
    """The jaxtile implementations of FlashAttention-1 and -2 (outside the memory suite),
    if both loop orders ran in one family."""
    algorithms = {"FlashAttention-1", "FlashAttention-2"}
    by_family: dict[str, set[str]] = {}
    for name in {r["impl"] for r in records} & set(registry.names()):
        implementation = registry.get(name)
        if implementation.algorithm in algorithms:
            by_family.setdefault(implementation.family, set()).add(implementation.algorithm)
    if not any(found == algorithms for found in by_family.values()):
        return []
    chosen = {n for n in registry.names() if registry.get(n).algorithm in algorithms}
    return [r for r in records if r["impl"] in chosen and r["suite"] != "memory"]


def write(results: dict, save_dir: Path) -> list[Path]:
    """Writes the PNGs into ``save_dir``; returns their paths."""
    records = results["measurements"]
    headline = _headline(results)
    paths = [save_dir / name for name in FILES]
    panels = _panels(records)
    _grid_figure(panels, "ms", headline, paths[0])
    _grid_figure(panels, "tflops", headline, paths[1])
    memory = _memory_panels(records)
    if memory:
        _grid_figure(memory, "peak_bytes", headline, paths[2])
    else:
        paths.remove(paths[2])
    _dashboard(results, records, paths[-1])
    loop_orders = _loop_orders(records)
    if loop_orders:
        paths.append(save_dir / "v1_vs_v2.png")
        _grid_figure(_panels(loop_orders), "tflops", headline, paths[-1])
    return paths
