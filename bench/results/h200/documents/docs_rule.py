"""Which key tiles packed documents take at head dim 64, and where the 8 × 2K forward at
head dim 128 loses to the separate sequences. In one process, two passes, jax's caches
cleared between variants:

* documents at uneven lengths (boundaries not on tile edges: 8 and 32 documents cut at
  random points of 16K, 32 heads of 64), causal and not, in 256- and 128-key tiles;
* the 8 × 2K causal documents at head dim 128, packed, against the separate sequences
  with their default (persistent programs, `v3._persistent`) and with one program per
  query tile."""

import json
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

d128 = next(s for s in check.SHAPES if s.name == "documents_8x2k_causal_16k")
d64 = next(s for s in check.SHAPES if s.name == "documents_8x2k_d64_causal_16k")


def uneven_ids(documents: int, seq: int, seed: int):
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, seq), documents - 1, replace=False))
    return jnp.asarray(np.searchsorted(cuts, np.arange(seq), side="right"), jnp.int32)[None]


def packed(ids, causal, tuning=None):
    return lambda q, k, v, bias=None, mask=None: jaxtile.flash_attention(
        q, k, v, causal=causal, segment_ids=ids, tuning=tuning, implementation="mosaic_v3"
    )


def separate(shape, tuning):
    docs, doc = shape.documents, shape.seq // shape.documents

    def attend(q, k, v, bias=None, mask=None):
        split = [x.reshape(x.shape[0] * docs, doc, *x.shape[2:]) for x in (q, k, v)]
        out = jaxtile.flash_attention(*split, causal=True, tuning=tuning, implementation="mosaic_v3")
        return out.reshape(q.shape[0], shape.seq, *out.shape[2:])

    return attend


def compare(title, shape, variants):
    ms = check.timed_passes(variants, shape, "fwd")
    first = min(x for x in next(iter(ms.values())) if x)
    for label, runs in ms.items():
        best = min((x for x in runs if x), default=None)
        runs_text = ",".join(f"{x:.4f}" if x else "err" for x in runs)
        speed = f"{first / best:.3f}x {next(iter(ms))}" if best else "error"
        print(f"{title:28s} {label:22s} {runs_text:16s} {speed}", flush=True)


for documents in (8, 32):
    ids = uneven_ids(documents, d64.seq, documents)
    for causal in (True, False):
        title = f"uneven_{documents}_d64_{'causal' if causal else 'full'}"
        compare(title, d64, {f"bk{bk}": packed(ids, causal, v3.Tuning(block_k=bk)) for bk in (256, 128)})

compare(
    "documents_8x2k_causal_16k",
    d128,
    {
        "packed": packed(check._segment_ids(d128), True),
        "separate_default": separate(d128, None),
        "separate_one_per_tile": separate(d128, v3.Tuning()),
    },
)
