"""The other calls that run persistent programs (`v3._persistent`): causal and non-causal
1K and 2K, and ragged lengths over 2K keys, each kernel's own time over 20 calls under
`jax.profiler.trace` (`kernel_times.kernel_time`). Run one version per process, from the
repository root with the version's directory first on PYTHONPATH; prints the
``jaxtile`` imported. Usage: python short_rows.py OUT LABEL."""

import sys
from pathlib import Path

import jax.numpy as jnp
from kernel_times import kernel_time  # this script's folder is first on sys.path

import jaxtile
from bench import check

SHAPES = (
    check.Shape("d128_1k_causal", 16, 1024, 16, 128, causal=True),
    check.Shape("d128_2k_causal", 8, 2048, 16, 128, causal=True),
    check.Shape("d64_2k_causal", 8, 2048, 32, 64, causal=True),
    check.Shape("d128_2k_full", 8, 2048, 16, 128),
    check.Shape("d128_2k_ragged_causal", 8, 2048, 16, 128, causal=True),
)


def _attend(shape):
    if "ragged" not in shape.name:
        return check._jaxtile(shape)
    lengths = jnp.linspace(shape.seq // 8, shape.seq, shape.batch).astype(jnp.int32)

    def attend(q, k, v, mask=None):
        return jaxtile.flash_attention(q, k, v, causal=shape.causal, q_lengths=lengths, kv_lengths=lengths)

    return attend


def main():
    out, label = Path(sys.argv[1]), sys.argv[2]
    print(label, jaxtile.__file__, flush=True)
    for shape in SHAPES:
        line = kernel_time(shape, _attend(shape), out / f"trace_{label}_{shape.name}")
        print(f"{label:8} {shape.name:24}", line, flush=True)


if __name__ == "__main__":
    main()
