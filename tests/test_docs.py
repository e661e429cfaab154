"""The README's numbers come from committed result files, by the commands it names."""

from __future__ import annotations

import json
import re
from pathlib import Path

from bench import report

ROOT = Path(__file__).resolve().parent.parent


def test_readme_performance_tables_are_generated_from_the_results():
    results = json.loads((ROOT / "bench/results/h200/grid_fa21b15/results.json").read_text())
    readme = (ROOT / "README.md").read_text()
    section = readme.split("<!-- bench:begin -->\n")[1].split("<!-- bench:end -->")[0]
    assert section == report.render(results, focus="mosaic_v3"), (
        "regenerate with: python -m bench.report bench/results/h200/grid_fa21b15/results.json --focus mosaic_v3"
    )


def test_readme_check_table_is_generated_from_the_results():
    from bench import check

    parts = [f"bench/results/h100/check_78df639/check_part{k}.json" for k in (1, 2)]
    results = check.merge([json.loads((ROOT / part).read_text()) for part in parts])
    readme = (ROOT / "README.md").read_text()
    section = readme.split("<!-- check:begin -->\n")[1].split("<!-- check:end -->")[0]
    assert section == check.render(results), f"regenerate with: python -m bench.check --report {' '.join(parts)}"


def test_readme_parity_summary_matches_the_committed_report():
    quick = json.loads((ROOT / "parity/results/cpu/quick.json").read_text())
    readme = (ROOT / "README.md").read_text()
    passed, failed, total = re.match(
        r"(\d+) passed, (\d+) failed, \d+ not implemented, of (\d+)", quick["summary"]
    ).groups()
    assert quick["ok"] and failed == "0" and f"**{passed} of {total} passed**" in readme
