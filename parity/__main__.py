"""Compares jaxtile's implementations with an independent float64 PyTorch attention.

Usage: ``python -m parity [--impl NAME]... [--quick | --full] [-k SUBSTRING] [--json PATH]``.

Prints one row per case and implementation (errors of out, lse, dq, dk, dv as
``rel_l2/max_err``, the tolerance, agreement with the second opinions, pass or fail,
seconds including compilation), then a summary; exits 1 if any implementation fails.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch
from tqdm import tqdm

from parity.cases import CASE_SETS, select
from parity.report import Table, environment
from parity.run import available_implementations, implementation_name, resolve_implementation
from parity.second_opinions import SECOND_OPINIONS
from parity.suite import run_suite


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m parity", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--impl",
        action="append",
        metavar="NAME",
        help="implementation to test, repeatable: a jaxtile name, or module:function with flash_attention's "
        "signature; default: every jaxtile implementation that is available",
    )
    case_set = parser.add_mutually_exclusive_group()
    case_set.add_argument("--quick", dest="case_set", action="store_const", const="quick", help="small cases (default)")
    case_set.add_argument("--full", dest="case_set", action="store_const", const="full", help="the GPU sweep")
    parser.set_defaults(case_set="quick")
    parser.add_argument(
        "-k", dest="substring", default="", metavar="SUBSTRING", help="only cases whose name contains it"
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), help="where the torch reference runs (default: cuda if torch sees one)"
    )
    parser.add_argument("--json", type=pathlib.Path, metavar="PATH", help="also write the report as JSON")
    parser.add_argument(
        "--no-second-opinions", dest="second_opinions", action="store_false", help="skip torch SDPA and jax.nn"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        implementations = [resolve_implementation(s) for s in args.impl] if args.impl else available_implementations()
    except (ValueError, ImportError, AttributeError) as error:
        parser.error(f"--impl: {error}")
    cases = select(CASE_SETS[args.case_set], args.substring)
    if not cases:
        parser.error(f"no case of the {args.case_set} set contains {args.substring!r}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")

    names = [implementation_name(i) for i in implementations]
    table = Table.fitting((c.name for c in cases), [*names, *(o.name for o in SECOND_OPINIONS)])
    print(f"parity --{args.case_set}: {len(cases)} cases x {', '.join(names)}; torch reference on {device}")
    print(table.header())
    report = run_suite(
        cases,
        implementations,
        device=device,
        second_opinions=args.second_opinions,
        on_result=lambda result: tqdm.write(table.row(result)),
        progress=True,
    )
    for title, rows in (
        ("Failures", report.failures),
        ("Disagreements with a second opinion", [r for r in report.jaxtile if r.ok and not all(r.agrees.values())]),
        ("Second opinions over tolerance (informative)", [r for r in report.second_opinions if not r.ok]),
    ):
        if rows:
            print(f"\n{title}:")
            print("\n".join(r.describe() for r in rows))
    print(f"\n{report.summary()}")
    if args.json is not None:
        options = {"case_set": args.case_set, "filter": args.substring, "implementations": names}
        document = report.to_json(**environment(device), torch_reference_device=device, **options)
        args.json.write_text(json.dumps(document, indent=1, allow_nan=False) + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
