"""Whether the recognised Flax mask's slow first compile is the compile or the first
seconds of the process: the recognised call (d64_4k_dense_causal) compiled once and timed
six times in a row as `bench.check` times it, then compiled again and timed twice, then
the causal call and cuDNN timed twice each, in one process."""

import json
from pathlib import Path

import jax

import jaxtile
from bench import check

stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
print(jaxtile.__file__, stamp.get("commit"), jax.__version__, jax.devices()[0].device_kind, flush=True)

shape = next(s for s in check.SHAPES if s.name == "d64_4k_dense_causal")
(q, k, v), mask, _ = check._inputs(shape, "fwd")
variants = {
    "recognised": lambda q, k, v, mask: jaxtile.flash_attention(q, k, v, mask=mask),
    "causal": lambda q, k, v, mask: jaxtile.flash_attention(q, k, v, causal=True),
    "cudnn": lambda q, k, v, mask: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"),
}
for label, timings in [("recognised", 6), ("recognised", 2), ("causal", 2), ("cudnn", 2)]:
    jax.clear_caches()
    compiled = jax.jit(variants[label]).lower(q, k, v, mask).compile()
    for i in range(timings):
        timing = check._worker.time_batches(lambda c=compiled: c(q, k, v, mask), jax.block_until_ready, 0.5)
        print(f"{label} timing {i}: {timing.ms:.4f} ms (lo {timing.ms_lo:.4f}, hi {timing.ms_hi:.4f})", flush=True)
