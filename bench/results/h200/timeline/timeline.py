"""Where a forward's fixed cost per query tile goes: every program of mosaic_v3's and of
tokamax's sm90 forward timed on the GPU by Mosaic GPU's on-device profiler.

`../tile_costs/` found mosaic_v3's forward (one program per query tile) costs what
tokamax's does per key step but about 11 µs more a call in the part that does not grow
with the keys: 0.7 µs for each of the ~15.5 waves of programs. This asks whether that is
inside the programs (longer from first to last instruction) or between them (an SM idle
from one program's end to the next one's start). The same is done for forward+backward
on three rows of `bench.check` (each kernel of the call: jaxtile's forward, dK/dV and dQ
in that order), where the kernels' busy share of the SMs shows any tail.

Both kernels go through ``plgpu.kernel``, which this script wraps for the profiled calls:
the kernel's body becomes one named region and its compiler parameters gain a profile
buffer. Each program's warpgroups then record the global timer at their start (ns) and the
SM's clock at the region's entry and exit (cycles), which Mosaic GPU writes out as a
Chrome trace, one folder per kernel. From those, per kernel: each warpgroup's span
(first to last event, in cycles and in µs at the SM clock measured here), the
start-to-start time of successive programs on one SM, the gap that leaves after the
previous program's span, and the SMs' busy share of the kernel's time. Calls without the
profiler are timed beside cuDNN for scale::

    PYTHONPATH=. python timeline.py OUT_DIR [fwd|fwdbwd]

(``fwd``: only the forward rows; ``fwdbwd``: only the forward+backward rows.)
"""

import collections
import dataclasses
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

import jaxtile
from bench import check, timing
from jaxtile.mosaic import v3

BATCH, Q_LEN, HEADS, HEAD_DIM, BLOCK_K = 4, 4096, 16, 128, 128
KV_LENS = (1024, 4096)
FWDBWD = ("d128_16k_causal", "d128_4k_full", "gqa_32_8_causal_8k")
_KERNEL = plgpu.kernel


def _profiled(trace_dir: Path):
    """``plgpu.kernel`` with the body in one named region and a profile buffer, each
    kernel traced writing into its own folder ``<n>_<warpgroups>`` (n: trace order)."""
    count = itertools.count()

    def kernel(body, *args, compiler_params=None, **kwargs):
        folder = trace_dir / f"{next(count)}_{kwargs.get('num_threads') or 1}"
        folder.mkdir(parents=True)
        params = dataclasses.replace(
            compiler_params or plgpu.CompilerParams(), profile_space=64, profile_dir=str(folder)
        )
        return _KERNEL(jax.named_scope("program")(body), *args, compiler_params=params, **kwargs)

    return kernel


def _jaxtile():
    tuning = v3.Tuning(persistent=False)
    return lambda q, k, v: jaxtile.flash_attention(q, k, v, implementation="mosaic_v3", tuning=tuning)


def _tokamax():
    tokamax = check.load_tokamax()
    if tokamax is None:
        return None
    from tokamax._src.ops.attention import pallas_mosaic_gpu as tk

    config = tk.ConfigSM90(block_q=64, block_kv=BLOCK_K, num_stages=2, persistent=False)
    op = tk.PallasMosaicGpuFlashAttention(config=config)
    return lambda q, k, v: tokamax.dot_product_attention(q, k, v, implementation=(op,))


def _cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")


def sm_clock_mhz() -> float:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"], capture_output=True, text=True
    )
    return float(out.stdout.split()[0])


def programs(trace: dict, warpgroups: int) -> dict:
    """``{(block, warpgroup): (sm, start_ns, span_cycles, init_cycles)}`` from one profiled
    call's Chrome trace (Mosaic GPU's ``ProfilerSpec.dump``: each event's ``ts`` is the
    warpgroup's start in ns, the low 32 bits of the global timer, plus the cycles since its
    first event, over 1000). ``init_cycles``: Mosaic GPU's own region ``Init`` (barriers
    and shared memory set up before the body)."""
    events = collections.defaultdict(list)
    for event in trace["traceEvents"]:
        events[(event["pid"], event["tid"])].append((event["name"], event["ph"], event["ts"] * 1e3))
    starts = np.array([stamps[0][2] for stamps in events.values()])
    wrapped = starts.max() - starts.min() > 2**31  # the timer's low word wrapped mid-call
    found = {}
    for (pid, tid), stamps in events.items():
        block, warpgroup = divmod(tid - 1, warpgroups)
        start = stamps[0][2] + (2**32 if wrapped and stamps[0][2] < 2**31 else 0)
        init = [ts for name, _, ts in stamps if name == "Init"]
        found[(block, warpgroup)] = (pid - 1, start, stamps[-1][2] - stamps[0][2], init[-1] - init[0] if init else 0.0)
    return found


