"""The recognised Flax mask's forward (d64_4k_dense_causal) profiled: four compiles of it
and one of the causal call, in one process (jax's caches cleared between). Each compile
is timed as `bench.check` times it, then 20 back-to-back calls run under
`jax.profiler.trace`; the script prints, per compile, `bench.profile.summarise` of
them (the summary was this script's own when its log was written). OUT is argv[1]."""

import json
import sys
from pathlib import Path

import jax

import jaxtile
from bench import check, profile

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
print(jaxtile.__file__, stamp.get("commit"), jax.__version__, jax.devices()[0].device_kind, flush=True)

shape = next(s for s in check.SHAPES if s.name == "d64_4k_dense_causal")
(q, k, v), mask, _ = check._inputs(shape, "fwd")
CALLS = 20


def recognised(q, k, v, mask):
    return jaxtile.flash_attention(q, k, v, mask=mask)


def causal(q, k, v, mask):
    return jaxtile.flash_attention(q, k, v, causal=True)


variants = [("recognised", recognised)] * 4 + [("causal", causal)]
for i, (label, fn) in enumerate(variants):
    jax.clear_caches()
    compiled = jax.jit(fn).lower(q, k, v, mask).compile()
    call = lambda c=compiled: c(q, k, v, mask)  # noqa: E731
    timing = check._worker.time_batches(call, jax.block_until_ready, 0.5)
    trace_dir = out / f"trace_{i}_{label}"
    profile.traced(call, trace_dir, CALLS)
    print(f"compile {i} {label}: {timing.ms:.4f} ms (lo {timing.ms_lo:.4f}, hi {timing.ms_hi:.4f})", flush=True)
    print(profile.summarise(trace_dir, CALLS), flush=True)
