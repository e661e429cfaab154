"""Times two versions of jaxtile against each other, each in its own process and directory.

``python -m`` puts the working directory at the front of ``sys.path``, ahead of
``PYTHONPATH``: ``PYTHONPATH=old:. python -m bench`` imports ``./jaxtile`` whatever
``old`` holds. So each version here gets a directory of its own holding its ``jaxtile``
package beside this tree's ``bench`` (the same harness for both), and `bench.check` runs
with that directory as its working directory; each prints the ``jaxtile.__file__`` it
imported and times cuDNN in the same process, as a yardstick that shows whether the
GPU, not the code, changed between the two runs::

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
    comparison = []
    print(f"\n{'case':<28} {'mode':<6} {'A ms':>8} {'B ms':>8} {'B speed / A':>11} {'A cuDNN':>8} {'B cuDNN':>8}")
    for key in [key for key in a if key in b]:
        mine_a, mine_b = a[key]["jaxtile"].get("ms"), b[key]["jaxtile"].get("ms")
        cudnn_a, cudnn_b = a[key].get("cudnn", {}).get("ms"), b[key].get("cudnn", {}).get("ms")
        speedup = mine_a / mine_b if mine_a and mine_b else None
        comparison.append(
            dict(
                case=key[0],
                mode=key[1],
                a_ms=mine_a,
                b_ms=mine_b,
                speedup=speedup,
                a_cudnn_ms=cudnn_a,
                b_cudnn_ms=cudnn_b,
            )
        )

        def fmt(x, spec=".3f"):
            return "-" if x is None else format(x, spec)

        print(
            f"{key[0]:<28} {key[1]:<6} {fmt(mine_a):>8} {fmt(mine_b):>8} {fmt(speedup, '.2f'):>11} "
            f"{fmt(cudnn_a):>8} {fmt(cudnn_b):>8}"
        )
    for label, run in zip("AB", runs):
        print(f"{label} imported {run['environment']['git']['jaxtile_file']}")
    if args.out:
        args.out.write_text(json.dumps(dict(runs=runs, comparison=comparison), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
