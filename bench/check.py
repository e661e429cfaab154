"""The performance guard: jaxtile against a peer, in one process, with committed floors.

``python -m bench.check`` times jaxtile's default implementation and a peer on a fixed set
of shapes — the Hopper issue's standard grid (`STANDARD`: 1K, 4K and 16K tokens, causal
and not, head dims 64 and 128); GQA, MQA, sliding windows, packed documents, head dim 256
(MHA and MQA), sinks, a learned bias, a causal mask passed as a dense array (recognised,
and not) — forward and forward+backward, in this one process on this one GPU, the calls
of one row in interleaved rounds (`_worker.time_rounds`), and prints the ratio ``peer
time / jaxtile time`` beside the floor committed in ``bench/floors.json``, then the
Hopper issue's lines over the standard rows. It exits with status 1 if any ratio is below
its floor, so that a slower kernel cannot land unnoticed. The peer is cuDNN
(``jax.nn.dot_product_attention(implementation="cudnn")``) where it expresses the case;
packed documents are held to the same documents run as separate sequences of a batch
(the cost of the packing itself). tokamax's Mosaic GPU kernel, when importable, is timed
too and reported, not gated.

The results file records the jaxtile commit, whether the tree was dirty, and the
``jaxtile.__file__`` that was imported, so a number always says what it measured::

    python -m bench.check --out check.json          # on a GPU
    python -m bench.check --only gqa mqa --modes fwd
    python -m bench.check --part 1/2 --out a.json   # half the cases, for a shorter time box
    python -m bench.check --part 2/2 --out b.json
    python -m bench.check --part 2/2 --after b.json --out c.json  # the rows b.json lacks, if cut short
    python -m bench.check --report a.json b.json c.json  # the README's table of the whole run
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.metadata
import json
import math
import sys
import warnings
from collections.abc import Callable, Collection
from pathlib import Path

import jax
import jax.numpy as jnp

import jaxtile
from bench import _worker
from bench.probe import probe
from bench.suites import Problem
from bench.timing import compiled_call, time_together

FLOORS = Path(__file__).with_name("floors.json")
MODES = ("fwd", "fwdbwd")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One case: q ``[batch, seq, heads, head_dim]``, k and v with ``kv_heads``;
    ``documents`` packs that many equal documents into each sequence (segment ids).
    ``sinks`` adds learnable attention sinks (one logit per query head); ``bias`` a
    per-head bias ``[1, heads, seq, seq]``, differentiated with q, k and v. With
    ``dense_mask`` jaxtile gets the causal mask as a dense ``[seq, seq]`` array, an
    argument of the compiled call as in a Flax model, while the peers get
    ``is_causal``: ``"flax"`` is the mask Flax builds (recognised as causal),
    ``"unrecognised"`` the same with key 0 hidden from the rows after the first, which
    no structured call expresses (the dense path, at one pair per row less).
    ``peer`` is what the ratio is taken against: ``"cudnn"``, ``"tokamax"`` (where
    cuDNN cannot express the case), ``"separate"`` (the documents as a batch), or
    ``"no_sinks"`` (the same call without its sinks: what they cost)."""

    name: str
    batch: int
    seq: int
    heads: int
    head_dim: int
    kv_heads: int | None = None
    causal: bool = False
    window: tuple[int, int] | None = None
    documents: int = 0
    sinks: bool = False
    bias: bool = False
    dense_mask: str | None = None
    peer: str = "cudnn"

    @property
    def num_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    def flops(self, mode: str) -> float:
        """`bench.suites.Problem`'s count; packed documents count as that many separate
        sequences (their visible pairs)."""
        docs = max(self.documents, 1)
        problem = Problem(
            self.batch * docs,
            self.seq // docs,
            self.heads,
            self.num_kv_heads,
            self.head_dim,
            self.causal,
            self.window,
            "bfloat16",
        )
        return problem.flops(mode)


