"""The decode benchmark: a few queries against a long KV cache, against the GPU's copy bandwidth.

``python -m bench.decode`` first measures, in this one process on this one GPU, the
device-to-device copy bandwidth (``x + 1`` over a large buffer: its bytes read and
written). Then, for each decode shape (bf16, 32 query heads : 8 kv heads, head dim 128,
non-causal queries against the whole cache) and each layout of the cache — the full
cache (``dense``); per-sequence lengths drawn uniformly in ``[kv/2, kv]`` (``ragged``,
``kv_lengths=``); the ragged cache in pages of 16 and 64 positions behind a random page
table (``paged16``, ``paged64``) — it times jaxtile's default, each ``--impl``, cuDNN
(``jax.nn.dot_product_attention``) and tokamax's kernels where importable, and on paged
layouts ``jaxtile.paged_attention`` (default and each ``--impl``); with ``--tiles`` also
pallas_decode with each of its autotuning candidates, and with ``--splits`` with each of
`SPLITS` shares of the cache, on every layout (on paged ones through
``paged_attention(..., tuning=)``, in place of the tiles and shares it takes for pages).

A case's calls on every layout are timed against each other in interleaved rounds
(`bench._worker.time_rounds`). Each row reports the median ms, the bytes a decode step
must move (q, the output, and K and V of the filled cache once), GB/s and its fraction of
the copy bandwidth, the speed relative to cuDNN (cuDNN's time over this one; on paged
layouts cuDNN's ragged time) and, on paged layouts, relative to the same implementation
(or variant) on the ragged contiguous cache.
jaxtile's default is held to the issue's targets — q_len 1: at least 0.85 of the copy
bandwidth and 1.0× cuDNN; longer queries: 1.2× cuDNN; paged: within 10% of contiguous —
printed beside the numbers; ``--strict`` exits with status 1 if one is missed::

    python -m bench.decode --out decode.json          # on a GPU
    python -m bench.decode --tiles                    # and pallas_decode's candidate tiles
    python -m bench.decode --splits                   # and its split-KV share counts
    python -m bench.decode --smoke                    # tiny float32 shapes, on CPU in seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import sys
from collections.abc import Callable, Hashable
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

import jaxtile
from bench import _worker
from bench.check import load_tokamax
from bench.probe import git_state
from bench.timing import compiled_call, time_jitted, time_together
from jaxtile.triton import decode
from jaxtile.triton.tuning import Tuning

GIB = 1 << 30
PAGE_SIZES = (16, 64)
LAYOUTS = ("dense", "ragged", *(f"paged{size}" for size in PAGE_SIZES))
TOKAMAX = ("mosaic", "triton")
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
LABELS = {"of_copy": "copy", "vs_cudnn": "cuDNN", "vs_contiguous": "contiguous"}


@dataclasses.dataclass(frozen=True)
class Case:
    """``batch`` sequences of ``q_len`` queries ``[batch, q_len, heads, head_dim]``
    against a cache of ``kv_len`` positions ``[batch, kv_len, kv_heads, head_dim]``."""

    batch: int
    q_len: int
    kv_len: int
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"

    @property
    def name(self) -> str:
        return f"b{self.batch}_q{self.q_len}_kv{self.kv_len}"

    def moved_bytes(self, kv_lengths) -> int:
        """What a decode step must move: q and the output once, and K and V of each
        sequence's first ``kv_lengths[b]`` positions once (pages and padding past them,
        and the page table, are not counted)."""
        itemsize = jnp.dtype(self.dtype).itemsize
        queries = 2 * self.batch * self.q_len * self.heads * self.head_dim
        cache = 2 * int(np.sum(kv_lengths)) * self.kv_heads * self.head_dim
        return (queries + cache) * itemsize


CASES = (Case(8, 1, 32768), Case(1, 1, 131072), Case(64, 1, 4096), Case(8, 16, 32768))
SMOKE = (Case(2, 1, 256, 4, 2, 32, "float32"),)
COPY, SMOKE_COPY = (2 * GIB, "bfloat16"), (4 << 20, "float32")  # the copied buffer: bytes, dtype


def _copy_bandwidth(nbytes: int, dtype: str, budget_s: float) -> float:
    """GB/s of ``x + 1`` over ``nbytes`` of ``dtype``, counting bytes read and written."""
    x = jnp.ones(nbytes // jnp.dtype(dtype).itemsize, dtype)
    ms = time_jitted(lambda x: x + 1, (x,), budget_s).ms
    return 2 * x.nbytes / ms / 1e6


def _inputs(case: Case) -> list[jax.Array]:
    """Random q, k, v of the case (drawn by NumPy: quicker than compiling JAX's generator)."""
    rng = np.random.default_rng(case.kv_len + case.q_len)
    q_shape = (case.batch, case.q_len, case.heads, case.head_dim)
    kv_shape = (case.batch, case.kv_len, case.kv_heads, case.head_dim)
    return [jnp.asarray(rng.standard_normal(s, np.float32)).astype(case.dtype) for s in (q_shape, kv_shape, kv_shape)]


def _kv_lengths(case: Case) -> np.ndarray:
    """The ragged layouts' cache lengths, uniform in ``[kv_len / 2, kv_len]``."""
    rng = np.random.default_rng(case.batch * case.kv_len + case.q_len)
    return rng.integers(case.kv_len // 2, case.kv_len, size=case.batch, endpoint=True).astype(np.int32)


def _page_table(case: Case, page_size: int) -> np.ndarray:
    """``[batch, kv_len / page_size]``: a random permutation of all the page ids."""
    per_sequence = case.kv_len // page_size
    permutation = np.random.default_rng(page_size).permutation(case.batch * per_sequence)
    return permutation.reshape(case.batch, per_sequence).astype(np.int32)


def _to_pages(cache: jax.Array, table: np.ndarray) -> jax.Array:
    """``cache [batch, kv_len, kv_heads, d]`` as pages ``[kv_heads, num_pages,
    page_size, d]``, sequence ``b``'s ``i``-th page at page id ``table[b, i]`` (``table``
    a permutation of the page ids, so its inverse says which chunk each page holds)."""
    batch, per_sequence = table.shape
    kv_len, kv_heads, d = cache.shape[1:]
    chunks = cache.reshape(batch * per_sequence, kv_len // per_sequence, kv_heads, d).transpose(2, 0, 1, 3)
    return chunks[:, np.argsort(table, axis=None)]


def _jaxtile(q, k, v, kv_lengths, *, implementation, tuning=None):
    return jaxtile.flash_attention(q, k, v, kv_lengths=kv_lengths, implementation=implementation, tuning=tuning)


def _cudnn(q, k, v, kv_lengths):
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=kv_lengths, implementation="cudnn")


def _tokamax(q, k, v, kv_lengths, *, module, kernel):
    return module.dot_product_attention(q, k, v, key_value_seq_lengths=kv_lengths, implementation=kernel)


def _paged(q, k_pages, v_pages, page_table, kv_lengths, *, implementation, tuning=None):
    return jaxtile.paged_attention(
        q, k_pages, v_pages, page_table, kv_lengths, implementation=implementation, tuning=tuning
    )


def _variants(tiles: bool, splits: bool) -> dict[str, Tuning]:
    """pallas_decode's tunings to time by name: with ``tiles`` each autotuning candidate
    (``"pallas_decode 128x3"``: key tiles x stages), with ``splits`` the 16-bit default
    tiles in each of `SPLITS` shares (``"pallas_decode splits=4"``)."""
    variants = {}
    for t in decode.CANDIDATES if tiles else ():
        variants[f"pallas_decode {t.block_k}x{t.num_stages}"] = Tuning(t, t, t)  # decoding uses the forward's
    t = decode.DEFAULTS[2]
    for s in SPLITS if splits else ():
        variants[f"pallas_decode splits={s}"] = decode.Tuning(t, t, t, num_splits=s)
    return variants


def _attends(layout: str, impls, tokamax, variants: dict[str, Tuning] | None = None) -> dict[str, Callable]:
    """What is timed on ``layout``, by name: jaxtile's default (``"jaxtile"``), each of
    ``impls`` and pallas_decode with each of ``variants`` (`_variants`), through
    ``paged_attention`` on paged layouts; on contiguous ones also cuDNN, and if
    ``tokamax`` is the module its kernels."""
    paged = layout.startswith("paged")
    jaxtile_fn = _paged if paged else _jaxtile
    attends = {name or "jaxtile": functools.partial(jaxtile_fn, implementation=name) for name in (None, *impls)}
    for name, tuning in (variants or {}).items():
        attends[name] = functools.partial(jaxtile_fn, implementation="pallas_decode", tuning=tuning)
    if paged:
        return attends
    attends["cudnn"] = _cudnn
    for kernel in TOKAMAX if tokamax else ():
        attends[f"tokamax.{kernel}"] = functools.partial(_tokamax, module=tokamax, kernel=kernel)
    return attends


def _arguments(case: Case, layout: str, q, k, v, kv_lengths: np.ndarray) -> tuple:
    """The timed calls' arguments on ``layout``: ``(q, k, v, kv_lengths)`` (None when
    dense), or ``(q, k_pages, v_pages, page_table, kv_lengths)``."""
    if layout == "dense":
        return q, k, v, None
    if layout == "ragged":
        return q, k, v, jnp.asarray(kv_lengths)
    table = _page_table(case, int(layout.removeprefix("paged")))
    return q, _to_pages(k, table), _to_pages(v, table), jnp.asarray(table), jnp.asarray(kv_lengths)


def _timings(calls: dict[Hashable, tuple[Callable, tuple]], budget_s: float) -> dict[Hashable, dict]:
    """The median ms and spread of each of ``calls`` (``{key: (attend, args)}``), compiled
    once and timed against each other (`bench.timing.time_together`); or why one failed
    compiling or running."""
    builds = {key: functools.partial(compiled_call, attend, args) for key, (attend, args) in calls.items()}
    return {
        key: dict(status="ok", ms=t.ms, ms_lo=t.ms_lo, ms_hi=t.ms_hi) if isinstance(t, _worker.Timing) else t
        for key, t in time_together(builds, budget_s).items()
    }


def _goals(row: dict) -> dict[str, float]:
    """The issue's targets for jaxtile's default on the row's case and layout."""
    if row["layout"].startswith("paged"):
        return {"vs_contiguous": 1 / 1.1}
    if row["q_len"] == 1:
        return {"of_copy": 0.85, "vs_cudnn": 1.0}
    return {"vs_cudnn": 1.2}


def _targets(row: dict) -> dict:
    """Each goal and whether the row meets it: False if jaxtile gave no number, None if
    the peer did not."""
    targets = {}
    for metric, goal in _goals(row).items():
        met = None if row.get(metric) is None else row[metric] >= goal
        targets[metric] = dict(goal=goal, met=met if "ms" in row else False)
    return targets


def _ratio(theirs: float | None, mine: float | None) -> float | None:
    return theirs / mine if theirs and mine else None


def _row(case: Case, layout: str, impl: str, timing: dict, nbytes: int, copy_gbs: float, ms: dict) -> dict:
    """One measurement with its bandwidth and ratios; ``ms[(layout, impl)]`` holds the
    case's times (cuDNN's, and the ragged rows for a paged one)."""
    row = dict(case=case.name, layout=layout, impl=impl, **dataclasses.asdict(case), bytes=nbytes, **timing)
    if "error" in row and (impl == "cudnn" or impl.startswith("tokamax.")):  # a peer that cannot run here
        row["status"] = "unsupported"
    if "ms" in row:
        row["gbs"] = nbytes / row["ms"] / 1e6
        row["of_copy"] = row["gbs"] / copy_gbs
    contiguous = "ragged" if layout.startswith("paged") else layout
    row["vs_cudnn"] = _ratio(ms.get((contiguous, "cudnn")), row.get("ms"))
    if layout.startswith("paged"):
        row["vs_contiguous"] = _ratio(ms.get(("ragged", impl)), row.get("ms"))
    if impl == "jaxtile":
        row["targets"] = _targets(row)
    return row


def run(cases, impls, budget_s: float, copy_gbs: float, tokamax=None, emit=print, variants=None) -> list[dict]:
    """Every case, layout and implementation, timed: a case's calls on every layout
    against each other, so that the ratios between them (to cuDNN, to the contiguous
    cache) come from interleaved rounds; ``emit`` gets each row's table line."""
    rows = []
    for case in cases:
        q, k, v = _inputs(case)
        ragged = _kv_lengths(case)
        lengths = {layout: np.full(case.batch, case.kv_len) if layout == "dense" else ragged for layout in LAYOUTS}
        arguments = {layout: _arguments(case, layout, q, k, v, lengths[layout]) for layout in LAYOUTS}
        calls = {
            (layout, impl): (attend, arguments[layout])
            for layout in LAYOUTS
            for impl, attend in _attends(layout, impls, tokamax, variants).items()
        }
        timings = _timings(calls, budget_s)
        ms = {key: t["ms"] for key, t in timings.items() if "ms" in t}
        for (layout, impl), timing in timings.items():
            rows.append(_row(case, layout, impl, timing, case.moved_bytes(lengths[layout]), copy_gbs, ms))
            emit(_table_row(rows[-1]))
        del q, k, v, arguments, calls  # the caches and paged copies, before the next case's
    return rows


def _number(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def _target_text(targets: dict) -> str:
    verdict = {True: "ok", False: "FAIL", None: "n/a"}
    return ", ".join(f"{LABELS[metric]} ≥ {t['goal']:.2f} {verdict[t['met']]}" for metric, t in targets.items())


def _table_row(row: dict) -> str:
    """One row of the Markdown table: the numbers, then the targets or the error."""
    if "ms" in row:
        ms, notes = f"{row['ms']:.3f}", _target_text(row.get("targets", {}))
    else:
        ms, notes = row["status"], row["error"][:80].replace("|", "/")
    cells = [
        row["case"],
        row["layout"],
        row["impl"],
        ms,
        f"{row['bytes'] / 1e6:.1f}",
        _number(row.get("gbs"), ".0f"),
        _number(row.get("of_copy"), ".2f"),
        _number(row.get("vs_cudnn"), ".2f"),
        _number(row.get("vs_contiguous"), ".2f"),
        notes,
    ]
    return "| " + " | ".join(cells) + " |"


def _head(results: dict) -> list[str]:
    """What was measured where, and the table's header."""
    git = results["git"]
    state = "with uncommitted changes" if git.get("dirty") else "clean tree"
    return [
        f"Measured on **{results['device']}** on {results['date'][:10]} with `python -m bench.decode`, jaxtile at "
        f"commit `{(git.get('commit') or 'unrecorded')[:12]}` ({state}), jax {results['versions']['jax']}; "
        f"copy bandwidth {results['copy_bandwidth_gbs']:.0f} GB/s (bytes read + written). `MB`: q, output and the "
        "filled K and V once; `of copy`: GB/s over the copy bandwidth; `vs X`: X's time over this one.",
        "",
        "| case | layout | impl | ms | MB | GB/s | of copy | vs cuDNN | vs contiguous | targets / error |",
        "| --- | --- | --- | --: | --: | --: | --: | --: | --: | --- |",
    ]


def _summary(rows: list[dict]) -> str:
    """How many of the targets jaxtile's default met."""
    verdicts = [t["met"] for row in rows for t in row.get("targets", {}).values()]
    return (
        f"jaxtile's default met {verdicts.count(True)} of {len(verdicts)} targets "
        f"({verdicts.count(False)} missed, {verdicts.count(None)} without a peer's number)."
    )


def render(results: dict) -> str:
    """The Markdown table of a decode run's results."""
    return "\n".join([*_head(results), *map(_table_row, results["rows"]), "", _summary(results["rows"])]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the rows and the environment as JSON")
    parser.add_argument(
        "--budget-s", type=float, metavar="S", help="seconds of timed calls per number (0.5; smoke 0.05)"
    )
    parser.add_argument("--impl", action="append", default=[], choices=jaxtile.registry.names(), help="also time this")
    parser.add_argument("--tiles", action="store_true", help="also time pallas_decode's autotuning candidates")
    parser.add_argument("--splits", action="store_true", help="also time pallas_decode with each of SPLITS shares")
    parser.add_argument("--smoke", action="store_true", help="tiny float32 shapes and copy, to run on CPU in seconds")
    parser.add_argument("--strict", action="store_true", help="exit with status 1 if a target is missed")
    args = parser.parse_args(argv)
    budget_s = args.budget_s or (0.05 if args.smoke else 0.5)
    cases, copy = (SMOKE, SMOKE_COPY) if args.smoke else (CASES, COPY)
    results = dict(
        git=git_state(),
        device=jax.devices()[0].device_kind,
        versions=dict(jax=jax.__version__, jaxlib=jaxlib.__version__),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        copy_bandwidth_gbs=_copy_bandwidth(*copy, budget_s),
    )
    print("\n".join(_head(results)), flush=True)
    emit = functools.partial(print, flush=True)
    variants = _variants(args.tiles, args.splits)
    rows = run(cases, args.impl, budget_s, results["copy_bandwidth_gbs"], load_tokamax(), emit, variants)
    results["rows"] = rows
    print("\n" + _summary(rows))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    missed = any(t["met"] is False for row in rows for t in row.get("targets", {}).values())
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
