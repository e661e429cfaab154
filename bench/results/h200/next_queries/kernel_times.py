"""The forward kernels' own time on the persistent window rows, for A/B runs whose call
times move by ±5% between processes: each row of `bench.check` (and tokamax's on the
(256, 256) window, as a yardstick) run 20 times under `jax.profiler.trace`, the kernels'
mean from `bench.profile.summarise`. Run one version per process, from the repository
root with the version's directory first on PYTHONPATH; prints the ``jaxtile`` imported.
Usage: python kernel_times.py OUT LABEL."""

import sys
from pathlib import Path

import jax

import jaxtile
from bench import check, profile

ROWS = (("window_256_256_16k", "jaxtile"), ("window_256_256_16k", "tokamax"), ("window_1023_causal_16k", "jaxtile"))
CALLS = 20


def kernel_time(shape, attend, trace: Path) -> str:
    """The top kernel line of `bench.profile.summarise` for ``attend`` on ``shape``'s forward
    inputs: compiled once, 50 calls to warm up, then `CALLS` traced into ``trace``."""
    primals, mask, _ = check._inputs(shape, "fwd")
    args = (mask, *primals)
    compiled = jax.jit(lambda mask, *p: attend(*p, mask=mask)).lower(*args).compile()
    call = lambda: compiled(*args)  # noqa: E731
    for _ in range(50):
        call()
    jax.block_until_ready(call())
    profile.traced(call, trace, CALLS)
    kernels = [line for line in profile.summarise(trace, CALLS).splitlines() if line.strip().startswith("gpu ")]
    return kernels[0] if kernels else ""


def main():
    out, label = Path(sys.argv[1]), sys.argv[2]
    print(label, jaxtile.__file__, flush=True)
    for name, who in ROWS:
        shape = next(s for s in check.SHAPES if s.name == name)
        attend = check._jaxtile(shape) if who == "jaxtile" else check._tokamax(shape)
        line = kernel_time(shape, attend, out / f"trace_{label}_{name}_{who}")
        print(f"{label:8} {name:24} {who:8}", line, flush=True)


if __name__ == "__main__":
    main()
