"""``python -m bench``: time jaxtile and its peers; write results.json, a table and plots.

Examples::

    python -m bench --quick                                   # a tiny CPU run, about a minute
    python -m bench --preset full --save-dir bench/results/h100   # the standard grid and the memory sweep
    python -m bench --seq-lens 1024 4096 --head-dim 128 --num-heads 16 --causal --impl pallas_v2 --impl torch.flash

Options given with a preset replace the preset's own values (``--preset memory
--max-seq-len 4096`` sweeps up to 4096).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from bench import catalog, plots, runner, table
from bench.suites import CUSTOM, DTYPES, MODES, PRESETS, QUICK, Suite

_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
CONVENTIONS = {
    "flops": "4·batch·heads·seq²·head_dim forward (query heads for GQA), halved when causal; a sliding window "
    "counts its visible (query, key) pairs exactly; forward+backward is 3.5× forward (backward = 2.5× forward).",
    "timing": "jax: compiled once (compile_s) and a first call (read for memory); the implementations of one "
    "problem and mode, on the same inputs in one process, timed against each other: two warm-up calls each, then "
    "up to ten rounds (at least three) of one batch of every call in turn, batches of up to 20 calls sized so that "
    "a call's batches take about budget_s, each ending in one block_until_ready; median and spread (ms_lo..ms_hi) "
    "of a call's batches. On a GPU a memory sweep (stop_at_oom) runs each implementation in its own process "
    "instead, timed alone: batches of up to 20 calls, up to five sized to budget_s (a call slower than half the "
    "budget is timed once more and its warm-up call is the second sample). The timer field says which. torch on "
    "CUDA: triton.testing.do_bench(warmup=50, rep=300), median and 20th..80th percentiles; torch compile_s is its "
    "first call.",
    "memory": "GPU: peak bytes in use during the first call, inputs and outputs included (torch: "
    "max_memory_allocated after reset_peak_memory_stats; jax, in memory sweeps, where each implementation has its "
    "own process: the allocator's peak_bytes_in_use, peak_exact=false when it stayed below an earlier high-water "
    "mark, so the value is an upper bound). Elsewhere, and jax outside memory sweeps (peak_source=compiled): the "
    "compiled program's arguments + outputs + temporaries.",
}


def _window(text: str) -> int | tuple[int, int]:
    if "," in text:
        left, right = (int(x) for x in text.split(","))
        return (left, right)
    return int(text)


def _dtype(text: str) -> str:
    name = _DTYPE_ALIASES.get(text, text)
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"dtype {text!r} is not one of {DTYPES}")
    return name


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Time jaxtile's attention and its peers; write results.json, a table and plots.",
    )
    p.add_argument(
        "--preset",
        nargs="?",
        const="standard",
        choices=sorted(PRESETS),
        help="standard grid (the default when given without a value), FlashTile's memory sweep, or both (full)",
    )
    p.add_argument(
        "--quick", action="store_true", help="both presets in miniature, float32: a CPU runs it in about a minute"
    )
    shape = p.add_argument_group("shape (replace the preset's values)")
    shape.add_argument("--seq-lens", type=int, nargs="+", metavar="N", help="sequence lengths (queries and keys)")
    shape.add_argument(
        "--max-seq-len",
        type=int,
        metavar="N",
        help="drop longer sequence lengths (without a preset: powers of two from 512 up to N)",
    )
    batch = shape.add_mutually_exclusive_group()
    batch.add_argument("--batch-size", type=int, metavar="B")
    batch.add_argument("--tokens", type=int, metavar="N", help="batch = N // seq_len: batch × seq held constant")
    heads = shape.add_mutually_exclusive_group()
    heads.add_argument("--num-heads", type=int, metavar="H")
    heads.add_argument("--model-dim", type=int, metavar="D", help="heads = D // head_dim")
    shape.add_argument("--num-kv-heads", type=int, metavar="H", help="grouped-query attention: key/value heads")
    shape.add_argument("--head-dim", type=int, nargs="+", metavar="D")
    shape.add_argument("--causal", action="store_true", help="causal masking (with --non-causal: both)")
    shape.add_argument("--non-causal", action="store_true", help="no causal masking (with --causal: both)")
    shape.add_argument(
        "--window",
        type=_window,
        metavar="W|L,R",
        help="sliding window: W keys as FlashTile's window_size (causal: (W-1, 0), else (W//2, W//2)), or jaxtile's LEFT,RIGHT",
    )
    shape.add_argument("--dtype", type=_dtype, metavar="|".join(DTYPES))
    shape.add_argument("--mode", choices=(*MODES, "both"))
    run = p.add_argument_group("run")
    run.add_argument(
        "--impl",
        action="append",
        metavar="NAME",
        help="repeatable; jaxtile names (pallas_v2, scan_v2, ...) and peers: "
        + ", ".join(catalog.PEERS)
        + ". Default: all that run here",
    )
    run.add_argument(
        "--save-dir",
        type=Path,
        default=Path("out/bench"),
        metavar="DIR",
        help="where results.json, bench.log and the plots go (default: %(default)s)",
    )
    run.add_argument("--no-plots", action="store_true")
    run.add_argument(
        "--budget",
        type=float,
        metavar="S",
        help="seconds of timed calls per measurement (default 0.5 on a GPU, 0.2 elsewhere)",
    )
    run.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="kill a measurement after S seconds (default %(default)s)",
    )
    run.add_argument(
        "--max-minutes",
        type=float,
        metavar="M",
        help="skip what is left after M minutes (default: 2.5 with --quick, 8 with --preset, else none)",
    )
    run.add_argument("--seed", type=int, default=0)
    return p


def suites(args: argparse.Namespace) -> list[Suite]:
    """The suites to run: the preset's (or --quick's, or the custom one), with the
    command line's values in place of their own."""
    if args.quick:
        base = list(QUICK) if args.preset in (None, "full") else [QUICK[0] if args.preset == "standard" else QUICK[1]]
    elif args.preset:
        base = list(PRESETS[args.preset])
    else:
        base = [CUSTOM]
        if args.max_seq_len and not args.seq_lens:
            lengths = [512]
            while lengths[-1] * 2 <= args.max_seq_len:
                lengths.append(lengths[-1] * 2)
            base = [CUSTOM.replace(seq_lens=tuple(lengths))]
    changes: dict = {}
    if args.seq_lens:
        changes["seq_lens"] = tuple(args.seq_lens)
    if args.batch_size:
        changes.update(batch_size=args.batch_size, tokens=None)
    if args.tokens:
        changes.update(tokens=args.tokens, batch_size=None)
    if args.num_heads:
        changes.update(num_heads=args.num_heads, model_dim=None)
    if args.model_dim:
        changes.update(model_dim=args.model_dim, num_heads=None)
    if args.num_kv_heads:
        changes["num_kv_heads"] = args.num_kv_heads
    if args.head_dim:
        changes["head_dims"] = tuple(args.head_dim)
    if args.causal or args.non_causal:
        changes["causal"] = tuple(c for c, on in ((False, args.non_causal), (True, args.causal)) if on)
    if args.window is not None:
        changes["window"] = args.window
    if args.dtype:
        changes["dtype"] = args.dtype
    if args.mode:
        changes["modes"] = MODES if args.mode == "both" else (args.mode,)
    out = []
    for suite in base:
        suite = suite.replace(**changes)
        if args.max_seq_len:
            suite = suite.replace(seq_lens=tuple(n for n in suite.seq_lens if n <= args.max_seq_len))
        out.append(suite)
    return out