def summary(found: dict, mhz: float) -> dict:
    """Per warpgroup, the median span; per SM, start-to-start times of its successive
    programs and the gaps after each program's longest warpgroup span; the SMs' busy share
    of the kernel's time (first start to last end)."""
    warpgroups = 1 + max(wg for _, wg in found)
    spans = {wg: np.array([s for (_, w), (_, _, s, _) in found.items() if w == wg]) for wg in range(warpgroups)}
    inits = np.array([init for (_, _, _, init) in found.values()])
    blocks = collections.defaultdict(dict)
    for (block, wg), (sm, start, span, _) in found.items():
        blocks[block][wg] = (sm, start, span)
    by_sm = collections.defaultdict(list)
    for wgs in blocks.values():
        sm = next(iter(wgs.values()))[0]
        start = min(start for _, start, _ in wgs.values())
        span_ns = max(start + span * 1e3 / mhz for _, start, span in wgs.values()) - start
        by_sm[sm].append((start, span_ns))
    step, gap, first, last = [], [], [], []
    for runs in by_sm.values():
        runs.sort()
        first.append(runs[0][0])
        last.append(runs[-1][0] + runs[-1][1])
        for (a, span_a), (b, _) in itertools.pairwise(runs):
            step.append(b - a)
            gap.append(b - a - span_a)
    t0 = min(first)
    busy = sum(span for runs in by_sm.values() for _, span in runs)
    return dict(
        programs=len(blocks),
        sms=len(by_sm),
        span_cycles={wg: float(np.median(s)) for wg, s in spans.items() if len(s)},
        span_us={wg: float(np.median(s)) / mhz for wg, s in spans.items() if len(s)},
        init_cycles=float(np.median(inits)),
        start_to_start_us=float(np.median(step)) / 1e3 if step else None,  # None: one program per SM
        gap_us=dict(median=float(np.median(gap)) / 1e3, p10=float(np.percentile(gap, 10)) / 1e3) if gap else None,
        first_start_spread_us=(max(first) - t0) / 1e3,
        last_end_spread_us=(max(last) - min(last)) / 1e3,
        kernel_us=(max(last) - t0) / 1e3,
        busy_share=busy / (len(by_sm) * (max(last) - t0)),
        programs_per_sm=float(np.mean([len(r) for r in by_sm.values()])),
    )


def _profile(attend, args, trace_dir: Path) -> dict:
    """``{kernel folder: summary}`` of the last of three profiled calls of ``attend``."""
    jax.clear_caches()
    plgpu.kernel = _profiled(trace_dir)
    try:
        profiled = jax.jit(attend)
        for _ in range(3):
            jax.block_until_ready(profiled(*args))
        time.sleep(0.5)  # the last call's traces are written by host callbacks
    finally:
        plgpu.kernel = _KERNEL
    mhz = sm_clock_mhz()
    kernels = dict(mhz=mhz)
    for folder in sorted(trace_dir.iterdir()):
        traces = sorted(folder.glob("*trace.json"))
        if traces:  # none: the kernel did not run through plgpu.kernel again
            warpgroups = int(folder.name.split("_")[1])
            kernels[folder.name] = summary(programs(json.loads(traces[-1].read_text()), warpgroups), mhz)
    return kernels


def _record(results: dict, key: str, row: dict):
    results[key] = row
    print(key, json.dumps(row), flush=True)


def main():
    out = Path(sys.argv[1])
    stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
    print(jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind)
    results = {}
    variants = {"jaxtile": _jaxtile(), "tokamax": _tokamax(), "cudnn": _cudnn}
    variants = {label: f for label, f in variants.items() if f is not None}
    for kv_len in KV_LENS if sys.argv[2:] != ["fwdbwd"] else ():
        keys = jax.random.split(jax.random.key(kv_len), 3)
        q = jax.random.normal(keys[0], (BATCH, Q_LEN, HEADS, HEAD_DIM), jnp.bfloat16)
        k, v = (jax.random.normal(key, (BATCH, kv_len, HEADS, HEAD_DIM), jnp.bfloat16) for key in keys[1:])
        for label, attend in variants.items():
            jax.clear_caches()
            row = dict(ms=timing.time_jitted(attend, [q, k, v], 0.5).ms)
            if label != "cudnn":
                row.update(_profile(attend, (q, k, v), out / f"{label}_{kv_len}"))
            _record(results, f"{label}_{kv_len}", row)
    for shape in (s for s in check.SHAPES if s.name in FWDBWD and sys.argv[2:] != ["fwd"]):
        primals, _, dout = check._inputs(shape, "fwdbwd")
        peers = {"jaxtile": lambda q, k, v, shape=shape: jaxtile.flash_attention(q, k, v, causal=shape.causal)}
        peers["tokamax"] = check._tokamax(shape)
        for label, attend in peers.items():
            if attend is None:
                continue

            def fwdbwd(dout, *primals, attend=attend):
                out, vjp = jax.vjp(attend, *primals)
                return out, *vjp(dout)

            jax.clear_caches()
            row = dict(ms=timing.time_jitted(fwdbwd, [dout, *primals], 0.5).ms)
            row.update(_profile(fwdbwd, (dout, *primals), out / f"{label}_{shape.name}"))
            _record(results, f"{label}_{shape.name}_fwdbwd", row)
    (out / "timeline.json").write_text(json.dumps(dict(stamp=stamp, results=results), indent=1))


if __name__ == "__main__":
    main()
