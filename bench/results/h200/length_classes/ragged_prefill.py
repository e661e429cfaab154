"""mosaic_v3 (jaxtile's default on the H200) with per-sequence lengths against cuDNN
(``jax.nn.dot_product_attention`` with ``query_seq_lengths`` and
``key_value_seq_lengths``), forward and forward+backward, in one process: the calls whose
tile bounds come from `MaskSpec.tile_bounds` in XLA before the kernel. Run once per
version, each from its own directory (it prints the ``jaxtile`` it imported). Queries
and keys share each sequence's length, so cuDNN's top-left causal mask is jaxtile's.
Usage: PYTHONPATH=. python ragged_prefill.py [PASSES [CASE:MODE ...]] (default: 2 passes,
every case and mode)."""

import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxtile
from bench import check

# (name, batch, seq, heads, head_dim, causal)
CASES = (
    ("ragged_8x2k_d128", 8, 2048, 16, 128, True),
    ("ragged_16x1k_d64", 16, 1024, 32, 64, True),
    ("ragged_4x4k_d128", 4, 4096, 16, 128, True),
    ("ragged_8x2k_d128_noncausal", 8, 2048, 16, 128, False),
)


def main(passes: int = 2, only: tuple[str, ...] = ()):
    stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
    print(jaxtile.__file__, stamp.get("commit"), jax.__version__, jax.devices()[0].device_kind, flush=True)
    base = next(s for s in check.SHAPES if s.name == "documents_8x2k_causal_16k")
    rng = np.random.default_rng(3)
    for name, batch, seq, heads, head_dim, causal in CASES:
        shape = dataclasses.replace(
            base, name=name, batch=batch, seq=seq, heads=heads, kv_heads=heads, head_dim=head_dim, causal=causal
        )
        shape = dataclasses.replace(shape, documents=0)
        lengths = jnp.asarray(rng.integers(seq // 2, seq + 1, (batch,)), jnp.int32)
        variants = {
            "jaxtile": lambda q, k, v, bias=None, mask=None, c=causal, L=lengths: jaxtile.flash_attention(
                q, k, v, causal=c, q_lengths=L, kv_lengths=L
            ),
            "cudnn": lambda q, k, v, bias=None, mask=None, c=causal, L=lengths: jax.nn.dot_product_attention(
                q, k, v, is_causal=c, query_seq_lengths=L, key_value_seq_lengths=L, implementation="cudnn"
            ),
        }
        for mode in ("fwd", "fwdbwd"):
            if only and f"{name}:{mode}" not in only:
                continue
            ms = check.timed_passes(variants, shape, mode, passes=passes)
            mine, theirs = min(x for x in ms["jaxtile"] if x), min((x for x in ms["cudnn"] if x), default=None)
            text = "  ".join(
                f"{label} {','.join(f'{x:.4f}' if x else 'err' for x in runs)}" for label, runs in ms.items()
            )
            ratio = f"{theirs / mine:.3f}x cudnn" if theirs else "cudnn err"
            print(f"{name:28s} {mode:6s} {text}  {ratio}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2, tuple(sys.argv[2:]))
