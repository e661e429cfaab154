"""The recognised Flax mask's forward compiled eight times in one process (jax's caches
cleared between): each compile's median time and a hash of its optimised HLO, which are
written to OUT (argv[1]) so that a slow compile's can be compared with a fast one's."""

import hashlib
import json
import sys
from pathlib import Path

import jax

import jaxtile
from bench import check

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
print(jaxtile.__file__, stamp.get("commit"), jax.__version__, jax.devices()[0].device_kind, flush=True)

shape = next(s for s in check.SHAPES if s.name == "d64_4k_dense_causal")
(q, k, v), mask, _ = check._inputs(shape, "fwd")


def recognised(q, k, v, mask):
    return jaxtile.flash_attention(q, k, v, mask=mask)


for compile_ in range(8):
    jax.clear_caches()
    compiled = jax.jit(recognised).lower(q, k, v, mask).compile()
    hlo = compiled.as_text()
    digest = hashlib.sha256(hlo.encode()).hexdigest()[:12]
    (out / f"recognised_{compile_}_{digest}.hlo").write_text(hlo)
    timing = check._worker.time_batches(lambda c=compiled: c(q, k, v, mask), jax.block_until_ready, 0.5)
    print(
        f"compile {compile_}: {timing.ms:.4f} ms (lo {timing.ms_lo:.4f}, hi {timing.ms_hi:.4f}) hlo {digest}",
        flush=True,
    )
