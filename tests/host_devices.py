"""Runs a test module's ``check_*`` functions on 8 CPU host devices, in a subprocess.

``XLA_FLAGS=--xla_force_host_platform_device_count=8`` only takes effect if it is set
before JAX initialises its backend, which the test session has long done; so the checks
run in a fresh Python, a module's in one process (compiling is what costs), from one
test of that module; a module with many checks shares them out over several tests
(``part=(k, n)``: every n-th check from the k-th), which the test workers run side by side:

    @pytest.mark.parametrize("part", range(2))
    def test_on_host_devices(part):
        host_devices.assert_checks_pass(__file__, part=(part, 2))
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path

DEVICES = 8
_ROOT = Path(__file__).resolve().parent.parent


def _checks(namespace: dict) -> list[str]:
    return sorted(name for name, value in namespace.items() if name.startswith("check_") and callable(value))


def run_checks(path: str, part: tuple[int, int] = (0, 1), timeout: float = 600) -> dict[str, str]:
    """Runs the ``check_*`` functions of the module at ``path`` with 8 host devices: of
    their sorted names, every ``n``-th from the ``k``-th, ``(k, n) = part``.

    Returns ``{name: ""}`` for checks that passed and ``{name: traceback}`` otherwise.
    """
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, __file__, str(path), *map(str, part)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        raise RuntimeError(
            f"host-device checks of {path} crashed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return json.loads(lines[-1])


def collectives(hlo: str) -> dict[str, int]:
    """How many of each collective operation the compiled HLO text contains."""
    names = ("all-gather", "collective-permute", "all-to-all", "all-reduce", "reduce-scatter")
    return {name: len(re.findall(rf"\b{name}(-start)?\(", hlo)) for name in names}


def assert_checks_pass(path: str, part: tuple[int, int] = (0, 1)) -> None:
    """Runs the checks of the module at ``path`` (those of ``part``, `run_checks`); fails
    with the tracebacks of those that failed."""
    results = run_checks(path, part)
    assert results, f"{path} has no check_* functions in {part=}"
    failed = {name: trace for name, trace in results.items() if trace}
    report = "\n".join(f"--- {name} ---\n{trace}" for name, trace in failed.items())
    assert not failed, f"{len(failed)} of {len(results)} checks failed on {DEVICES} host devices:\n{report}"


def _main(path: str, k: int, n: int) -> None:
    for directory in (_ROOT, Path(path).resolve().parent):
        sys.path.insert(0, str(directory))
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    import jax

    if len(jax.devices()) != DEVICES:
        raise RuntimeError(f"expected {DEVICES} host devices, got {jax.devices()}")
    outcome = {}
    for name in _checks(vars(module))[k::n]:
        try:
            getattr(module, name)()
            outcome[name] = ""
        except Exception:
            outcome[name] = traceback.format_exc()
    print(json.dumps(outcome))


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
