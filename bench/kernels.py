"""What the Pallas kernels cost on a Hopper GPU, read from the compiler without one.

``python -m bench.kernels`` lowers jaxtile's Pallas kernels for sm_90 (Pallas falls back
to that target where no GPU is present), compiles each with the installed Triton and
reports, per kernel and launch configuration, the shared memory it asks for, its
registers per thread and its spills (the stack frame ``cuobjdump`` reports). It needs
``pip install triton`` (its wheel carries ``ptxas`` and ``cuobjdump``) and no GPU, so a
kernel change can be checked for spills and shared memory before a GPU is at hand; on a
GPU the numbers are the real compiler's.

Examples::

    python -m bench.kernels                       # the tuning table's entries, bf16
    python -m bench.kernels --sweep --head-dims 128 --causal   # candidate tunings
    python -m bench.kernels --json out.json

XLA compiles Pallas kernels with its own copy of Triton, which may allocate slightly
differently from the Triton installed here: the report is a close proxy, and the GPU is
the judge (`tests/test_gpu.py` compiles the extremes for real).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import subprocess
import sys
import tempfile
import warnings

import jax
import jax.numpy as jnp

import jaxtile
from jaxtile.mask import MaskSpec
from jaxtile.triton import tuning as tn


@dataclasses.dataclass(frozen=True)
class Resources:
    """One compiled kernel: the tiles it was launched with and the shared memory jaxtile's
    model gave them, then the compiler's shared memory (bytes), registers per thread and
    stack bytes (spills), or its error."""

    name: str
    num_warps: int
    num_stages: int
    block_q: int | None = None
    block_k: int | None = None
    pack: int | None = None
    shared_model: int | None = None
    shared: int | None = None
    registers: int | None = None
    stack: int | None = None
    error: str | None = None


def _captured_kernels(fn, *args) -> list[dict]:
    """The Triton modules and launch parameters of every ``pallas_call`` in ``fn``,
    lowered for CUDA (no device needed)."""
    from jax._src.interpreters import mlir
    from jax._src.pallas import pallas_call
    from jax._src.pallas.triton import pallas_call_registration as registration

    captured: list[dict] = []
    lower_module = registration.lowering.lower_jaxpr_to_triton_module

    def grab(*a, **k):
        result = lower_module(*a, **k)
        captured[-1]["ttir"] = result.module.operation.get_asm(enable_debug_info=False)
        return result

    def lowering(ctx, *nodes, **params):
        triton_params = params["compiler_params"]
        captured.append(
            dict(
                name=params["name"],
                warps=triton_params.num_warps,
                stages=triton_params.num_stages,
                metadata=dict(params["metadata"] or {}),
            )
        )
        registration.lowering.lower_jaxpr_to_triton_module = grab
        try:
            return registration.pallas_call_lowering(ctx, *nodes, **params)
        finally:
            registration.lowering.lower_jaxpr_to_triton_module = lower_module

    mlir.register_lowering(pallas_call.pallas_call_p, lowering, platform="cuda")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        mlir.register_lowering(pallas_call.pallas_call_p, registration.pallas_call_lowering, platform="cuda")
    return captured


def _compile(kernel: dict) -> Resources:
    import triton
    from triton.backends.compiler import GPUTarget

    meta = {key: int(value) for key, value in kernel["metadata"].items()}
    base = Resources(
        kernel["name"],
        kernel["warps"],
        kernel["stages"],
        meta.get("block_q"),
        meta.get("block_k"),
        meta.get("pack"),
        meta.get("shared_memory_model"),
    )
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ttir")
        with open(source, "w") as f:
            f.write(kernel["ttir"])
        try:
            compiled = triton.compile(
                source,
                target=GPUTarget("cuda", 90, 32),
                options=dict(num_warps=kernel["warps"], num_stages=kernel["stages"]),
            )
        except Exception as exc:  # the compiler's refusal is the result
            return dataclasses.replace(base, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "--dump-resource-usage", cubin], capture_output=True, text=True, check=True)
    line = next(line for line in usage.stdout.splitlines() if "REG:" in line)
    fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
    return dataclasses.replace(
        base, shared=compiled.metadata.shared, registers=int(fields["REG"]), stack=int(fields["STACK"])
    )


@dataclasses.dataclass(frozen=True)
class Call:
    """One ``flash_attention`` call, forward and backward: ``[1, seq, heads, head_dim]``."""

    head_dim: int
    causal: bool
    seq: int = 1024
    num_heads: int = 4
    num_kv_heads: int = 4
    dtype: str = "bfloat16"
    segments: bool = False
    window: tuple[int, int] | None = None

    def describe(self) -> str:
        mask = "causal" if self.causal else "full"
        if self.window:
            mask += f" window {self.window}"
        if self.segments:
            mask += " segments"
        return f"d={self.head_dim} {self.num_heads}:{self.num_kv_heads} {mask} {self.dtype}"


def resources(
    call: Call, tuning: tn.Tuning | None = None, implementation: str = "pallas_v2", *, backward: bool = True
) -> list[Resources]:
    """The compiled resources of the forward (and ``backward``) kernels of ``call``."""
    dtype = jnp.dtype(call.dtype)
    q = jax.ShapeDtypeStruct((1, call.seq, call.num_heads, call.head_dim), dtype)
    kv = jax.ShapeDtypeStruct((1, call.seq, call.num_kv_heads, call.head_dim), dtype)
    segment_ids = jax.ShapeDtypeStruct((1, call.seq), jnp.int32) if call.segments else None

    def step(q, k, v, segment_ids):
        def attend(q, k, v):
            return jaxtile.flash_attention(
                q,
                k,
                v,
                causal=call.causal,
                window=call.window,
                segment_ids=segment_ids,
                implementation=implementation,
                tuning=tuning,
            )

        if not backward:
            return attend(q, k, v)
        out, vjp = jax.vjp(attend, q, k, v)
        return vjp(out)

    return [_compile(kernel) for kernel in _captured_kernels(step, q, kv, kv, segment_ids)]


def _sweep(base: tn.Tuning) -> list[tuple[tn.Tuning, bool]]:
    """``(tuning, backward)`` around the table's entry: the forward kernel's tiles, warps
    and stages, then the backward kernels' (dQ with dK/dV's tiles transposed)."""
    tunings = [(base, True)]
    for blocks, warps, stages in itertools.product(((128, 128), (128, 64), (64, 64)), (4, 8), (2, 3)):
        tunings.append((dataclasses.replace(base, forward=tn.KernelTuning(*blocks, warps, stages)), False))
    for (bq, bk), warps, stages in itertools.product(((64, 64), (32, 128), (64, 128), (128, 64)), (4, 8), (2, 3)):
        dkdv, dq = tn.KernelTuning(bq, bk, warps, stages), tn.KernelTuning(bk, bq, warps, stages)
        tunings.append((dataclasses.replace(base, dkdv=dkdv, dq=dq), True))
    return tunings


_KERNEL_TUNING = {"jaxtile_fa2_forward": "forward", "jaxtile_fa2_dkdv": "dkdv", "jaxtile_fa2_dq": "dq"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--causal", action="store_true", help="only causal (default: both)")
    parser.add_argument("--sweep", action="store_true", help="candidate tunings around the table's entries")
    parser.add_argument("--json", metavar="PATH", help="also write every row as JSON")
    args = parser.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        parser.error("needs Triton: pip install triton")
    rows = []
    for head_dim, causal in itertools.product(args.head_dims, (True,) if args.causal else (False, True)):
        call = Call(head_dim, causal, dtype=args.dtype)
        kind = tn.mask_kind(MaskSpec.create(call.seq, call.seq, causal=causal))
        base = tn.default_tuning(head_dim, jnp.dtype(args.dtype), kind)
        tunings = _sweep(base) if args.sweep else [(None, True)]
        for tuning, backward in tunings:
            table = tuning or base
            for r in resources(call, tuning, backward=backward):
                kernel = getattr(table, _KERNEL_TUNING[r.name])
                rows.append(
                    dict(call=dataclasses.asdict(call), tuning=dataclasses.asdict(kernel), **dataclasses.asdict(r))
                )
                spill = "" if not r.stack else f"  SPILLS {r.stack} B"
                outcome = r.error or f"{r.shared:>7} B shared (model {r.shared_model:>7})  {r.registers:>3} regs{spill}"
                tiles = f"{r.block_q}x{r.block_k}" + (f"/{r.pack}" if r.pack and r.pack > 1 else "")
                print(
                    f"{call.describe():<24} {r.name:<20} {tiles:>7} w{r.num_warps} s{r.num_stages}  {outcome}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(triton=__import__("triton").__version__, jax=jax.__version__, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
