"""One attention problem, declared as data, and its inputs drawn from a seed."""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


@dataclasses.dataclass(frozen=True)
class Case:
    """An attention problem: shapes, dtype, masking and tiles.

    ``segments`` packs that many documents of random lengths into each sequence;
    ``mask`` is ``"random"`` (Bernoulli(0.7) per head and position), ``"padding"`` (the
    last keys of each batch element are padding) or ``"empty_rows"`` (some queries see
    no key at all). ``lengths`` gives each sequence its own query and key lengths
    (``"kv"``: key lengths only, as a decode step over caches filled to different
    lengths; ``"ragged"``: both); the first sequence is full and the last has an empty
    cache. ``input_scale`` multiplies q and k, to make logits large.
    ``page_size`` makes the case paged: k and v are cut into pages of that size (the
    last page of a sequence partly filled when ``kv_len`` is not a multiple), scattered
    in random order over a pool with spare pages of random values, and the case runs
    through ``jaxtile.paged_attention`` with the page table (one batch dim; no segments,
    mask or blocks), every sequence's ``kv_lengths`` the full ``kv_len`` unless
    ``lengths`` says otherwise.
    ``bias`` adds an additive bias to the scaled scores, in the case's dtype, and its
    gradient to the comparison: ``"full"`` ``[batch..., H, T, S]`` (``"full32"`` the
    same in float32, whatever the case's dtype), or ``"shared"`` ``[T, S]`` by all
    sequences and heads (a relative-position bias, as ALiBi's).
    ``sinks`` adds learnable attention sinks (one random logit per query head), and
    their gradient to the comparison.
    ``lse_grad`` also back-propagates a random cotangent through the lse.
    ``grads=False`` only checks that the gradients are finite: for a saturated softmax
    in 16-bit (or one-hot in every row, whatever the dtype) the exact gradient is ~0 and
    FlashAttention's ``dS = P∘(dP − D)`` (with ``D`` from the rounded output) leaves a
    residue of ``|dP|·u`` that no relative comparison can bound; flash-attn's
    formulation, PyTorch's SDPA and ``jax.nn.dot_product_attention`` all share it.
    """

    name: str
    batch: tuple[int, ...] = (2,)
    q_len: int = 64
    kv_len: int | None = None
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int = 32
    head_dim_v: int | None = None
    dtype: str = "float32"
    causal: bool = False
    window: int | tuple[int | None, int | None] | None = None
    segments: int = 0
    mask: str | None = None
    lengths: str | None = None
    page_size: int | None = None
    logits_soft_cap: float | None = None
    bias: str | None = None
    sinks: bool = False
    scale: float | None = None
    input_scale: float = 1.0
    lse_grad: bool = False
    grads: bool = True
    block_q: int | None = None
    block_k: int | None = None
    seed: int = 0

    @property
    def kv(self) -> int:
        return self.q_len if self.kv_len is None else self.kv_len

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def dim_v(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    def replace(self, **changes) -> Case:
        return dataclasses.replace(self, **changes)

    def decode_sized(self, max_q_len: int | None, kv_len: int, **changes) -> Case:
        """This case, or for an implementation that takes at most ``max_q_len`` queries
        (a decode kernel's record) and fewer than it has, that many at the end of a cache
        of ``kv_len`` keys (with ``changes``)."""
        if max_q_len is None or self.q_len <= max_q_len:
            return self
        return self.replace(**{"name": f"{self.name}_decode", "q_len": max_q_len, "kv_len": kv_len} | changes)

    def options(self) -> dict:
        """The keyword options of ``flash_attention`` this case uses (not the arrays)."""
        return dict(
            causal=self.causal,
            window=self.window,
            logits_soft_cap=self.logits_soft_cap,
            scale=self.scale,
        )


def _segment_ids(rng: np.random.Generator, batch: tuple[int, ...], length: int, count: int) -> np.ndarray:
    """Sorted ids ``0..count-1`` with random document boundaries, ``[batch..., length]``."""
    ids = np.zeros((math.prod(batch), length), np.int32)
    for row in ids:
        cuts = np.sort(rng.choice(np.arange(1, length), size=min(count - 1, length - 1), replace=False))
        for cut in cuts:
            row[cut:] += 1
    return ids.reshape(*batch, length)


def _pages(rng: np.random.Generator, case: Case, k: np.ndarray, v: np.ndarray) -> dict[str, np.ndarray]:
    """The page pools ``[num_kv_heads, num_pages, page_size, dim]`` holding k and v, and
    the page table ``[batch, pages_per_sequence]`` int32 (distinct pages in random order,
    as many spare pages as one sequence has)."""
    if len(case.batch) != 1 or case.segments or case.mask is not None or case.block_q or case.block_k:
        raise ValueError(f"{case.name}: a paged case has one batch dim and no segments, mask or blocks")
    (batch,), size = case.batch, case.page_size
    per_sequence = math.ceil(case.kv / size)
    num_pages = (batch + 1) * per_sequence
    table = rng.permutation(num_pages)[: batch * per_sequence].reshape(batch, per_sequence).astype(np.int32)
    position = np.arange(case.kv)
    page, offset = table[:, position // size], position % size  # [batch, kv_len], [kv_len]
    arrays = {"page_table": table}
    for name, x in (("k_pages", k), ("v_pages", v)):
        scale = case.input_scale if name == "k_pages" else 1.0
        pool = (rng.standard_normal((case.kv_heads, num_pages, size, x.shape[-1])) * scale).astype(x.dtype)
        pool[:, page, offset] = x.transpose(2, 0, 1, 3)
        arrays[name] = pool
    return arrays


def make_inputs(case: Case) -> dict[str, np.ndarray | None]:
    """Draws the case's arrays once, in NumPy, from its seed.

    q, k, v and the output cotangent ``dout`` are standard normal, rounded to the case's
    dtype (so both frameworks see identical values); ``dlse`` is float32 or None.
    Segment ids are int32, the mask bool (True = attend) ``[batch..., H, T, S]``, the
    lengths int32 ``[batch...]``; a paged case adds ``page_table``, ``k_pages`` and
    ``v_pages`` (`_pages`), drawn last so that its other arrays are those of the same
    case unpaged.
    """
    rng = np.random.default_rng(case.seed)
    dtype = DTYPES[case.dtype]
    b, t, s = case.batch, case.q_len, case.kv

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(dtype)

    arrays: dict[str, np.ndarray | None] = {
        "q": normal(*b, t, case.num_heads, case.head_dim, scale=case.input_scale),
        "k": normal(*b, s, case.kv_heads, case.head_dim, scale=case.input_scale),
        "v": normal(*b, s, case.kv_heads, case.dim_v),
        "dout": normal(*b, t, case.num_heads, case.dim_v),
        "dlse": rng.standard_normal((*b, case.num_heads, t)).astype(np.float32) if case.lse_grad else None,
        "q_segment_ids": None,
        "kv_segment_ids": None,
        "mask": None,
        "q_lengths": None,
        "kv_lengths": None,
        "page_table": None,
        "k_pages": None,
        "v_pages": None,
    }
    if case.segments:
        if t == s:
            arrays["q_segment_ids"] = arrays["kv_segment_ids"] = _segment_ids(rng, b, t, case.segments)
        else:
            arrays["q_segment_ids"] = _segment_ids(rng, b, t, case.segments)
            arrays["kv_segment_ids"] = _segment_ids(rng, b, s, case.segments)
    full = (*b, case.num_heads, t, s)
    if case.mask == "random":
        arrays["mask"] = rng.random(full) < 0.7
    elif case.mask == "padding":
        valid = rng.integers(1, s + 1, size=b)
        arrays["mask"] = (np.arange(s) < valid[..., None])[..., None, None, :]
    elif case.mask == "empty_rows":
        mask = rng.random(full) < 0.7
        mask[..., ::3, :] = False
        arrays["mask"] = mask
    elif case.mask is not None:
        raise ValueError(f"unknown mask kind {case.mask!r}")
    if case.lengths is not None:
        if case.lengths not in ("kv", "ragged"):
            raise ValueError(f"unknown lengths kind {case.lengths!r}")
        kv_lengths = rng.integers(1, s + 1, size=b).astype(np.int32).reshape(-1)
        kv_lengths[0], kv_lengths[-1] = s, 0
        arrays["kv_lengths"] = kv_lengths.reshape(b)
        if case.lengths == "ragged":
            q_lengths = rng.integers(0, t + 1, size=b).astype(np.int32).reshape(-1)
            q_lengths[0] = t
            arrays["q_lengths"] = q_lengths.reshape(b)
    if case.page_size is not None:
        arrays.update(_pages(rng, case, arrays["k"], arrays["v"]))
    arrays["sinks"] = rng.standard_normal(case.num_heads).astype(np.float32) * 2 if case.sinks else None
    bias_shapes = {None: None, "full": full, "full32": full, "shared": (t, s)}
    if case.bias not in bias_shapes:
        raise ValueError(f"unknown bias kind {case.bias!r}")
    arrays["bias"] = None if case.bias is None else normal(*bias_shapes[case.bias])
    if case.bias == "full32":
        arrays["bias"] = arrays["bias"].astype(np.float32)
    return arrays