def _standard(seq: int, head_dim: int, causal: bool) -> Shape:
    mask = "causal" if causal else "full"
    return Shape(f"d{head_dim}_{seq // 1024}k_{mask}", 16384 // seq, seq, 2048 // head_dim, head_dim, causal=causal)


# The Hopper issue's standard grid: 1K, 4K and 16K tokens, head dims 64 and 128, causal and not.
STANDARD = tuple(_standard(seq, d, c) for d in (64, 128) for seq in (1024, 4096, 16384) for c in (False, True))
SHAPES = (
    *STANDARD,
    Shape("gqa_32_8_causal_8k", 2, 8192, 32, 128, kv_heads=8, causal=True),
    Shape("mqa_16_1_causal_8k", 2, 8192, 16, 128, kv_heads=1, causal=True),
    Shape("window_1023_causal_16k", 1, 16384, 16, 128, causal=True, window=(1023, 0)),
    Shape("window_4095_gqa_32k", 1, 32768, 32, 128, kv_heads=8, causal=True, window=(4095, 0)),
    Shape("window_256_256_16k", 1, 16384, 16, 128, window=(256, 256), peer="tokamax"),
    Shape("documents_8x2k_causal_16k", 1, 16384, 16, 128, causal=True, documents=8, peer="separate"),
    Shape("documents_8x2k_d64_causal_16k", 1, 16384, 32, 64, causal=True, documents=8, peer="separate"),
    Shape("d256_causal_8k", 2, 8192, 8, 256, causal=True),
    Shape("mqa_16_1_d256_causal_4k", 1, 4096, 16, 256, kv_heads=1, causal=True),
    Shape("sinks_gqa_64_8_causal_8k", 2, 8192, 64, 64, kv_heads=8, causal=True, sinks=True, peer="no_sinks"),
    Shape("bias_d128_causal_8k", 1, 8192, 16, 128, causal=True, bias=True),
    Shape("d64_4k_dense_causal", 4, 4096, 32, 64, causal=True, dense_mask="flax"),
    Shape("d64_4k_dense_unrecognised", 4, 4096, 32, 64, causal=True, dense_mask="unrecognised"),
)


def _segment_ids(shape: Shape):
    doc = shape.seq // shape.documents
    ids = jnp.repeat(jnp.arange(shape.documents, dtype=jnp.int32), doc)
    return jnp.broadcast_to(ids, (shape.batch, shape.seq))


def _dense_mask(shape: Shape):
    """The ``[seq, seq]`` mask of ``shape.dense_mask``, or None."""
    if shape.dense_mask is None:
        return None
    causal = jnp.tril(jnp.ones((shape.seq, shape.seq), jnp.bool_))
    return causal if shape.dense_mask == "flax" else causal.at[1:, 0].set(False)


def _jaxtile(shape: Shape):
    """jaxtile's default implementation, as ``attend(q, k, v, bias=None, mask=None)``."""
    options = dict(causal=shape.causal, window=shape.window)
    if shape.sinks:
        options["sinks"] = jnp.linspace(-1.0, 1.0, shape.heads, dtype=jnp.float32)
    if shape.documents:
        options["segment_ids"] = _segment_ids(shape)
    if shape.dense_mask:
        options.update(causal=False)
    return lambda q, k, v, bias=None, mask=None: jaxtile.flash_attention(q, k, v, bias=bias, mask=mask, **options)


def _separate_documents(shape: Shape):
    """The packed documents as a batch of separate sequences (jaxtile, same kernels)."""
    docs, doc = shape.documents, shape.seq // shape.documents

    def split(x):
        return x.reshape(x.shape[0] * docs, doc, *x.shape[2:])

    def attend(q, k, v, mask=None):  # no dense mask: the documents' rows are their segments
        out = jaxtile.flash_attention(split(q), split(k), split(v), causal=shape.causal)
        return out.reshape(q.shape[0], shape.seq, *out.shape[2:])

    return attend


def _cudnn(shape: Shape):
    """cuDNN through ``jax.nn`` (not for packed documents or sinks, which it cannot express)."""
    if shape.documents or shape.sinks:
        return None

    def attend(q, k, v, bias=None, mask=None):  # is_causal stands for a dense mask (its pairs, or one a row more)
        return jax.nn.dot_product_attention(
            q, k, v, bias, is_causal=shape.causal, local_window_size=shape.window, implementation="cudnn"
        )

    return attend


@functools.cache
def _tokamax_missing(reason: str) -> None:
    print(f"tokamax is not timed: {reason}", file=sys.stderr)


def load_tokamax():
    """The ``tokamax`` module, or None (having said once why) where it does not import."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import tokamax
    except Exception as exc:  # not installed here: the column stays empty, and says why
        _tokamax_missing(f"{type(exc).__name__}: {exc}")
        return None
    return tokamax


def _tokamax(shape: Shape):
    """tokamax's Mosaic GPU kernel (JAX's recommended GPU attention), if importable."""
    tokamax = load_tokamax()
    if tokamax is None or shape.sinks:  # it has no sinks
        return None
    documents = None
    if shape.documents:
        ids = _segment_ids(shape)
        documents = (ids[:, :, None] == ids[:, None, :])[:, None]

    def attend(q, k, v, bias=None, mask=None):  # as for cuDNN, is_causal stands for a dense mask
        return tokamax.dot_product_attention(
            q,
            k,
            v,
            bias,
            mask=documents,
            is_causal=shape.causal,
            local_window_size=shape.window,
            implementation="mosaic",
        )

    return attend


def _inputs(shape: Shape, mode: str):
    """``(primals, mask, dout)``: random bf16 q, k, v (and the bias with ``shape.bias``),
    the dense mask of ``shape.dense_mask`` (or None) and, for ``fwdbwd``, the output's
    cotangent (or None)."""
    keys = jax.random.split(jax.random.key(shape.seq + shape.heads), 5)
    q_shape = (shape.batch, shape.seq, shape.heads, shape.head_dim)
    kv_shape = (shape.batch, shape.seq, shape.num_kv_heads, shape.head_dim)
    shapes = [q_shape, kv_shape, kv_shape]
    shapes += [(1, shape.heads, shape.seq, shape.seq)] if shape.bias else []
    primals = [jax.random.normal(key, s, jnp.bfloat16) for key, s in zip(keys, shapes)]
    dout = jax.random.normal(keys[-1], q_shape, jnp.bfloat16) if mode == "fwdbwd" else None
    return primals, _dense_mask(shape), dout


def _runnable(attend, mode: str, inputs) -> Callable[[], object]:
    """`compiled_call` of ``attend`` on ``inputs`` (`_inputs`): forward, or
    forward+backward under their cotangent, differentiated in every input."""
    primals, mask, dout = inputs

    def fn(mask, dout, *primals):
        if dout is None:
            return attend(*primals, mask=mask)
        out, vjp = jax.vjp(lambda *p: attend(*p, mask=mask), *primals)
        return out, *vjp(dout)

    return compiled_call(fn, [mask, dout, *primals])


def _timed_together(attends: dict, shape: Shape, mode: str, budget_s: float) -> dict[str, dict]:
    """Median milliseconds (and TFLOP/s) of each of ``attends`` (``{name: attend}``) on the
    same inputs (`time_together`); or the error one raised compiling or running, where a
    missing jaxtile number fails the check."""
    inputs = _inputs(shape, mode)
    timings = time_together(
        {name: functools.partial(_runnable, attend, mode, inputs) for name, attend in attends.items()}, budget_s
    )
    return {
        name: dict(ms=t.ms, ms_lo=t.ms_lo, ms_hi=t.ms_hi, tflops=shape.flops(mode) / t.ms / 1e9)
        if isinstance(t, _worker.Timing)
        else dict(error=t["error"])
        for name, t in timings.items()
    }


def _timed(attend, shape: Shape, mode: str, budget_s: float) -> dict:
    """`_timed_together` of ``attend`` alone."""
    return _timed_together({"attend": attend}, shape, mode, budget_s)["attend"]


def timed_passes(variants: dict, shape: Shape, mode: str, passes: int = 2, budget_s: float = 0.5) -> dict:
    """For the A/B record scripts: each of ``variants`` (``{label: attend}``, as `_timed`
    takes them) timed ``passes`` times in turn, jax's caches cleared before each, as
    ``{label: [median ms, or None where it raised]}``."""
    ms = {label: [] for label in variants}
    for _pass in range(passes):
        for label, attend in variants.items():
            jax.clear_caches()
            ms[label].append(_timed(attend, shape, mode, budget_s).get("ms"))
    return ms


def print_passes_together(variants: dict, shape: Shape, mode: str, passes: int = 2, budget_s: float = 0.5) -> None:
    """For the A/B record scripts: ``variants`` (``{label: attend}``, None for a peer that
    does not run here) timed together (`_timed_together`) ``passes`` times, a line per
    pass as it ends: ``<shape> <mode> pass <i> <label>=<median ms>ms/<TFLOP/s> ...``
    (``err`` where one raised)."""
    present = {label: attend for label, attend in variants.items() if attend is not None}
    for i in range(passes):
        timed = _timed_together(present, shape, mode, budget_s)
        cells = " ".join(
            f"{label}={t['ms']:.4f}ms/{t['tflops']:.0f}" if "ms" in t else f"{label}=err" for label, t in timed.items()
        )
        print(f"{shape.name:24s} {mode} pass {i} {cells}", flush=True)


def _jaxtile_peers(shape: Shape) -> dict:
    """The peers of ``shape`` that are jaxtile calls: the documents as separate
    sequences, the call without its sinks."""
    peers = {}
    if shape.documents:
        peers["separate"] = _separate_documents(shape)
    if shape.sinks:
        peers["no_sinks"] = _jaxtile(dataclasses.replace(shape, sinks=False))
    return peers


def run(shapes, modes, budget_s: float, floors: dict, on_row=None, skip=frozenset()) -> list[dict]:
    """The rows of ``shapes`` × ``modes`` but those ``(case, mode)`` in ``skip``;
    ``on_row(rows)`` after each, so that a run cut short by a time box keeps what it
    measured."""
    rows = []
    for shape in shapes:
        peers = {"cudnn": _cudnn(shape), "tokamax": _tokamax(shape), **_jaxtile_peers(shape)}
        peers = {name: attend for name, attend in peers.items() if attend is not None}
        for mode in (m for m in modes if (shape.name, m) not in skip):
            row = dict(case=shape.name, mode=mode, shape=dataclasses.asdict(shape), flops=shape.flops(mode))
            row.update(_timed_together({"jaxtile": _jaxtile(shape), **peers}, shape, mode, budget_s))
            row["peer"] = shape.peer
            mine, theirs = row["jaxtile"].get("ms"), row.get(shape.peer, {}).get("ms")
            row["ratio"] = theirs / mine if mine and theirs else None
            row["floor"] = floors.get(shape.name, {}).get(mode)
            if row["floor"] is None:
                row["status"] = "no floor"
            elif row["ratio"] is None:
                row["status"] = "FAIL (no number)" if "error" in row["jaxtile"] else "no peer"
            else:
                row["status"] = "ok" if row["ratio"] >= row["floor"] else "FAIL"
            rows.append(row)
            print(_line(row), flush=True)
            if on_row:
                on_row(rows)
    return rows


def _ms(entry: dict | None) -> str:
    if not entry:
        return "-"
    return f"{entry['ms']:.3f}" if "ms" in entry else "error"


def _line(row: dict) -> str:
    mine = row["jaxtile"]
    tflops = f"{mine['tflops']:.0f}" if "tflops" in mine else mine.get("error", "")[:60]
    ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
    floor = "-" if row["floor"] is None else f"{row['floor']:.2f}"
    return (
        f"{row['case']:<28} {row['mode']:<6} jaxtile {_ms(mine):>8} ms {tflops:>5} TFLOP/s | "
        f"cudnn {_ms(row.get('cudnn')):>8} | tokamax {_ms(row.get('tokamax')):>8} | "
        f"vs {row['peer']} {ratio:>5} (floor {floor})  {row['status']}"
    )


def render(results: dict) -> str:
    """The Markdown table of a check's results (``python -m bench.check --report``)."""
    env, git = results["environment"], results["environment"]["git"]
    state = "with uncommitted changes" if git.get("dirty") else "clean tree"
    lines = [
        f"Measured on **{env['device']}** on {env['date'][:10]} with `python -m bench.check`, jaxtile at commit "
        f"`{(git.get('commit') or 'unrecorded')[:12]}` ({state}), jax {env['versions']['jax']}. "
        "`ratio`: the peer's time over jaxtile's (above 1: jaxtile is faster); the check fails below `floor`.",
        "",
        "| case | mode | jaxtile ms | TFLOP/s | cuDNN ms | tokamax ms | peer | ratio | floor |",
        "| --- | --- | --: | --: | --: | --: | --- | --: | --: |",
    ]

    def ms(entry):
        return f"{entry['ms']:.3g}" if entry and "ms" in entry else ("error" if entry else "—")

    for r in results["rows"]:
        mine = r["jaxtile"]
        tflops = f"{mine['tflops']:.0f}" if "tflops" in mine else "—"
        ratio = "—" if r["ratio"] is None else f"{r['ratio']:.2f}"
        if r["status"].startswith("FAIL"):
            ratio = f"**{ratio} FAIL**"
        floor = "—" if r["floor"] is None else f"{r['floor']:.2f}"
        lines.append(
            f"| {r['case']} | {r['mode']} | {ms(mine)} | {tflops} | {ms(r.get('cudnn'))} | {ms(r.get('tokamax'))} "
            f"| {r['peer']} | {ratio} | {floor} |"
        )
    summary = results["summary"]
    floored = sum(r["floor"] is not None for r in results["rows"])
    at_floor = sum(r["status"] == "ok" for r in results["rows"])
    lines += [
        "",
        f"{at_floor} of {floored} rows with a floor at or above it. Geometric mean over the "
        f"rows with a cuDNN number: {summary['geomean_vs_cudnn']:.2f}× cuDNN's speed.",
    ]
    if summary.get("planned", summary["rows"]) > summary["rows"]:
        lines[-1] += f" The run was cut short: {summary['rows']} of its {summary['planned']} rows."
    lines += _standard_lines(results["rows"])
    return "\n".join(lines) + "\n"


