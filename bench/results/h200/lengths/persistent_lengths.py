"""Persistent programs for masks with lengths (and no segment ids or dense mask) on
mosaic_v3's forward, taking the tiles heaviest first in snaking rounds (`v3._schedule`,
`_ring.tile_order`), against one program per query tile: ragged causal lengths at head
dims 128 and 64 over 1K, 2K and 4K keys, lengths that are the whole sequences, and
ragged non-causal lengths. Then what recognising Flax's causal mask costs
(`MaskSpec.recognise`, before and after one pass for both extents), beside the same call
with ``causal=True`` and cuDNN. In one process, two passes, jax's caches cleared between
variants."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxtile
from bench import check, timing
from jaxtile.mask import MaskSpec
from jaxtile.mosaic import v3

RECOGNISE = MaskSpec.recognise


def two_pass_recognise(self, dense):
    """`MaskSpec.recognise` before this commit: an extent per reduction."""
    q_idx = jnp.arange(self.q_len, dtype=jnp.int32)[:, None]
    kv_idx = jnp.arange(self.kv_len, dtype=jnp.int32)[None, :]
    seen = jnp.broadcast_to(self.visible(q_idx, kv_idx, dense=dense), (*dense.shape[:2], self.q_len, self.kv_len))

    def extent(used):
        n = used.shape[-1]
        return jnp.where(jnp.any(used, axis=-1), n - jnp.argmax(used[:, ::-1], axis=-1), 0).astype(jnp.int32)

    q_length, kv_length = extent(jnp.any(seen, axis=(1, 3))), extent(jnp.any(seen, axis=(1, 2)))
    lengths = (q_length[:, None, None, None], kv_length[:, None, None, None])
    same = jnp.all(seen == self.recognised().visible(q_idx, kv_idx, lengths=lengths))
    return jnp.stack([q_length, kv_length], axis=-1), same


def patched(owner, name: str, value, attend):
    """``attend`` traced with ``owner.name`` set to ``value`` (put back after)."""
    original = getattr(owner, name)

    def traced(*args, **kwargs):
        setattr(owner, name, value)
        try:
            return attend(*args, **kwargs)
        finally:
            setattr(owner, name, original)

    return traced


def lengths_call(shape, lengths, persistent: bool):
    spec = MaskSpec.create(shape.seq, shape.seq, causal=shape.causal, has_lengths=True)
    tuning = dataclasses.replace(v3.default_tuning(shape.head_dim, shape.head_dim, 2, spec), persistent=persistent)
    return lambda q, k, v, bias=None, mask=None: jaxtile.flash_attention(
        q, k, v, causal=shape.causal, kv_lengths=lengths, q_lengths=lengths, implementation="mosaic_v3", tuning=tuning
    )


def report(title, mode, ms):
    first = min(x for x in next(iter(ms.values())) if x)
    for label, runs in ms.items():
        best = min((x for x in runs if x), default=None)
        runs_text = ",".join(f"{x:.4f}" if x else "err" for x in runs)
        speed = f"{first / best:.3f}x {next(iter(ms))}" if best else "error"
        print(f"{title:28s} {mode:6s} {label:14s} {runs_text:16s} {speed}", flush=True)


# (name, batch, seq, heads, head_dim, causal, ragged lengths or whole sequences)
CASES = (
    ("ragged_8x2k_d128", 8, 2048, 16, 128, True, True),
    ("ragged_16x1k_d64", 16, 1024, 32, 64, True, True),
    ("ragged_4x4k_d128", 4, 4096, 16, 128, True, True),
    ("full_8x2k_d128", 8, 2048, 16, 128, True, False),
    ("ragged_8x2k_d128_noncausal", 8, 2048, 16, 128, False, True),
)


def lengths_cases(cases):
    """``(shape, lengths)`` of each of ``cases`` (as `CASES`), the ragged lengths drawn
    in turn from one seeded generator."""
    base = next(s for s in check.SHAPES if s.name == "documents_8x2k_causal_16k")
    rng = np.random.default_rng(3)
    shaped = []
    for name, batch, seq, heads, head_dim, causal, ragged in cases:
        shape = dataclasses.replace(
            base,
            name=name,
            batch=batch,
            seq=seq,
            heads=heads,
            kv_heads=heads,
            head_dim=head_dim,
            causal=causal,
            documents=0,
        )
        lengths = rng.integers(1, seq + 1, (batch,)) if ragged else np.full((batch,), seq)
        shaped.append((shape, jnp.asarray(lengths, jnp.int32)))
    return shaped


def main():
    stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
    print(jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind)
    cases = lengths_cases(CASES)
    for shape, lengths in cases:
        for mode in ("fwd", "fwdbwd") if shape.name == "ragged_8x2k_d128" else ("fwd",):
            variants = {"grid": lengths_call(shape, lengths, False), "persistent": lengths_call(shape, lengths, True)}
            report(shape.name, mode, check.timed_passes(variants, shape, mode))

    flax = next(s for s in check.SHAPES if s.name == "d64_4k_dense_causal")
    mask = check._dense_mask(flax)
    spec = MaskSpec.create(flax.seq, flax.seq, has_dense_mask=True)
    for label, recognise in (("one_pass", RECOGNISE), ("two_pass", two_pass_recognise)):
        ms = [timing.time_jitted(lambda m, r=recognise: r(spec, m[None, None]), [mask], 0.5).ms for _ in range(2)]
        print(f"{'recognise_' + flax.name:28s} alone  {label:14s} {','.join(f'{x:.4f}' for x in ms)}", flush=True)
    variants = {
        "one_pass": check._jaxtile(flax),
        "two_pass": patched(MaskSpec, "recognise", two_pass_recognise, check._jaxtile(flax)),
        "causal": check._jaxtile(dataclasses.replace(flax, dense_mask=None)),
        "cudnn": check._cudnn(flax),
    }
    report(flax.name, "fwd", check.timed_passes(variants, flax, "fwd"))


if __name__ == "__main__":
    main()
