"""Launch parameters of the Pallas kernels: tiles, warps and pipeline stages.

Three ways to choose them, through ``flash_attention(..., tuning=...)``:

* ``None``: `default_tuning`, a small table measured on Hopper (H100/H200) per head dim
  and dtype width;
* a `Tuning`: exactly these parameters;
* ``"autotune"``: on first use of a shape, time the candidates of `candidates` on the GPU
  and keep the fastest for the rest of the process.

``block_q`` / ``block_k`` passed to ``flash_attention`` override the tiles of every kernel.
Implementations other than the Pallas ones ignore ``tuning``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable

import jax.numpy as jnp

from jaxtile.mask import MaskSpec


@dataclasses.dataclass(frozen=True)
class KernelTuning:
    """Launch parameters of one kernel: tiles, warps per program, software-pipeline depth."""

    block_q: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            block = getattr(self, name)
            if not isinstance(block, int) or block < 16 or block & (block - 1):
                raise ValueError(f"{name}={block!r} must be a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps!r} must be 1, 2, 4, 8 or 16")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages!r} must be a positive int")


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Launch parameters of the forward, dK/dV and dQ kernels of one call."""

    forward: KernelTuning
    dkdv: KernelTuning
    dq: KernelTuning

    def with_blocks(self, block_q: int | None, block_k: int | None) -> Tuning:
        """The same tuning with the tiles the user asked for, in every kernel."""

        def override(t: KernelTuning) -> KernelTuning:
            return dataclasses.replace(t, block_q=block_q or t.block_q, block_k=block_k or t.block_k)

        return dataclasses.replace(self, forward=override(self.forward), dkdv=override(self.dkdv), dq=override(self.dq))


def _t(fwd: tuple[int, ...], dkdv: tuple[int, ...], dq: tuple[int, ...]) -> Tuning:
    return Tuning(KernelTuning(*fwd), KernelTuning(*dkdv), KernelTuning(*dq))


# The three shapes of mask the table tells apart (`mask_kind`).
MASK_KINDS = ("full", "causal", "window")


def mask_kind(spec: MaskSpec) -> str:
    """``"window"`` when a left side bounds the keys, ``"causal"`` when only the right
    does, else ``"full"``: windows mask a larger share of their tiles, which favours
    smaller query tiles."""
    if spec.left is not None:
        return "window"
    return "causal" if spec.right is not None else "full"


_F32 = _t((64, 32, 4, 2), (32, 32, 4, 2), (32, 32, 4, 2))
_F32_WIDE = _t((32, 32, 4, 1), (16, 32, 4, 1), (32, 16, 4, 1))
_WIDE = _t((64, 32, 4, 3), (64, 64, 8, 2), (64, 64, 8, 2))

# (largest padded head dim, 16-bit inputs, mask kind) -> tuning. The 16-bit rows are the
# fastest of `python -m bench.tune` on an H200 at 4096 tokens (head dim 256: 8192; windows:
# (1023, 0) at 16K), among candidates that `python -m bench.kernels` compiles without
# spilling or spilling least (bench/results/h200/tune_*.json). The float32 rows are what
# fits, not tuned. `pk.Tiles.fit` shrinks any entry to the shared memory of the GPU at hand.
_HOPPER: dict[tuple[int, bool, str], Tuning] = {
    (64, True, "full"): _t((64, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 3)),
    (64, True, "causal"): _t((128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 3)),
    (64, True, "window"): _t((64, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 3)),
    (128, True, "full"): _t((128, 128, 8, 3), (64, 128, 8, 3), (128, 64, 8, 3)),
    (128, True, "causal"): _t((128, 64, 8, 3), (64, 64, 4, 2), (64, 64, 4, 2)),
    (128, True, "window"): _t((64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 2)),
    **{(256, True, kind): _WIDE for kind in MASK_KINDS},
    **{(64, False, kind): _t((64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2)) for kind in MASK_KINDS},
    **{(128, False, kind): _F32 for kind in MASK_KINDS},
    **{(256, False, kind): _F32_WIDE for kind in MASK_KINDS},
}


def _bucket(head_dim: int, dtype) -> tuple[int, bool]:
    half = jnp.dtype(dtype).itemsize == 2
    for limit in (64, 128, 256):
        if head_dim <= limit:
            return limit, half
    raise ValueError(f"{head_dim=} is larger than the Pallas kernels support (256)")


def default_tuning(head_dim: int, dtype, kind: str) -> Tuning:
    """The table's entry for the padded ``head_dim`` (the larger of q/k's and v's), the
    dtype's width and the mask's kind (`mask_kind`)."""
    return _HOPPER[(*_bucket(head_dim, dtype), kind)]


def candidates(head_dim: int, dtype, kind: str) -> tuple[Tuning, ...]:
    """What ``"autotune"`` tries: the table's entry and its neighbours in tiles and depth."""
    base = default_tuning(head_dim, dtype, kind)
    out = [base]
    for fwd_blocks in ((128, 64), (64, 64), (128, 128)):
        for stages in (2, 3, 4):
            fwd = dataclasses.replace(base.forward, block_q=fwd_blocks[0], block_k=fwd_blocks[1], num_stages=stages)
            out.append(dataclasses.replace(base, forward=fwd))
    for bwd_blocks, warps in (((32, 64), 4), ((64, 64), 4), ((64, 128), 8), ((128, 64), 8)):
        dkdv = KernelTuning(bwd_blocks[0], bwd_blocks[1], warps, base.dkdv.num_stages)
        dq = KernelTuning(bwd_blocks[1], bwd_blocks[0], warps, base.dq.num_stages)
        out.append(dataclasses.replace(base, dkdv=dkdv, dq=dq))
    return tuple(dict.fromkeys(out))


_AUTOTUNED: dict[Hashable, Tuning] = {}


def autotuned(key: Hashable, options: tuple[Tuning, ...], measure: Callable[[Tuning], tuple[float, float]]) -> Tuning:
    """The fastest of ``options`` for ``key``, timed once per process.

    ``measure(tuning)`` returns ``(forward_seconds, backward_seconds)``. A candidate whose
    measurement raises (one that does not fit: shared memory, registers) loses; if every
    candidate raises, so does this, from the last error. The forward kernel and the
    backward pair are chosen independently.
    """
    if key not in _AUTOTUNED:
        times, error = {}, None
        for option in options:
            try:
                times[option] = measure(option)
            except Exception as e:  # any failure to compile or run loses
                times[option], error = (float("inf"), float("inf")), e
        if all(forward == float("inf") for forward, _ in times.values()):
            raise RuntimeError(f"autotuning {key}: none of {len(options)} candidates ran") from error
        fwd = min(options, key=lambda t: times[t][0])
        bwd = min(options, key=lambda t: times[t][1])
        _AUTOTUNED[key] = Tuning(fwd.forward, bwd.dkdv, bwd.dq)
    return _AUTOTUNED[key]


def median_seconds(run: Callable[[], object], repeats: int = 5) -> float:
    """Median wall time of ``run()`` (which must block until its result is ready)."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