def _geomean(ratios: list[float]) -> float:
    return math.exp(sum(map(math.log, ratios)) / len(ratios))


def _standard_lines(rows: list[dict]) -> list[str]:
    """The Hopper issue's lines over the rows of `STANDARD` the run has: the geometric
    mean of cuDNN's time over jaxtile's, forward (1.0) and forward+backward (0.95), and
    the lowest ratio to tokamax (1.0 on every row)."""
    names = {shape.name for shape in STANDARD}
    parts, counted = [], set()
    for mode, label, line in zip(MODES, ("forward", "forward+backward"), (1.0, 0.95)):
        measured = [r for r in rows if r["case"] in names and r["mode"] == mode and "ms" in r["jaxtile"]]
        vs_cudnn, vs_tokamax = (
            [(r[peer]["ms"] / r["jaxtile"]["ms"], r["case"]) for r in measured if "ms" in r.get(peer, {})]
            for peer in ("cudnn", "tokamax")
        )
        if not vs_cudnn:
            continue
        counted |= {case for _, case in vs_cudnn}
        text = f"{label} {_geomean([x for x, _ in vs_cudnn]):.2f}× cuDNN (line {line})"
        if vs_tokamax:
            lowest, case = min(vs_tokamax)
            text += f", lowest against tokamax {lowest:.2f}× ({case}; line 1.0)"
        parts.append(text)
    if not parts:
        return []
    return ["", f"The standard grid's rows in this run ({len(counted)} of {len(STANDARD)}): {'; '.join(parts)}."]


