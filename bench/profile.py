"""What a jitted call does on the GPU, from `jax.profiler.trace`: `traced` runs it
back to back under the profiler, `summarise` reads the trace back as lines of text (the
GPU's kernels by total time, the busy share of the traced span, the longest gaps between
kernels with the kernels either side, and the host events that took longest). Used by
the record scripts under ``bench/results/*/`` that take a call apart."""

from __future__ import annotations

import collections
import gzip
import json
from collections.abc import Callable
from pathlib import Path

import jax


def traced(call: Callable, trace_dir: Path, calls: int) -> None:
    """``calls`` back-to-back runs of ``call()`` under the profiler, into ``trace_dir``."""
    with jax.profiler.trace(str(trace_dir)):
        result = None
        for _ in range(calls):
            result = call()
        jax.block_until_ready(result)


def summarise(trace_dir: Path, calls: int, top: int = 12) -> str:
    """The trace `traced` wrote into ``trace_dir`` as text, per call where it divides."""
    (path,) = trace_dir.glob("plugins/profile/*/*.trace.json.gz")
    with gzip.open(path) as fp:
        events = json.load(fp)["traceEvents"]
    meta = [e for e in events if e.get("ph") == "M" and "name" in e.get("args", {})]
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in meta}
    procs = {e["pid"]: e["args"]["name"] for e in meta if e.get("name") == "process_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    on_gpu = [e for e in spans if "GPU" in procs.get(e["pid"], "") or "device" in procs.get(e["pid"], "").lower()]
    gpu = sorted(on_gpu, key=lambda e: e["ts"])
    lines = []
    count, time = collections.Counter(), collections.Counter()
    for e in gpu:
        count[e["name"][:70]] += 1
        time[e["name"][:70]] += e["dur"]
    for name, us in time.most_common(top):
        lines.append(f"  gpu {count[name]:4d}x {us / count[name]:9.1f} us  {name}")
    if gpu:
        start, end = gpu[0]["ts"], max(e["ts"] + e["dur"] for e in gpu)
        busy = sum(e["dur"] for e in gpu)
        lines.append(
            f"  gpu span {end - start:.0f} us for {calls} calls ({(end - start) / calls:.1f} per call), "
            f"kernels {busy:.0f} us ({busy / (end - start):.2f})"
        )
        gaps, last = [], gpu[0]
        for e in gpu[1:]:
            gaps.append((e["ts"] - (last["ts"] + last["dur"]), last["name"][:40], e["name"][:40]))
            if e["ts"] + e["dur"] > last["ts"] + last["dur"]:
                last = e
        gaps.sort(reverse=True)
        over = [g for g, *_ in gaps if g > 2]
        lines.append(f"  gaps over 2 us: {sum(over):.0f} us in {len(over)}")
        lines += [f"  gap {gap:8.1f} us  {before} -> {after}" for gap, before, after in gaps[:8]]
    ids = {id(e) for e in on_gpu}
    host, host_count = collections.Counter(), collections.Counter()
    for e in spans:
        if id(e) not in ids:
            key = (procs.get(e["pid"], "?")[:20], threads.get((e["pid"], e.get("tid")), "?")[:24], e["name"][:60])
            host[key] += e["dur"]
            host_count[key] += 1
    lines += [f"  host {host_count[k]:4d}x {us:9.0f} us  {' | '.join(k)}" for k, us in host.most_common(top + 2)]
    return "\n".join(lines)
