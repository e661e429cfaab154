"""The recognised Flax mask's forward (d64_4k_dense_causal) profiled: four compiles of it
and one of the causal call, in one process (jax's caches cleared between). Each compile
is timed as `bench.check` times it, then 20 back-to-back calls run under
`jax.profiler.trace`; the script prints, per compile, the GPU's kernels (count, total
µs), the busy share of the traced span, the longest gaps between kernels (with the
kernels either side) and the host events that took longest. OUT is argv[1]."""

import collections
import gzip
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
CALLS = 20


def recognised(q, k, v, mask):
    return jaxtile.flash_attention(q, k, v, mask=mask)


def causal(q, k, v, mask):
    return jaxtile.flash_attention(q, k, v, causal=True)


def summarise(trace_dir: Path) -> str:
    (path,) = trace_dir.glob("plugins/profile/*/*.trace.json.gz")
    with gzip.open(path) as fp:
        events = json.load(fp)["traceEvents"]
    names = {
        (e["pid"], e.get("tid")): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and "name" in e.get("args", {})
    }
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    gpu = sorted(
        (e for e in spans if "GPU" in procs.get(e["pid"], "") or "device" in procs.get(e["pid"], "").lower()),
        key=lambda e: e["ts"],
    )
    lines = []
    kernels = collections.Counter()
    time = collections.Counter()
    for e in gpu:
        kernels[e["name"][:70]] += 1
        time[e["name"][:70]] += e["dur"]
    for name, us in time.most_common(12):
        lines.append(f"  gpu {kernels[name]:4d}x {us / kernels[name]:9.1f} us  {name}")
    if gpu:
        start, end = gpu[0]["ts"], max(e["ts"] + e["dur"] for e in gpu)
        busy = sum(e["dur"] for e in gpu)
        lines.append(
            f"  gpu span {end - start:.0f} us for {CALLS} calls ({(end - start) / CALLS:.1f} per call), kernels {busy:.0f} us ({busy / (end - start):.2f})"
        )
        gaps, last = [], gpu[0]
        for e in gpu[1:]:
            gap = e["ts"] - (last["ts"] + last["dur"])
            gaps.append((gap, last["name"][:40], e["name"][:40]))
            if e["ts"] + e["dur"] > last["ts"] + last["dur"]:
                last = e
        gaps.sort(reverse=True)
        lines.append(
            f"  gaps over 2 us: {sum(g for g, *_ in gaps if g > 2):.0f} us in {sum(1 for g, *_ in gaps if g > 2)}"
        )
        for gap, before, after in gaps[:8]:
            lines.append(f"  gap {gap:8.1f} us  {before} -> {after}")
    on_gpu = {id(e) for e in gpu}
    host = collections.Counter()
    count = collections.Counter()
    for e in spans:
        if id(e) in on_gpu:
            continue
        key = (procs.get(e["pid"], "?")[:20], names.get((e["pid"], e.get("tid")), "?")[:24], e["name"][:60])
        host[key] += e["dur"]
        count[key] += 1
    for key, us in host.most_common(14):
        lines.append(f"  host {count[key]:4d}x {us:9.0f} us  {' | '.join(key)}")
    return "\n".join(lines)


variants = [("recognised", recognised)] * 4 + [("causal", causal)]
for i, (label, fn) in enumerate(variants):
    jax.clear_caches()
    compiled = jax.jit(fn).lower(q, k, v, mask).compile()
    call = lambda c=compiled: c(q, k, v, mask)  # noqa: E731
    timing = check._worker.time_batches(call, jax.block_until_ready, 0.5)
    trace_dir = out / f"trace_{i}_{label}"
    with jax.profiler.trace(str(trace_dir)):
        result = None
        for _ in range(CALLS):
            result = call()
        jax.block_until_ready(result)
    print(f"compile {i} {label}: {timing.ms:.4f} ms (lo {timing.ms_lo:.4f}, hi {timing.ms_hi:.4f})", flush=True)
    print(summarise(trace_dir), flush=True)