def select(only: list[str] | None = None, part: tuple[int, int] = (1, 1)) -> list[Shape]:
    """The cases of `SHAPES` whose name contains one of the words ``only`` (all, for
    None), and of those every ``N``-th from the ``K``-th, for ``part`` ``(K, N)``."""
    k, n = part
    return [s for s in SHAPES if not only or any(word in s.name for word in only)][k - 1 :: n]


def _source(environment: dict) -> tuple:
    """What parts of one check share: the commit, whether the tree was dirty, the GPU."""
    return environment["git"].get("commit"), environment["git"].get("dirty"), environment["device"]


def merge(parts: list[dict]) -> dict:
    """The results of one check run in disjoint ``parts`` (``--part``, ``--after``), each
    of the same commit, tree and GPU: their rows in `SHAPES`' order, the environment of
    the first; the rows planned, those any part planned."""
    for part in parts[1:]:
        if _source(part["environment"]) != _source(parts[0]["environment"]):
            raise ValueError(
                "parts of one check share a commit, tree and GPU; got "
                f"{_source(parts[0]['environment'])} and {_source(part['environment'])}"
            )
    rows = [r for part in parts for r in part["rows"]]
    seen = [(r["case"], r["mode"]) for r in rows]
    if len(set(seen)) < len(seen):
        raise ValueError(
            f"parts of one check are disjoint; rows measured twice: {sorted({x for x in seen if seen.count(x) > 1})}"
        )
    order = {shape.name: i for i, shape in enumerate(SHAPES)}
    rows.sort(key=lambda r: (order.get(r["case"], len(order)), MODES.index(r["mode"])))
    if all("planned_rows" in part["summary"] for part in parts):
        planned = {tuple(key) for part in parts for key in part["summary"]["planned_rows"]}
    else:  # results written before the rows were listed: counts only
        planned = sum(part["summary"].get("planned", part["summary"]["rows"]) for part in parts)
    return dict(environment=parts[0]["environment"], summary=_summary(rows, planned), rows=rows)


