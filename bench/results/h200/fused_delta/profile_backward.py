"""The kernels of mosaic_v3's forward+backward under the profiler (`bench.profile`), for
the rows 1268e8b slowed most: run once from a directory holding 7b32fb7's jaxtile and
once from one holding 1268e8b's, to see where the time went (the dQ kernel, against the
XLA pass over O and dO it replaced; the kernels' times in launch order). Usage, from a directory holding jaxtile/ and bench/:
PYTHONPATH=. python profile_backward.py
"""

import functools
import gzip
import json
import statistics
import tempfile
from pathlib import Path

import jax

import jaxtile
from bench.check import SHAPES, _inputs
from bench.profile import summarise, traced

CALLS = 10
CASES = ("d128_4k_full", "d128_16k_causal", "d64_4k_causal")


def _kernels_in_turn(trace_dir: Path) -> str:
    """The median time of each of a call's Mosaic kernels, in launch order (they share a
    name, which `summarise` sums over)."""
    (path,) = trace_dir.glob("plugins/profile/*/*.trace.json.gz")
    with gzip.open(path) as fp:
        events = json.load(fp)["traceEvents"]
    kernels = sorted((e for e in events if e.get("name") == "entry_mosaic_gpu_kernel"), key=lambda e: e["ts"])
    per_call = len(kernels) // CALLS
    medians = [statistics.median(e["dur"] for e in kernels[i::per_call]) for i in range(per_call)]
    return "  mosaic kernels in launch order: " + ", ".join(f"{us:.1f}" for us in medians) + " us"


def _profile(name, run, args):
    for _ in range(3):
        jax.block_until_ready(run(*args))
    with tempfile.TemporaryDirectory() as tmp:
        traced(lambda: run(*args), Path(tmp), CALLS)
        print(f"== {name}\n{summarise(Path(tmp), CALLS, top=8)}\n{_kernels_in_turn(Path(tmp))}", flush=True)


def _fwdbwd(q, k, v, dout, *, causal: bool):
    out, vjp = jax.vjp(lambda q, k, v: jaxtile.flash_attention(q, k, v, causal=causal), q, k, v)
    return out, *vjp(dout)


def main():
    print("jaxtile from", jaxtile.__file__, "on", jax.devices()[0].device_kind, "jax", jax.__version__)
    for shape in (s for s in SHAPES if s.name in CASES):
        (q, k, v), _, dout = _inputs(shape, "fwdbwd")
        run = jax.jit(functools.partial(_fwdbwd, causal=shape.causal))
        _profile(f"{shape.name} fwdbwd", run, (q, k, v, dout))


if __name__ == "__main__":
    main()
