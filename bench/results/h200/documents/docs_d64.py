"""Packed documents at head dim 64 on mosaic_v3's forward: 256-key tiles (the default
before 128 became the most for segment ids) against 128-key tiles, one program per
query tile, beside the same documents as separate sequences; two passes, jax's caches
cleared between variants. 32 heads of 64, 16K, as 8 × 2K, 4 × 4K and 32 × 512 causal
documents, one causal document, and 8 × 2K without the causal mask; forward+backward
for 8 × 2K causal."""

import dataclasses
import json
from pathlib import Path

import jax

import jaxtile
from bench import check
from jaxtile.mosaic import v3

stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
print(
    jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind, flush=True
)

base = next(s for s in check.SHAPES if s.name == "documents_8x2k_d64_causal_16k")
SHAPES = [
    base,
    dataclasses.replace(base, name="documents_4x4k_d64", documents=4),
    dataclasses.replace(base, name="documents_32x512_d64", documents=32),
    dataclasses.replace(base, name="documents_1x16k_d64", documents=1),
    dataclasses.replace(base, name="documents_8x2k_d64_full", causal=False),
]
VARIANTS = {"bk256": v3.Tuning(block_k=256), "bk128": v3.Tuning(block_k=128)}


def attend(shape, tuning):
    ids = check._segment_ids(shape)
    return lambda q, k, v, bias=None, mask=None: jaxtile.flash_attention(
        q, k, v, causal=shape.causal, segment_ids=ids, tuning=tuning, implementation="mosaic_v3"
    )


for shape in SHAPES:
    for mode in ("fwd", "fwdbwd") if shape is base else ("fwd",):
        variants = {label: attend(shape, tuning) for label, tuning in VARIANTS.items()}
        ms = check.timed_passes({**variants, "separate": check._separate_documents(shape)}, shape, mode)
        separate = min(ms["separate"])
        for label, runs in ms.items():
            best = min((x for x in runs if x), default=None)
            runs_text = ",".join(f"{x:.4f}" if x else "err" for x in runs)
            ratio = f"{separate / best:.3f}x separate" if best else "error"
            print(f"{shape.name:30s} {mode:6s} {label:9s} {runs_text:16s} {ratio}", flush=True)
