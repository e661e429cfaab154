"""Packed documents at head dim 64, forward+backward: the Mosaic backward's default
128-row query tiles against 64-row ones (which dense masks take: a masked tile's mask
beside the scores spilled at 128 rows), on 8 × 2K causal documents (beside the separate
sequences) and on 8 documents cut at random points, causal and not; two passes, jax's
caches cleared between variants."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxtile
from bench import check
from jaxtile.mosaic import v3
from jaxtile.mosaic.backward import BackwardTuning

stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
print(
    jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind, flush=True
)

d64 = next(s for s in check.SHAPES if s.name == "documents_8x2k_d64_causal_16k")
VARIANTS = {
    "rows128": v3.Tuning(backward=BackwardTuning(block_q=128)),
    "rows64": v3.Tuning(backward=BackwardTuning(block_q=64)),
}


def packed(ids, causal, tuning):
    return lambda q, k, v, bias=None, mask=None: jaxtile.flash_attention(
        q, k, v, causal=causal, segment_ids=ids, tuning=tuning, implementation="mosaic_v3"
    )


def report(title, ms):
    first = min(x for x in next(iter(ms.values())) if x)
    for label, runs in ms.items():
        best = min((x for x in runs if x), default=None)
        runs_text = ",".join(f"{x:.4f}" if x else "err" for x in runs)
        speed = f"{first / best:.3f}x {next(iter(ms))}" if best else "error"
        print(f"{title:28s} {label:10s} {runs_text:16s} {speed}", flush=True)


aligned = check._segment_ids(d64)
variants = {label: packed(aligned, True, t) for label, t in VARIANTS.items()}
report(
    "documents_8x2k_d64 fwdbwd",
    check.timed_passes({**variants, "separate": check._separate_documents(d64)}, d64, "fwdbwd"),
)
cuts = np.sort(np.random.default_rng(8).choice(np.arange(1, d64.seq), 7, replace=False))  # docs_rule.py's
ids = jnp.asarray(np.searchsorted(cuts, np.arange(d64.seq), side="right"), jnp.int32)[None]
for causal in (True, False):
    variants = {label: packed(ids, causal, t) for label, t in VARIANTS.items()}
    report(f"uneven_8_d64_{'causal' if causal else 'full'} fwdbwd", check.timed_passes(variants, d64, "fwdbwd"))
