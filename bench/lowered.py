"""Hashes of the GPU kernels jaxtile lowers, taken on any machine (no GPU needed).

``python -m bench.lowered OUT.json`` lowers `jaxtile.flash_attention` (forward and
gradient) and `jaxtile.paged_attention` for CUDA as on a Hopper GPU, for every registered
implementation over a grid of masks, dtypes and shapes, and records per call a hash of
each Triton and Mosaic GPU module it lowers, printed without debug locations.
``python -m bench.lowered --compare A.json B.json`` lists the calls whose kernels differ:
a change meant to leave the GPU code alone (a refactor of host-side code, a docstring)
must show none, and then needs no GPU to check. The XLA program around the kernels is not
compared (its text varies between runs), so the ``jax.lax`` implementations record no
kernels (the CPU tests run them); calls an implementation refuses are recorded as such,
and must be refused alike.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
from jax._src.pallas.mosaic_gpu import pallas_call_registration as mosaic_registration
from jax._src.pallas.triton import pallas_call_registration as triton_registration

import jaxtile
import jaxtile.api
from jaxtile import registry
from jaxtile._core import HOPPER_SMS
from jaxtile.mosaic import _ring, v3
from jaxtile.triton import _kernel as pk

S = jax.ShapeDtypeStruct
MASKS = {
    "full": {},
    "causal": dict(causal=True),
    "window": dict(causal=True, window=(30, 0)),
    "window_both": dict(window=(40, 20)),
    "soft_cap": dict(causal=True, logits_soft_cap=30.0),
    "lengths": dict(causal=True, lengths=True),
    "segments_bias": dict(segments=True, bias=True),
    "dense": dict(dense=True),
}
# (q_len, kv_len, head_dim): decode, uneven prefill, a head dim that pads.
SHAPES = ((3, 70, 64), (200, 300, 128), (130, 130, 96))
DTYPES = ("bfloat16", "float16")


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@contextlib.contextmanager
def _as_on_hopper(kernels: list[str]):
    """Calls lowered inside take the GPU's path on an H100/H200 (132 SMs), and append the
    text of every kernel module they lower to ``kernels``."""
    triton_lower = triton_registration.lowering.lower_jaxpr_to_triton_module
    mosaic_lower = mosaic_registration.lowering.lower_pipelined_jaxpr_to_module

    def triton(*args, **kwargs):
        result = triton_lower(*args, **kwargs)
        kernels.append("triton " + result.module.operation.get_asm(enable_debug_info=False))
        return result

    def mosaic(*args, **kwargs):
        r = mosaic_lower(*args, **kwargs)
        launch = f"{r.grid} {r.block} {r.new_out_shapes} {r.gmem_scratch_shapes}"
        kernels.append(f"mosaic {launch} " + r.module.operation.get_asm(enable_debug_info=False))
        return r

    hopper = pk.shared_memory_limit("cpu")
    with contextlib.ExitStack() as stack:
        for target, name, value in (
            (jaxtile.api, "_platform", lambda x: "gpu"),
            (v3, "_hopper", lambda: True),
            (_ring, "multiprocessors", lambda: HOPPER_SMS),
            (pk, "sm_count", lambda platform: HOPPER_SMS),
            (pk, "shared_memory_limit", lambda platform: hopper),
            (triton_registration.lowering, "lower_jaxpr_to_triton_module", triton),
            (mosaic_registration.lowering, "lower_pipelined_jaxpr_to_module", mosaic),
        ):
            stack.enter_context(mock.patch.object(target, name, value))
        yield


def _attention_call(implementation: str, dtype: str, q_len: int, kv_len: int, head_dim: int, mask: dict):
    """``(function, abstract arguments)`` of a flash_attention call, reduced to a scalar."""
    batch, heads, kv_heads = 2, 4, 2
    q, k = S((batch, q_len, heads, head_dim), dtype), S((batch, kv_len, kv_heads, head_dim), dtype)
    static = {name: value for name, value in mask.items() if name in ("causal", "window", "logits_soft_cap")}
    arrays = {}
    if mask.get("lengths"):
        arrays.update(q_lengths=S((batch,), jnp.int32), kv_lengths=S((batch,), jnp.int32))
    if mask.get("segments"):
        arrays.update(segment_ids=(S((batch, q_len), jnp.int32), S((batch, kv_len), jnp.int32)))
    if mask.get("bias"):
        arrays.update(bias=S((batch, heads, q_len, kv_len), jnp.float32))
    if mask.get("dense"):
        arrays.update(mask=S((batch, heads, q_len, kv_len), jnp.bool_))

    def attend(q, k, v, arrays):
        out = jaxtile.flash_attention(q, k, v, implementation=implementation, **static, **arrays)
        return out.astype(jnp.float32).sum()

    return attend, (q, k, k, arrays)


def _paged_call(implementation: str, q_len: int):
    q, pages = S((2, q_len, 8, 128), jnp.bfloat16), S((2, 40, 16, 128), jnp.bfloat16)

    def attend(*args):
        return jaxtile.paged_attention(*args, implementation=implementation)

    return attend, (q, pages, pages, S((2, 20), jnp.int32), S((2,), jnp.int32))


def calls(implementations=None):
    """``{name: (function, abstract arguments)}`` of every call the grid lowers."""
    names = implementations or [i.name for i in registry.implementations()]
    grid = {}
    for impl in names:
        for dtype in DTYPES:
            for mask_name, mask in MASKS.items():
                for shape in SHAPES:
                    fn, args = _attention_call(impl, dtype, *shape, mask)
                    key = f"{impl}/{dtype}/{mask_name}/{'x'.join(map(str, shape))}"
                    grid[f"{key}/fwd"] = fn, args
                    grid[f"{key}/grad"] = jax.grad(fn, argnums=(0, 1, 2)), args
        for q_len in (1, 16):
            grid[f"{impl}/paged/{q_len}"] = _paged_call(impl, q_len)
    return grid


def hashes(grid: dict) -> dict[str, list[str] | str]:
    """Per call, the hashes of the kernel modules it lowers (in order), or why it was refused."""
    kernels: list[str] = []
    result = {}
    jax.clear_caches()  # each call lowers its kernels afresh, whatever was lowered before
    with _as_on_hopper(kernels):
        for key, (fn, args) in grid.items():
            kernels.clear()
            try:
                jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
            except registry.Unsupported as e:
                result[key] = f"refused: {type(e).__name__}: {e}"
                continue
            result[key] = [_hash(text) for text in kernels]
    return result


def compare(before: dict, after: dict) -> list[str]:
    """The calls whose kernels (or refusals) differ, and those only one side has."""
    return sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", help="where to write the hashes (JSON)")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two files this wrote: the calls that differ")
    parser.add_argument("--impl", nargs="*", help="implementations (default: every registered one)")
    args = parser.parse_args(argv)
    if args.compare:
        a, b = (json.loads(Path(path).read_text())["calls"] for path in args.compare)
        differ = compare(a, b)
        for key in differ:
            print(f"{key}: {a.get(key)} -> {b.get(key)}")
        kernels = sum(len(v) for v in a.values() if isinstance(v, list))
        print(f"{len(differ)} of {len(a)} calls differ ({kernels} kernels in A)")
        return 1 if differ else 0
    if not args.out:
        parser.error("give OUT.json, or --compare A.json B.json")
    from bench.probe import git_state

    result = dict(git=git_state(), jax=jax.__version__, calls=hashes(calls(args.impl)))
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True))
    kernels = sum(len(v) for v in result["calls"].values() if isinstance(v, list))
    print(f"{len(result['calls'])} calls, {kernels} kernels lowered; written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