class _Results:
    """results.json, rewritten every few seconds while the run goes on (so a run that is
    killed keeps what it measured) and once more at the end with ``complete: true``."""

    def __init__(self, path: Path, argv: list[str]):
        self.path = path
        self.started = time.time()
        self.saved = 0.0
        self.data: dict = dict(
            schema="jaxtile-bench/1",
            date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            command=" ".join(["python -m bench", *argv]),
            complete=False,
            wall_s=None,
            measurements=[],
        )

    def add(self, record: dict) -> None:
        self.data["measurements"].append(record)
        if time.time() - self.saved > 10:
            self.save()

    def save(self) -> None:
        self.data["wall_s"] = round(time.time() - self.started, 1)
        self.path.write_text(json.dumps(self.data, indent=1) + "\n")
        self.saved = time.time()


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    args = p.parse_args(argv)
    try:
        selected = suites(args)
        for suite in selected:
            suite.problems()
    except ValueError as exc:
        p.error(str(exc))
    max_minutes = args.max_minutes
    if max_minutes is None:
        max_minutes = 2.5 if args.quick else 8.0 if args.preset else None
    args.save_dir.mkdir(parents=True, exist_ok=True)
    results = _Results(args.save_dir / "results.json", argv)
    with open(args.save_dir / "bench.log", "w", buffering=1) as log:
        try:
            env = runner.probe(log)
        except subprocess.CalledProcessError:
            p.error(f"describing this machine failed (python -m bench.probe); see {args.save_dir / 'bench.log'}")
        impls = args.impl or catalog.defaults(env)
        unknown = [name for name in impls if not catalog.known(name, env)]
        if unknown:
            p.error(f"unknown implementation(s) {unknown}; choose from {[*env['jaxtile'], *catalog.PEERS]}")
        impls = catalog.order(impls)
        budget = args.budget if args.budget is not None else (0.5 if catalog.on_gpu(env) else 0.2)
        results.data.update(
            config=dict(
                suites=[dataclasses.asdict(s) for s in selected],
                impls=impls,
                budget_s=budget,
                timeout_s=args.timeout,
                max_minutes=max_minutes,
                seed=args.seed,
                quick=args.quick,
            ),
            environment=env,
            conventions=CONVENTIONS,
        )
        tasks, known = runner.plan(selected, impls, env)
        print(
            f"{len(tasks)} measurements ({len(known)} not supported here) of {', '.join(impls)} on {env['device']}",
            file=sys.stderr,
        )
        # The bar only on a terminal; in a log, the numbered rows show the progress.
        bar = tqdm(total=len(tasks), unit="run", file=sys.stderr, dynamic_ncols=True, disable=None)

        def on_start(task: runner.Task) -> None:
            bar.set_description(f"{task.impl} {task.mode} T={task.problem.seq_len}")

        def on_record(task: runner.Task, record: dict) -> None:
            bar.update()
            results.add(record)
            if record["status"] != "unsupported":
                done = f"[{len(results.data['measurements'])}/{len(tasks)}]"
                bar.write(f"{done:>9} {table.live_row(record)}", file=sys.stderr)

        records = runner.Runner(
            env,
            log=log,
            budget_s=budget,
            timeout_s=args.timeout,
            deadline=runner.deadline_after(max_minutes),
            seed=args.seed,
            on_record=on_record,
            on_start=on_start,
        ).run(tasks, known)
        bar.close()
    results.data.update(measurements=records, complete=True)
    results.save()
    print(table.render(records))
    written = [results.path]
    if not args.no_plots:
        written += plots.write(results.data, args.save_dir)
    print(f"wrote {', '.join(map(str, written))} in {results.data['wall_s']:.0f} s", file=sys.stderr)
    return results.data


if __name__ == "__main__":
    main()
