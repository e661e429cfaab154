"""The suite's results: a table for people, a summary line, and a JSON document."""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import math
import platform
from collections.abc import Iterable

import jax
import torch

from bench.probe import git_state
from parity.compare import Error
from parity.run import QUANTITIES, Result

_ERRORS_WIDTH = 13 * len(QUANTITIES) - 1  # a 12-character cell per quantity
_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


@dataclasses.dataclass(frozen=True)
class Skip:
    """A second opinion that cannot express a case, and why."""

    case: str
    opinion: str
    reason: str


def _cell(error: Error | None) -> str:
    """``rel_l2/max_err``, ``!`` when over tolerance."""
    if error is None:
        return "-"
    text = "finite" if math.isnan(error.rel_l2) else f"{error.rel_l2:.0e}/{error.max_err:.0e}"
    return text if error.ok else text + "!"


@dataclasses.dataclass(frozen=True)
class Table:
    """Fixed-width rows, printable one by one as results arrive."""

    case_width: int
    implementation_width: int

    @classmethod
    def fitting(cls, case_names: Iterable[str], implementation_names: Iterable[str]) -> Table:
        return cls(max(map(len, case_names), default=4), max(map(len, implementation_names), default=4))

    def _line(self, case, implementation, dtype, cells, tol, agrees, status, seconds) -> str:
        columns = [f"{case:{self.case_width}}", f"{implementation:{self.implementation_width}}", f"{dtype:5}"]
        columns.append(" ".join(f"{cell:12}" for cell in cells).ljust(_ERRORS_WIDTH))
        columns += [f"{tol:15}", f"{agrees:20}", f"{status:4}", f"{seconds:>7}"]
        return " ".join(columns).rstrip()

    def header(self) -> str:
        cells = [f"{name} l2/max" for name in QUANTITIES]
        return self._line("case", "impl", "dtype", cells, "tol l2/max", "agrees with", "", "time")

    def row(self, result: Result) -> str:
        cells = [_cell(result.errors.get(name)) for name in QUANTITIES]
        if result.raised:  # the message's first line, over the error columns
            cells = [f"{result.raised.splitlines()[0]:.{_ERRORS_WIDTH}}"]
        tol = f"{result.tolerance.rel_l2:.1e}/{result.tolerance.max_err:.1e}"
        if result.unsupported:
            status = "n/i"
        elif result.second_opinion:
            status = "ok" if result.ok else "over"
        else:
            status = "PASS" if result.ok else "FAIL"
        agrees = " ".join(f"{name.split('.')[0]}:{'ok' if ok else 'NO'}" for name, ok in result.agrees.items())
        dtype = _DTYPES[result.case.dtype]
        return self._line(
            result.case.name, result.implementation, dtype, cells, tol, agrees or "-", status, f"{result.seconds:.2f}s"
        )


def environment(torch_device: str) -> dict:
    """Versions and devices, for the JSON report."""
    jax_device = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "jax_backend": jax.default_backend(),
        "jax_device": jax_device.device_kind,
        "torch_device": torch.cuda.get_device_name() if torch_device == "cuda" else platform.processor() or "cpu",
        "git": git_state(),
    }


def _tally(results: Iterable[Result]) -> str:
    """``"name passed/total, ..."`` per implementation."""
    counts: dict[str, list[int]] = {}
    for r in results:
        count = counts.setdefault(r.implementation, [0, 0])
        count[0] += r.ok
        count[1] += 1
    return ", ".join(f"{name} {good}/{total}" for name, (good, total) in counts.items())


def _number(x: float) -> float | None:
    """JSON has no NaN or Inf: None (an error's ``note`` says why)."""
    return x if math.isfinite(x) else None


@dataclasses.dataclass(frozen=True)
class Report:
    results: tuple[Result, ...]
    skipped: tuple[Skip, ...]
    seconds: float

    @property
    def jaxtile(self) -> tuple[Result, ...]:
        return tuple(r for r in self.results if not r.second_opinion)

    @property
    def second_opinions(self) -> tuple[Result, ...]:
        return tuple(r for r in self.results if r.second_opinion)

    @property
    def failures(self) -> tuple[Result, ...]:
        """jaxtile rows over tolerance or raising (a ``NotImplementedError`` is no failure)."""
        return tuple(r for r in self.jaxtile if not (r.ok or r.unsupported))

    @property
    def ok(self) -> bool:
        """Whether no jaxtile row failed (second opinions only inform)."""
        return not self.failures

    def summary(self) -> str:
        rows = self.jaxtile
        passed, failed = sum(r.ok for r in rows), len(self.failures)
        counts = f"{passed} passed, {failed} failed, {len(rows) - passed - failed} not implemented, of {len(rows)}"
        parts = [counts + (f" ({_tally(rows)})" if rows else "")]
        if self.second_opinions or self.skipped:
            within = _tally(self.second_opinions) or "none ran"
            parts.append(f"second opinions within tolerance of the reference: {within} ({len(self.skipped)} skipped)")
            agreements = [ok for r in rows for ok in r.agrees.values()]
            parts.append(f"jaxtile agrees with them {sum(agreements)}/{len(agreements)}")
        parts.append(f"{self.seconds:.1f} s")
        return " | ".join(parts)

    def to_json(self, **metadata) -> dict:
        """``metadata`` (e.g. `environment` and the command's options), then every row."""

        def row(r: Result) -> dict:
            return {
                "case": r.case.name,
                "implementation": r.implementation,
                "second_opinion": r.second_opinion,
                "dtype": r.case.dtype,
                "ok": r.ok,
                "seconds": r.seconds,
                "tolerance": dataclasses.asdict(r.tolerance),
                "errors": {
                    name: {"rel_l2": _number(e.rel_l2), "max_err": _number(e.max_err), "ok": e.ok, "note": e.note}
                    for name, e in r.errors.items()
                },
                "agrees": r.agrees,
                "raised": r.raised,
                "unsupported": r.unsupported,
                "config": dataclasses.asdict(r.case),
            }

        return {
            **metadata,
            "ok": self.ok,
            "summary": self.summary(),
            "seconds": self.seconds,
            "rows": [row(r) for r in self.results],
            "skipped_second_opinions": [dataclasses.asdict(s) for s in self.skipped],
        }
