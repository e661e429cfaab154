"""Runs a set of cases through implementations and second opinions: what the CLI and the
tests both call."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from tqdm import tqdm

from parity.case import Case
from parity.report import Report, Skip
from parity.run import Implementation, Problem, Result, implementation_name, jaxtile_result
from parity.second_opinions import SECOND_OPINIONS


def run_suite(
    cases: Sequence[Case],
    implementations: Sequence[Implementation],
    *,
    device: str = "cpu",
    second_opinions: bool = True,
    on_result: Callable[[Result], None] | None = None,
    progress: bool = False,
) -> Report:
    """Each case: inputs and the float64 reference once (torch on ``device``), the second
    opinions that can express it, then every implementation, compared with the reference
    and with each second opinion that is itself within tolerance of the reference.

    ``on_result`` sees each row as soon as its case is done; ``progress`` shows a bar on a
    terminal. An implementation that raises gives a failed row, not an aborted suite.
    """
    results: list[Result] = []
    skipped: list[Skip] = []
    start = time.perf_counter()
    for case in tqdm(cases, desc="parity", unit="case", disable=None if progress else True, leave=False):
        problem = Problem.create(case, device)
        opinion_rows, opinions = [], {}
        for opinion in SECOND_OPINIONS if second_opinions else ():
            if reason := opinion.unsupported(problem):
                skipped.append(Skip(case.name, opinion.name, reason))
                continue
            row, values = problem.attempt(opinion.name, opinion.run, problem, device, second_opinion=True)
            opinion_rows.append(row)
            if row.ok:  # agreeing with an opinion that is off the reference would mean nothing
                opinions[opinion.name] = values
        rows = []
        for implementation in implementations:
            name = implementation_name(implementation)
            row, values = problem.attempt(name, jaxtile_result, case, problem.arrays, implementation)
            if values is not None:
                agrees = {name: problem.agrees(values, other) for name, other in opinions.items()}
                row = dataclasses.replace(row, agrees=agrees)
            rows.append(row)
        for row in rows + opinion_rows:
            results.append(row)
            if on_result is not None:
                on_result(row)
    return Report(tuple(results), tuple(skipped), time.perf_counter() - start)
