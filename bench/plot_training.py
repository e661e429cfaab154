"""Loss vs step of each backend of an ``examples/train_gpt.py`` run, tokens/s and peak
memory in the legend, ``ln(vocab)`` (the loss without copying) dotted (matplotlib, Agg
backend).

    python -m bench.plot_training results.json --out curve.png
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def label(name: str, run: dict) -> str:
    """``backend: tokens/s, peak memory`` (or the backend's error)."""
    if "error" in run:
        return f"{name}: {run['error']}"
    peak = run["peak_bytes"]
    memory = f"{peak / 2**30:.2f} GiB" if peak >= 2**30 else f"{peak / 2**20:.2f} MiB"
    return f"{name}: {run['tokens_per_s']:,.0f} tokens/s, peak {memory}"


def plot(result: dict, out: str | Path) -> None:
    """Draws ``result`` (train_gpt.py's JSON) to the image ``out``."""
    s = result["settings"]
    fig, ax = plt.subplots(figsize=(8, 5), layout="constrained")
    for (name, run), style in zip(result["runs"].items(), itertools.cycle(["-", "--", ":", "-."])):
        ax.plot(run.get("loss", []), style, label=label(name, run), linewidth=1.2)
    chance = math.log(s["vocab"])
    ax.axhline(chance, color="grey", linestyle=":", linewidth=1, label=f"ln(vocab) = {chance:.2f}: no copying")
    runs = [run for run in result["runs"].values() if "error" not in run]
    device = runs[0]["device_kind"] if runs else "?"
    model = "plain (no sinks or documents)" if s["plain"] else "sinks, packed documents"
    ax.set_title(
        f"{device}, jax {result['jax_version']}, commit {result['git']['commit'][:7]}\n"
        f"{s['layers']} layers, d_model {s['d_model']}, batch {s['batch']} x seq {s['seq_len']}, {s['dtype']}; {model}",
        fontsize=9,
    )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (copied tokens)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="train_gpt.py's --out JSON")
    parser.add_argument("--out", default="curve.png")
    args = parser.parse_args(argv)
    plot(json.loads(Path(args.results).read_text()), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
