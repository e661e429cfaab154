"""Packed documents at head dim 128 in 64-key tiles, whose segment test holds half the
keys' ids in registers (in 128-key tiles the forward spills, `ptxas_persist_161f0bc.txt`):
with the argument ``ptxas``, ptxas's lines for the forward with segment ids in 64-key
tiles, one program per tile and persistent (run with MOSAIC_GPU_DUMP_PTXAS=1); else the forward of packed causal
documents (16 heads of 128, 16K: 8 × 2K, 4 × 4K, one document, 8 cut at random points)
in 128- and 64-key tiles, one program per tile and persistent, beside the separate
sequences. In one process, two passes, jax's caches cleared between variants."""

import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxtile
from bench import check
from jaxtile.mosaic import v3

stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
print(
    jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind, flush=True
)

base = next(s for s in check.SHAPES if s.name == "documents_8x2k_causal_16k")
VARIANTS = {
    "bk128": v3.Tuning(),
    "bk64": v3.Tuning(block_k=64),
    "bk128_persistent": v3.Tuning(persistent=True),
    "bk64_persistent": v3.Tuning(block_k=64, persistent=True),
    "bk64_3stages_persistent": v3.Tuning(block_k=64, num_stages=3, persistent=True),
}


def packed(ids, tuning):
    return lambda q, k, v, bias=None, mask=None: jaxtile.flash_attention(
        q, k, v, causal=True, segment_ids=ids, tuning=tuning, implementation="mosaic_v3"
    )


def uneven_ids(documents: int, seq: int, seed: int):
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, seq), documents - 1, replace=False))
    return jnp.asarray(np.searchsorted(cuts, np.arange(seq), side="right"), jnp.int32)[None]


if sys.argv[1:] == ["ptxas"]:
    (q, k, v), _, _ = check._inputs(base, "fwd")
    for label in ("bk64", "bk64_persistent"):
        print(f"=== ptxas {label}", file=sys.stderr, flush=True)
        jax.block_until_ready(jax.jit(packed(check._segment_ids(base), VARIANTS[label]))(q, k, v))
    sys.exit()

CASES = [
    (base, "fwd", None),
    (base, "fwdbwd", None),
    (dataclasses.replace(base, name="documents_4x4k", documents=4), "fwd", None),
    (dataclasses.replace(base, name="documents_1x16k", documents=1), "fwd", None),
    (dataclasses.replace(base, name="documents_8_uneven"), "fwd", uneven_ids(8, base.seq, 8)),
]
for shape, mode, ids in CASES:
    ids = check._segment_ids(shape) if ids is None else ids
    variants = {label: packed(ids, tuning) for label, tuning in VARIANTS.items()}
    if shape.name != "documents_8_uneven":
        variants["separate"] = check._separate_documents(shape)
    ms = check.timed_passes(variants, shape, mode)
    first = min(x for x in ms["bk128"] if x)
    for label, runs in ms.items():
        best = min((x for x in runs if x), default=None)
        runs_text = ",".join(f"{x:.4f}" if x else "err" for x in runs)
        speed = f"{first / best:.3f}x bk128" if best else "error"
        print(f"{shape.name:28s} {mode:6s} {label:24s} {runs_text:16s} {speed}", flush=True)
