"""The forward kernel's own time (the top kernel of `bench.profile.summarise` over 20
traced calls, `next_queries/kernel_times.kernel_time`) on the rows named, jaxtile's
default and, where named with ``:tokamax``, tokamax's. Run one version per process from
the repository root with the version's directory first on PYTHONPATH; prints the
``jaxtile`` imported. Usage: python kernel_times.py OUT LABEL ROW[:tokamax] ..."""

import importlib.util
import sys
from pathlib import Path

import jaxtile
from bench import check

_spec = importlib.util.spec_from_file_location(
    "kernel_times", Path(__file__).parents[1] / "next_queries/kernel_times.py"
)
kernel_times = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernel_times)


def main():
    out, label, *rows = sys.argv[1:]
    print(label, jaxtile.__file__, flush=True)
    for row in rows:
        name, _, who = row.partition(":")
        who = who or "jaxtile"
        shape = next(s for s in check.SHAPES if s.name == name)
        attend = check._jaxtile(shape) if who == "jaxtile" else check._tokamax(shape)
        line = kernel_times.kernel_time(shape, attend, Path(out) / f"trace_{label}_{name}_{who}")
        print(f"{label:8} {name:24} {who:8}", line, flush=True)


if __name__ == "__main__":
    main()
