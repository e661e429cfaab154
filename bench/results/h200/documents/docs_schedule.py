"""Persistent programs that take the tiles of a runtime mask heaviest first (an ordered
`_ring.Schedule`, `_ring.tile_order`) against one program per query tile, on mosaic_v3's
forward: packed documents (16 heads of 128, causal, 16K, as 8 × 2K, 4 × 4K, 32 × 512 and
one document; 8 × 2K at head dim 64 too) beside the same documents as separate
sequences, and a dense mask that is not recognised beside cuDNN; two passes, jax's
caches cleared between variants. Then 20 calls of the 8 × 2K forward, packed (both
schedules) and separate, under the profiler (`bench.profile`). OUT is argv[1]."""

import dataclasses
import json
import sys
from pathlib import Path

import jax

import jaxtile
from bench import check, profile
from jaxtile.mosaic import v3

out = Path(sys.argv[1])
stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
print(
    jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind, flush=True
)

base = next(s for s in check.SHAPES if s.name == "documents_8x2k_causal_16k")
dense = next(s for s in check.SHAPES if s.name == "d64_4k_dense_unrecognised")
SHAPES = [
    base,
    dataclasses.replace(base, name="documents_4x4k", documents=4),
    dataclasses.replace(base, name="documents_32x512", documents=32),
    dataclasses.replace(base, name="documents_1x16k", documents=1),
    dataclasses.replace(base, name="documents_8x2k_d64", heads=32, head_dim=64),
    dense,
]
VARIANTS = {
    "one_per_tile": None,
    "ordered": v3.Tuning(persistent=True),
    "ordered_bk256": v3.Tuning(block_k=256, persistent=True),
}


def attend(shape, tuning):
    options = dict(segment_ids=check._segment_ids(shape), causal=True) if shape.documents else {}
    return lambda q, k, v, bias=None, mask=None: jaxtile.flash_attention(
        q, k, v, mask=mask, tuning=tuning, implementation="mosaic_v3", **options
    )


for shape in SHAPES:
    head_dim_64 = shape.head_dim == 64 and not shape.dense_mask
    variants = {k: t for k, t in VARIANTS.items() if k != "ordered_bk256" or head_dim_64}
    if head_dim_64:
        variants["one_per_tile"] = v3.Tuning(block_k=256)
        variants["ordered"] = v3.Tuning(block_k=128, persistent=True)
    peer_name, peer = (
        ("separate", check._separate_documents(shape)) if shape.documents else ("cudnn", check._cudnn(shape))
    )
    for mode in ("fwd", "fwdbwd") if shape is base else ("fwd",):
        attends = {label: attend(shape, tuning) for label, tuning in variants.items()}
        ms = check.timed_passes({**attends, peer_name: peer}, shape, mode)
        best_peer = min(x for x in ms[peer_name] if x)
        for label, runs in ms.items():
            best = min((x for x in runs if x), default=None)
            runs_text = ",".join(f"{x:.4f}" if x else "err" for x in runs)
            ratio = f"{best_peer / best:.3f}x {peer_name}" if best else "error"
            print(f"{shape.name:28s} {mode:6s} {label:14s} {runs_text:16s} {ratio}", flush=True)

CALLS = 20
(q, k, v), _, _ = check._inputs(base, "fwd")
for label, fn in (
    ("packed_one_per_tile", attend(base, None)),
    ("packed_ordered", attend(base, v3.Tuning(persistent=True))),
    ("separate", check._separate_documents(base)),
):
    jax.clear_caches()
    compiled = jax.jit(fn).lower(q, k, v).compile()
    call = lambda c=compiled: c(q, k, v)  # noqa: E731
    timing = check._worker.time_batches(call, jax.block_until_ready, 0.5)
    trace_dir = out / f"trace_{label}"
    profile.traced(call, trace_dir, CALLS)
    print(f"profile {label}: {timing.ms:.4f} ms (lo {timing.ms_lo:.4f}, hi {timing.ms_hi:.4f})", flush=True)
    print(profile.summarise(trace_dir, CALLS), flush=True)
