"""Times two versions of jaxtile against each other, each in its own process and directory.

``python -m`` puts the working directory at the front of ``sys.path``, ahead of
``PYTHONPATH``: ``PYTHONPATH=old:. python -m bench`` imports ``./jaxtile`` whatever
``old`` holds. So each version here gets a directory of its own holding its ``jaxtile``
package beside this tree's ``bench`` (the same harness for both), and `bench.check` runs
with that directory as its working directory; each prints the ``jaxtile.__file__`` it
imported and times cuDNN in the same process (interleaved with jaxtile, `bench.check`),
as a yardstick that shows whether the GPU, not the code, changed between the two runs.
Beside B's speed over A's, the table prints it measured against each run's cuDNN (B's
ratio to cuDNN over A's), which leaves such a change out::

    python -m bench.ab c96bff7 HEAD --only d128_4k --modes fwd     # git refs
    python -m bench.ab /path/to/old /path/to/new                    # directories holding jaxtile/

A version is a git ref of this repository or a directory that contains ``jaxtile/``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _materialise(version: str, into: Path) -> dict:
    """``into/jaxtile`` from ``version`` and ``into/bench`` from this tree; returns what
    the version is (written to ``into/VERSION.json``, which `bench.check` reports)."""
    into.mkdir(parents=True)
    source = Path(version)
    if (source / "jaxtile").is_dir():
        shutil.copytree(source / "jaxtile", into / "jaxtile")
        stamp = source / "VERSION.json"  # `bench.probe --stamp`'s, where the directory has one
        described = dict(version=version, commit=None) | (json.loads(stamp.read_text()) if stamp.exists() else {})
    else:
        commit = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", version], capture_output=True, text=True, check=True
        ).stdout.strip()
        archive = subprocess.run(["git", "-C", ROOT, "archive", commit, "jaxtile"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)
        described = dict(version=version, commit=commit)
    shutil.copytree(ROOT / "bench", into / "bench", ignore=shutil.ignore_patterns("results", "__pycache__"))
    (into / "VERSION.json").write_text(json.dumps(described))
    return described


def _compare(a: dict, b: dict) -> dict:
    """One row of both runs: B's speed over A's (``speedup``, A's time over B's), and the
    same measured against each process's cuDNN (``speedup_vs_cudnn``: B's ratio to cuDNN
    over A's), which leaves out what changed between the two processes on the GPU's side
    (None where a number is missing)."""
    mine_a, mine_b = a["jaxtile"].get("ms"), b["jaxtile"].get("ms")
    cudnn_a, cudnn_b = a.get("cudnn", {}).get("ms"), b.get("cudnn", {}).get("ms")
    speedup = mine_a / mine_b if mine_a and mine_b else None
    yardstick = cudnn_a and cudnn_b and speedup is not None
    return dict(
        case=a["case"],
        mode=a["mode"],
        a_ms=mine_a,
        b_ms=mine_b,
        speedup=speedup,
        a_cudnn_ms=cudnn_a,
        b_cudnn_ms=cudnn_b,
        speedup_vs_cudnn=speedup * cudnn_b / cudnn_a if yardstick else None,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs=2, metavar="VERSION", help="git refs or directories holding jaxtile/")
    parser.add_argument("--out", type=Path, help="write both runs and the comparison as JSON")
    args, check_args = parser.parse_known_args(argv)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, version in zip("AB", args.versions):
            where = Path(tmp) / label
            described = _materialise(version, where)
            print(f"== {label}: {version} ({described['commit'] or 'directory'})", flush=True)
            out = where / "check.json"
            command = [sys.executable, "-m", "bench.check", "--out", str(out), *check_args]
            subprocess.run(command, cwd=where, check=False)
            if not out.exists():
                parser.exit(2, f"version {version} produced no results\n")
            runs.append(dict(described, **json.loads(out.read_text())))
    a, b = ({(r["case"], r["mode"]): r for r in run["rows"]} for run in runs)
    comparison = [_compare(a[key], b[key]) for key in a if key in b]
    print(
        f"\n{'case':<28} {'mode':<6} {'A ms':>8} {'B ms':>8} {'B / A':>6} {'A cuDNN':>8} {'B cuDNN':>8} {'vs cuDNN':>8}"
    )
    for row in comparison:
        ms = {
            key: "-" if row[key] is None else f"{row[key]:.3f}" for key in ("a_ms", "b_ms", "a_cudnn_ms", "b_cudnn_ms")
        }
        ratios = {key: "-" if row[key] is None else f"{row[key]:.2f}" for key in ("speedup", "speedup_vs_cudnn")}
        print(
            f"{row['case']:<28} {row['mode']:<6} {ms['a_ms']:>8} {ms['b_ms']:>8} {ratios['speedup']:>6} "
            f"{ms['a_cudnn_ms']:>8} {ms['b_cudnn_ms']:>8} {ratios['speedup_vs_cudnn']:>8}"
        )
    for label, run in zip("AB", runs):
        print(f"{label} imported {run['environment']['git']['jaxtile_file']}")
    if args.out:
        args.out.write_text(json.dumps(dict(runs=runs, comparison=comparison), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
