"""Packed documents on mosaic_v3's forward: the default tiling (256-key tiles, one program
per query tile: the 16K causal call's) against 128-key tiles (the short causal call's)
and persistent programs, beside the same documents as separate sequences, in one process;
jax's caches cleared between variants."""

import dataclasses
import subprocess

import jax

import jaxtile
from bench import check
from jaxtile.mosaic import v3

commit = subprocess.run(["cat", "VERSION.json"], capture_output=True, text=True).stdout.strip()
print(jaxtile.__file__, commit, jax.__version__, jax.devices()[0].device_kind, flush=True)

VARIANTS = {
    "default": None,
    "bk128": v3.Tuning(block_k=128),
    "bk128_persistent": v3.Tuning(block_k=128, persistent=True),
    "bk256_persistent": v3.Tuning(block_k=256, persistent=True),
    "bk128_3stages": v3.Tuning(block_k=128, num_stages=3),
}
base = next(s for s in check.SHAPES if s.name == "documents_8x2k_causal_16k")
SHAPES = [
    base,
    dataclasses.replace(base, name="documents_4x4k_causal_16k", documents=4),
    dataclasses.replace(base, name="documents_32x512_causal_16k", documents=32),
    dataclasses.replace(base, name="documents_8x2k_d64", heads=32, head_dim=64),
]


def packed(shape, tuning):
    ids = check._segment_ids(shape)
    return lambda q, k, v, bias=None, mask=None: jaxtile.flash_attention(
        q, k, v, causal=True, segment_ids=ids, tuning=tuning
    )


for shape in SHAPES:
    modes = ("fwd", "fwdbwd") if shape is base else ("fwd",)
    for mode in modes:
        ms = {}
        for _pass in range(2):
            for label, tuning in VARIANTS.items():
                jax.clear_caches()
                ms.setdefault(label, []).append(check._timed(packed(shape, tuning), shape, mode, 0.5).get("ms"))
            jax.clear_caches()
            ms.setdefault("separate", []).append(check._timed(check._separate_documents(shape), shape, mode, 0.5)["ms"])
        sep = min(ms["separate"])
        line = " ".join(f"{k}={','.join(f'{x:.4f}' if x else 'err' for x in v)}" for k, v in ms.items())
        print(shape.name, mode, line, flush=True)
        for label, v in ms.items():
            best = min(x for x in v if x) if any(v) else None
            if best:
                print(f"  {shape.name} {mode} {label:18s} {best:.4f} ms {sep / best:.3f}x separate", flush=True)