def _rest(shapes, modes, before: list[dict], environment: dict) -> list[tuple[str, str]]:
    """The ``(case, mode)`` rows of ``shapes`` × ``modes`` that the results ``before`` (of
    this commit, tree and GPU, ``environment``'s) do not hold."""
    for results in before:
        if _source(results["environment"]) != _source(environment):
            raise ValueError(f"results of {_source(results['environment'])}, not {_source(environment)}")
    done = {(r["case"], r["mode"]) for results in before for r in results["rows"]}
    return [(s.name, m) for s in shapes for m in modes if (s.name, m) not in done]


def _part(text: str) -> tuple[int, int]:
    """``K/N`` of ``--part``, as ``(K, N)`` with ``1 <= K <= N``."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--part takes K/N, as 1/2; got {text!r}") from None
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"--part K/N needs 1 <= K <= N; got {text!r}")
    return k, n


def _summary(rows: list[dict], planned: int | Collection[tuple[str, str]]) -> dict:
    """How many rows ran of those ``planned`` (``(case, mode)`` pairs, listed, or a count),
    how many failed, and the geometric mean of cuDNN's time over jaxtile's."""
    vs_cudnn = [
        r["cudnn"]["ms"] / r["jaxtile"]["ms"] for r in rows if "ms" in r.get("cudnn", {}) and "ms" in r["jaxtile"]
    ]
    listed = {} if isinstance(planned, int) else dict(planned_rows=sorted(planned))
    return dict(
        rows=len(rows),
        planned=planned if isinstance(planned, int) else len(planned),
        **listed,
        failed=sum(r["status"].startswith("FAIL") for r in rows),
        geomean_vs_cudnn=_geomean(vs_cudnn) if vs_cudnn else None,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the rows and the environment as JSON")
    parser.add_argument("--only", nargs="+", metavar="WORD", help="cases whose name contains one of these")
    parser.add_argument(
        "--part", type=_part, default=(1, 1), metavar="K/N", help="every N-th of those cases, from the K-th"
    )
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--budget", type=float, default=0.5, metavar="S", help="seconds of timed calls per number")
    parser.add_argument("--floors", type=Path, default=FLOORS)
    parser.add_argument(
        "--after",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="measure only the rows these results files (of a run cut short) lack, for --report with them",
    )
    parser.add_argument(
        "--report",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="print results files (one run's parts) as the README's table",
    )
    args = parser.parse_args(argv)
    if args.report:
        print(render(merge([json.loads(path.read_text()) for path in args.report])), end="")
        return 0
    if jax.default_backend() != "gpu":
        parser.error("the performance check times GPU kernels; run it on an NVIDIA GPU")
    shapes = select(args.only, args.part)
    floors = json.loads(args.floors.read_text())["floors"]
    env = dict(probe(), date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    if load_tokamax() is not None:
        env["versions"]["tokamax"] = importlib.metadata.version("tokamax")
    print(f"jaxtile {env['git']['commit']} (dirty: {env['git']['dirty']}) from {env['git']['jaxtile_file']}")
    print(f"on {env['device']}, jax {jax.__version__}")
    try:
        planned = _rest(shapes, args.modes, [json.loads(path.read_text()) for path in args.after or ()], env)
    except ValueError as exc:
        parser.error(f"--after: {exc}")
    done = {(s.name, m) for s in shapes for m in args.modes} - set(planned)

    def write(rows):
        if args.out:
            results = dict(environment=env, summary=_summary(rows, planned), rows=rows)
            args.out.write_text(json.dumps(results, indent=1) + "\n")

    rows = run(shapes, args.modes, args.budget, floors, on_row=write, skip=done)
    summary = _summary(rows, planned)
    failed = summary["failed"]
    geomean = summary["geomean_vs_cudnn"]
    print(f"{len(rows) - failed} of {len(rows)} at or above their floors; geomean vs cuDNN {geomean}")
    print("\n".join(_standard_lines(rows)).strip())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
