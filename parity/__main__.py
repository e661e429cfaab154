"""Compares jaxtile's implementations with an independent float64 PyTorch attention.

Usage: ``python -m parity [--impl NAME]... [--quick | --full] [-k SUBSTRING] [--shard I/N] [--json PATH]``
(``python -m parity.merge`` joins the JSON reports of a sweep split with ``--shard`` or ``--impl``).

Prints one row per case and implementation (errors of out, lse, dq, dk, dv as
``rel_l2/max_err``, the tolerance, agreement with the second opinions, pass or fail,
seconds including compilation), then a summary; exits 1 if any implementation fails.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import torch
from tqdm import tqdm

from jaxtile import registry
from parity.cases import CASE_SETS, select
from parity.entries import ENTRIES
from parity.report import Report, Table, environment
from parity.run import Result, implementation_name, resolve_implementation
from parity.second_opinions import SECOND_OPINIONS
from parity.suite import run_suite


def _shard(text: str) -> tuple[int, int]:
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and 1 <= int(index) <= int(count)):
        raise argparse.ArgumentTypeError(f"{text!r} is not I/N with 1 <= I <= N")
    return int(index), int(count)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m parity", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--impl",
        action="append",
        metavar="NAME",
        help="implementation to test, repeatable: a jaxtile name, or module:function with flash_attention's "
        "signature; default: every jaxtile implementation that runs on this machine (natively or interpreted) "
        "and jaxtile's other entry points (parity.entries)",
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
    parser.add_argument(
        "--shard",
        type=_shard,
        default=(1, 1),
        metavar="I/N",
        help="only every N-th selected case, from the I-th (1-based): one of N processes of a sweep",
    )
    parser.add_argument("--json", type=pathlib.Path, metavar="PATH", help="also write the report as JSON")
    parser.add_argument(
        "--no-second-opinions", dest="second_opinions", action="store_false", help="skip torch SDPA and jax.nn"
    )
    return parser


def _runnable() -> list[str]:
    """The registered implementations that run on this machine's default platform, fastest
    first; says which were left out and why."""
    platform = jax.default_backend()
    unable = {i.name: i.unable(platform) for i in registry.implementations()}
    for reason in filter(None, unable.values()):
        print(f"left out: {reason}")
    return [name for name, reason in unable.items() if reason is None]


def _write(path: pathlib.Path, report: Report, metadata: dict, complete: bool) -> None:
    document = report.to_json(**metadata, complete=complete)
    path.write_text(json.dumps(document, indent=1, allow_nan=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        implementations = [resolve_implementation(s) for s in args.impl] if args.impl else [*_runnable(), *ENTRIES]
    except (ValueError, ImportError, AttributeError) as error:
        parser.error(f"--impl: {error}")
    index, count = args.shard
    cases = select(CASE_SETS[args.case_set], args.substring)[index - 1 :: count]
    if not cases:
        parser.error(f"no case of the {args.case_set} set contains {args.substring!r} (shard {index}/{count})")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")

    names = [implementation_name(i) for i in implementations]
    table = Table.fitting((c.name for c in cases), [*names, *(o.name for o in SECOND_OPINIONS)])
    print(f"parity --{args.case_set}: {len(cases)} cases x {', '.join(names)}; torch reference on {device}")
    print(table.header())
    options = {"case_set": args.case_set, "filter": args.substring, "shard": f"{index}/{count}"}
    metadata = {**environment(device), "torch_reference_device": device, **options, "implementations": names}
    done: list[Result] = []
    start = time.perf_counter()

    def on_result(result: Result) -> None:
        tqdm.write(table.row(result))
        done.append(result)
        if args.json is not None:  # so that a run cut short keeps what it did
            _write(args.json, Report(tuple(done), (), time.perf_counter() - start), metadata, complete=False)

    report = run_suite(
        cases, implementations, device=device, second_opinions=args.second_opinions, on_result=on_result, progress=True
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
        _write(args.json, report, metadata, complete=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
