"""Where the forward rows that trail tokamax's Mosaic kernel spend their time: the check's
(256, 256) window, head dim 128 non-causal 4K, head dim 128 causal 16K and the bias row,
each forward timed as `bench.check` times it, then 20 back-to-back calls under
`jax.profiler.trace`, jaxtile's default and tokamax in one process (jax's caches cleared
between); the script prints `bench.profile.summarise` of each (the GPU's kernels by total
time, the busy share, the gaps between kernels). OUT is argv[1]."""

import json
import sys
from pathlib import Path

import jax

import jaxtile
from bench import check, profile

NAMES = ("window_256_256_16k", "d128_4k_full", "d128_16k_causal", "bias_d128_causal_8k")
CALLS = 20


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
    print(jaxtile.__file__, stamp.get("commit"), jax.__version__, jax.devices()[0].device_kind, flush=True)
    for name in NAMES:
        shape = next(s for s in check.SHAPES if s.name == name)
        primals, mask, _ = check._inputs(shape, "fwd")
        for label, attend in (("jaxtile", check._jaxtile(shape)), ("tokamax", check._tokamax(shape))):
            jax.clear_caches()
            args = (mask, *primals)
            compiled = jax.jit(lambda mask, *p, attend=attend: attend(*p, mask=mask)).lower(*args).compile()
            call = lambda c=compiled, args=args: c(*args)  # noqa: E731
            timing = check._worker.time_batches(call, jax.block_until_ready, 0.5)
            trace_dir = out / f"trace_{name}_{label}"
            profile.traced(call, trace_dir, CALLS)
            print(f"{name} {label}: {timing.ms:.4f} ms (lo {timing.ms_lo:.4f}, hi {timing.ms_hi:.4f})", flush=True)
            print(profile.summarise(trace_dir, CALLS), flush=True)


if __name__ == "__main__":
    main()
