"""What the benchmark measures: attention problems, suites of them, presets and FLOPs.

A `Problem` is one shape (q, k and v all ``[batch, seq_len, heads, head_dim]``, with
``num_kv_heads`` key/value heads); a `Suite` is a sweep of problems run in the given
modes. The presets are the standard grid (``batch × seq = 16384``, ``heads × head_dim =
2048``, as in FlashAttention's benchmarks) and FlashTile's memory setting.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxtile.mask import MaskSpec

MODES = ("fwd", "fwdbwd")
DTYPES = ("bfloat16", "float16", "float32")
# The backward pass does 2.5× the forward FLOPs (2 matmuls forward, 5 backward).
BACKWARD_FLOPS = 2.5

Window = tuple[int | None, int | None]


@dataclasses.dataclass(frozen=True)
class Problem:
    """One attention call: q ``[batch, seq_len, num_heads, head_dim]``, k and v
    ``[batch, seq_len, num_kv_heads, head_dim]``; ``window`` is jaxtile's ``(left, right)``."""

    batch: int
    seq_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool
    window: Window | None
    dtype: str

    @classmethod
    def from_dict(cls, d: dict) -> Problem:
        fields = {f.name: d[f.name] for f in dataclasses.fields(cls)}
        if fields["window"] is not None:
            fields["window"] = tuple(fields["window"])
        return cls(**fields)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def mask(self) -> MaskSpec:
        return MaskSpec.create(self.seq_len, self.seq_len, causal=self.causal, window=self.window)

    def visible_pairs(self) -> float:
        """The (query, key) pairs whose score is computed.

        Full attention counts ``T·S`` and causal attention ``T·S / 2`` (the convention of
        FlashAttention's benchmarks, which the peers' published numbers use); a window
        counts its visible pairs exactly, from the mask description.
        """
        spec = self.mask()
        t, s = spec.q_len, spec.kv_len
        if spec.sees_every_key:
            return float(t * s)
        if spec.left is None and spec.right == 0:
            return t * s / 2
        pos = np.arange(t, dtype=np.int64) + spec.offset
        lo = np.zeros_like(pos) if spec.left is None else np.maximum(pos - spec.left, 0)
        hi = np.full_like(pos, s) if spec.right is None else np.minimum(pos + spec.right + 1, s)
        return float(np.maximum(hi - lo, 0).sum())

    def flops(self, mode: str) -> float:
        """``4 · batch · heads · head_dim · pairs`` forward (query heads, also for GQA);
        forward+backward is ``1 + 2.5`` times that."""
        forward = 4.0 * self.batch * self.num_heads * self.head_dim * self.visible_pairs()
        return forward if mode == "fwd" else forward * (1 + BACKWARD_FLOPS)

    def describe(self) -> str:
        heads = f"heads {self.num_heads}" + (f"/{self.num_kv_heads} kv" if self.num_kv_heads != self.num_heads else "")
        mask = "causal" if self.causal else "non-causal"
        if self.window is not None:
            mask += f" window {self.window}"
        return f"batch {self.batch} · seq {self.seq_len} · {heads} · head_dim {self.head_dim} · {mask} · {self.dtype}"


def window_for(window: int | Window | None, causal: bool) -> Window | None:
    """jaxtile's ``(left, right)`` for a window given as FlashTile's ``window_size=W``
    (causal: ``(W - 1, 0)``; otherwise ``(W // 2, W // 2)``) or as ``(left, right)``."""
    if window is None or isinstance(window, tuple):
        return window
    return (window - 1, 0) if causal else (window // 2, window // 2)


@dataclasses.dataclass(frozen=True)
class Suite:
    """A sweep over sequence lengths, head dims and masks, run in ``modes``.

    The batch is ``batch_size``, or ``tokens // seq_len`` (at least 1) to hold
    ``batch × seq`` constant; the heads are ``num_heads``, or ``model_dim // head_dim``.
    ``stop_at_oom``: once an implementation runs out of memory at some length, its
    longer lengths are skipped (a sweep "until OOM").
    """

    name: str
    seq_lens: tuple[int, ...]
    head_dims: tuple[int, ...]
    causal: tuple[bool, ...] = (False,)
    modes: tuple[str, ...] = MODES
    dtype: str = "bfloat16"
    batch_size: int | None = None
    tokens: int | None = None
    num_heads: int | None = None
    model_dim: int | None = None
    num_kv_heads: int | None = None
    window: int | Window | None = None
    stop_at_oom: bool = False

    def __post_init__(self):
        if (self.batch_size is None) == (self.tokens is None):
            raise ValueError(f"give exactly one of {self.batch_size=} and {self.tokens=}")
        if (self.num_heads is None) == (self.model_dim is None):
            raise ValueError(f"give exactly one of {self.num_heads=} and {self.model_dim=}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {DTYPES}")
        if not set(self.modes) <= set(MODES) or not self.modes:
            raise ValueError(f"modes={self.modes} must be a non-empty subset of {MODES}")
        if not self.seq_lens:
            raise ValueError(f"suite {self.name!r} has no sequence lengths")

    def replace(self, **changes) -> Suite:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def problems(self) -> list[Problem]:
        """Every problem of the sweep: head dims, then masks, then sequence lengths."""
        problems = []
        for head_dim in self.head_dims:
            heads = self.num_heads if self.num_heads is not None else max(1, self.model_dim // head_dim)
            kv_heads = heads if self.num_kv_heads is None else self.num_kv_heads
            if heads % kv_heads:
                raise ValueError(f"num_heads={heads} is not a multiple of num_kv_heads={kv_heads}")
            for causal in self.causal:
                for seq_len in self.seq_lens:
                    batch = self.batch_size if self.batch_size is not None else max(1, self.tokens // seq_len)
                    window = window_for(self.window, causal)
                    problems.append(Problem(batch, seq_len, heads, kv_heads, head_dim, causal, window, self.dtype))
        return problems


# batch × seq = 16384 and heads × head_dim = 2048: the FLOPs per layer stay fixed while
# the sequence grows, as in FlashAttention's benchmarks and /work/shared/ANCHORS.md.
STANDARD = Suite(
    "standard",
    seq_lens=(1024, 4096, 16384),
    head_dims=(64, 128),
    causal=(False, True),
    tokens=16384,
    model_dim=2048,
)
# FlashTile's memory setting: batch 4, 12 heads of 64, the sequence doubling until OOM.
MEMORY = Suite(
    "memory",
    seq_lens=(512, 1024, 2048, 4096, 8192, 16384),
    head_dims=(64,),
    modes=("fwdbwd",),
    batch_size=4,
    num_heads=12,
    stop_at_oom=True,
)
PRESETS = {"standard": (STANDARD,), "memory": (MEMORY,), "full": (STANDARD, MEMORY)}
# Both presets in miniature, in float32 so that a CPU runs them in about a minute.
QUICK = (
    STANDARD.replace(
        seq_lens=(64, 128, 256),
        head_dims=(32,),
        causal=(True,),
        dtype="float32",
        tokens=None,
        batch_size=2,
        model_dim=None,
        num_heads=4,
    ),
    MEMORY.replace(seq_lens=(128, 256, 512), head_dims=(32,), dtype="float32", batch_size=1, num_heads=2),
)
# Without a preset: one suite, shaped by the command line.
CUSTOM = Suite("custom", seq_lens=(512, 1024, 2048, 4096), head_dims=(64,), batch_size=4, num_heads=8)
