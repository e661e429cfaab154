"""Joins the JSON reports of one sweep run in parts (``--shard``, ``--impl``) into one.

Usage: ``python -m parity.merge OUT.json PART.json...``. The parts must be of the same
case set; each case and jaxtile implementation may appear in only one of them (a second
opinion's row, repeated by parts split by ``--impl``, is kept once). The summary is
recomputed over all rows; each part's options, date and summary are kept under ``parts``
(a merged report given as a part contributes its own parts).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import types

from parity.report import Report, Skip

_PART_KEYS = ("date", "filter", "shard", "implementations", "complete", "summary", "seconds")


def merge(documents: list[dict]) -> dict:
    """One report document from parts written by ``python -m parity --json``."""
    case_sets = {d["case_set"] for d in documents}
    if len(case_sets) != 1:
        raise ValueError(f"parts of different case sets: {sorted(case_sets)}")
    rows, seen = [], set()
    for row in (row for d in documents for row in d["rows"]):
        key = (row["case"], row["implementation"])
        if key in seen and not row["second_opinion"]:  # parts split by --impl repeat the opinions
            raise ValueError(f"{key} is in more than one part")
        if key not in seen:
            rows.append(row)
            seen.add(key)
    skipped = list({tuple(s.values()): s for d in documents for s in d["skipped_second_opinions"]}.values())
    # Report's summary reads only these attributes of a row, which the JSON rows keep.
    report = Report(
        tuple(types.SimpleNamespace(**row) for row in rows),
        tuple(Skip(**s) for s in skipped),
        sum(d["seconds"] for d in documents),
    )
    first = documents[0]
    metadata = {k: v for k, v in first.items() if k not in (*_PART_KEYS, "ok", "rows", "skipped_second_opinions")}
    return {
        **metadata,
        "complete": all(d["complete"] for d in documents),
        "implementations": list(dict.fromkeys(name for d in documents for name in d["implementations"])),
        "parts": [part for d in documents for part in d.get("parts") or [{k: d.get(k) for k in _PART_KEYS}]],
        "ok": report.ok,
        "summary": report.summary(),
        "seconds": report.seconds,
        "rows": rows,
        "skipped_second_opinions": skipped,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parity.merge", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path, help="the merged report")
    parser.add_argument("parts", type=pathlib.Path, nargs="+", help="reports of `python -m parity --json`")
    args = parser.parse_args(argv)
    try:
        document = merge([json.loads(part.read_text()) for part in args.parts])
    except ValueError as error:
        parser.error(str(error))
    args.out.write_text(json.dumps(document, indent=1, allow_nan=False) + "\n")
    print(document["summary"])
    return 0 if document["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
