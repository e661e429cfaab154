"""What every jaxtile Pallas kernel shares: shapes, tiles in and out of HBM, the runtime
part of the mask, and the launch.

Kernels see whole arrays (``[batch, len, heads, dim]``, head dim padded to a power of two)
and index them by program id, so one kernel serves every batch element, head and tile
of a 1-D grid (``jax.vmap`` adds grid dimensions; Triton allows three). Tiles past the
end of a sequence or past the head dim are loaded as zeros by masked loads and never
stored; the mask description decides which tiles are visited at all.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxtile import _softmax as sm
from jaxtile._core import Config, Inputs
from jaxtile.mask import MaskSpec
from jaxtile.tuning import KernelTuning

MIN_BLOCK = 16  # the smallest tile Triton's dot accepts
MAX_HEAD_DIM = 256


def next_pow2(n: int) -> int:
    return max(MIN_BLOCK, 1 << (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Dims:
    """Static sizes of one call. ``head_dim_p``/``head_dim_v_p`` are padded to powers of two."""

    batch: int
    q_len: int
    kv_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int

    @classmethod
    def of(cls, inputs: Inputs) -> Dims:
        batch, q_len, num_heads, head_dim = inputs.q.shape
        _, kv_len, num_kv_heads, head_dim_v = inputs.v.shape
        if max(head_dim, head_dim_v) > MAX_HEAD_DIM:
            raise NotImplementedError(
                f"the Pallas kernels support head dims up to {MAX_HEAD_DIM}; got {head_dim=}, {head_dim_v=}. "
                "Use implementation='scan_v2', 'scan_v1' or 'reference'."
            )
        return cls(batch, q_len, kv_len, num_heads, num_kv_heads, head_dim, head_dim_v)

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def head_dim_p(self) -> int:
        return next_pow2(self.head_dim)

    @property
    def head_dim_v_p(self) -> int:
        return next_pow2(self.head_dim_v)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The tile shape of one kernel: ``block_q`` query rows by ``block_k`` key columns."""

    block_q: int
    block_k: int

    @classmethod
    def fit(cls, tuning: KernelTuning, dims: Dims, dtype, widest: int) -> Tiles:
        """The tuned (or requested) tiles, shrunk to a power of two >= 16 for short
        sequences, and capped to what fits in a Hopper SM's shared memory: ``widest`` for
        16-bit inputs, half that for float32 (whose three-product TF32 dots stage more),
        halved again for head dims above 128. (An H200 refused 128-row float32 tiles in
        FlashAttention-2's kernels, and 64-row ones in FlashAttention-1's backward.)"""
        cap = widest // (1 if jnp.dtype(dtype).itemsize == 2 else 2)
        cap //= 2 if max(dims.head_dim_p, dims.head_dim_v_p) > 128 else 1
        return cls(
            min(tuning.block_q, cap, next_pow2(dims.q_len)),
            min(tuning.block_k, cap, next_pow2(dims.kv_len)),
        )

    def num_q_tiles(self, dims: Dims) -> int:
        return pl.cdiv(dims.q_len, self.block_q)

    def num_kv_tiles(self, dims: Dims) -> int:
        return pl.cdiv(dims.kv_len, self.block_k)


def program_ids(num_tiles: int, num_heads: int, heaviest_first: bool):
    """``(tile, batch, head)`` of this program in a 1-D grid of ``tiles * batch * heads``.

    Consecutive programs share a head (and so its K/V in L2). With ``heaviest_first``
    the tiles run in reverse, so the longest causal rows start first.
    """
    pid = pl.program_id(0)
    tile = lax.rem(pid, num_tiles)
    bh = lax.div(pid, num_tiles)
    if heaviest_first:
        tile = num_tiles - 1 - tile
    return tile, lax.div(bh, num_heads), lax.rem(bh, num_heads)


def _iota(n: int):
    return lax.broadcasted_iota(jnp.int32, (n,), 0)


def load_tile(ref, b, h, start, block: int, length: int, dim: int, *, ragged: bool):
    """``ref[b, start:start+block, h, :]`` as ``[block, dim_p]``, zeros past ``length``
    (only checked when ``ragged``) and past ``dim``."""
    dim_p = ref.shape[-1]
    mask = None
    if ragged:
        mask = (start + _iota(block) < length)[:, None]
    if dim != dim_p:
        cols = (_iota(dim_p) < dim)[None, :]
        mask = cols if mask is None else mask & cols
    view = ref.at[b, pl.ds(start, block), h, :]
    if mask is None:
        return view[...]
    return plgpu.load(view, mask=mask, other=0.0)


def store_tile(ref, b, h, start, value, length: int, dim: int):
    """Stores ``value [block, dim_p]`` into ``ref[b, start:start+block, h, :dim]``."""
    block, dim_p = value.shape
    mask = (start + _iota(block) < length)[:, None] & (_iota(dim_p) < dim)[None, :]
    plgpu.store(ref.at[b, pl.ds(start, block), h, :], value.astype(ref.dtype), mask=mask)


def load_row_stat(ref, b, h, start, block: int, length: int, other: float):
    """``ref[b, h, start:start+block]`` (float32 per-row statistics), ``other`` past the end."""
    return plgpu.load(ref.at[b, h, pl.ds(start, block)], mask=start + _iota(block) < length, other=other)


def store_row_stat(ref, b, h, start, value, length: int):
    """Stores ``value [block]`` into ``ref[b, h, start:start+block]`` up to ``length``."""
    block = value.shape[0]
    plgpu.store(ref.at[b, h, pl.ds(start, block)], value, mask=start + _iota(block) < length)


@dataclasses.dataclass(frozen=True)
class RuntimeMask:
    """The runtime arrays of the mask (segment ids, dense mask) as kernel refs."""

    q_segment_ids: object = None
    kv_segment_ids: object = None
    dense: object = None

    def visible(self, spec: MaskSpec, b, h, q_start, block_q: int, kv_start, block_k: int, *, transposed=False):
        """Element-wise visibility of a tile: ``[block_q, block_k]``, or ``[block_k,
        block_q]`` when ``transposed`` (the layout of the dK/dV kernel)."""
        rows = q_start + _iota(block_q)
        cols = kv_start + _iota(block_k)
        # Rows past q_len are never stored (forward, dQ) or contribute zeros (dK/dV:
        # they load as zeros with lse = +inf), so only a ragged key tail needs hiding.
        check_bounds = spec.kv_len % block_k != 0
        q_seg = kv_seg = dense = None
        if spec.has_segments:
            q_seg = plgpu.load(self.q_segment_ids.at[b, pl.ds(q_start, block_q)], mask=rows < spec.q_len, other=-1)
            kv_seg = plgpu.load(self.kv_segment_ids.at[b, pl.ds(kv_start, block_k)], mask=cols < spec.kv_len, other=-2)
        if spec.has_dense_mask:
            dense = self._dense_tile(b, h, q_start, block_q, kv_start, block_k, spec)
            if transposed:
                dense = dense.T
        if transposed:
            return spec.visible(
                rows[None, :],
                cols[:, None],
                q_segment=None if q_seg is None else q_seg[None, :],
                kv_segment=None if kv_seg is None else kv_seg[:, None],
                dense=dense,
                check_bounds=check_bounds,
            )
        return spec.visible(
            rows[:, None],
            cols[None, :],
            q_segment=None if q_seg is None else q_seg[:, None],
            kv_segment=None if kv_seg is None else kv_seg[None, :],
            dense=dense,
            check_bounds=check_bounds,
        )

    def _dense_tile(self, b, h, q_start, block_q, kv_start, block_k, spec):
        """The ``[block_q|1, block_k|1]`` tile of the ``[1|B, 1|H, 1|T, 1|S]`` mask."""
        ref = self.dense
        nb, nh, nq, nk = ref.shape
        rows = pl.ds(q_start, block_q) if nq > 1 else pl.ds(0, 1)
        cols = pl.ds(kv_start, block_k) if nk > 1 else pl.ds(0, 1)
        ok_rows = (q_start + _iota(block_q) < spec.q_len)[:, None] if nq > 1 else jnp.ones((1, 1), jnp.bool_)
        ok_cols = (kv_start + _iota(block_k) < spec.kv_len)[None, :] if nk > 1 else jnp.ones((1, 1), jnp.bool_)
        zero = jnp.int32(0)
        view = ref.at[b if nb > 1 else zero, h if nh > 1 else zero, rows, cols]
        return plgpu.load(view, mask=ok_rows & ok_cols, other=False)


def runtime_inputs(inputs: Inputs) -> list[jax.Array]:
    """The runtime mask arrays a kernel needs, in `split_refs` order."""
    arrays = []
    if inputs.q_segment_ids is not None:
        arrays += [inputs.q_segment_ids, inputs.kv_segment_ids]
    if inputs.mask is not None:
        arrays.append(inputs.mask)
    return arrays


def split_refs(refs: Sequence, num_leading: int, spec: MaskSpec):
    """Splits a kernel's refs into ``(leading, RuntimeMask, rest)``."""
    leading, rest = list(refs[:num_leading]), list(refs[num_leading:])
    runtime = RuntimeMask()
    if spec.has_segments:
        runtime = dataclasses.replace(runtime, q_segment_ids=rest.pop(0), kv_segment_ids=rest.pop(0))
    if spec.has_dense_mask:
        runtime = dataclasses.replace(runtime, dense=rest.pop(0))
    return leading, runtime, rest


def _full_block(shape: tuple[int, ...], padded_last: int | None = None) -> pl.BlockSpec:
    block = (*shape[:-1], padded_last or shape[-1])
    return pl.BlockSpec(block, lambda i: (0,) * len(shape))


def _block_for(x: jax.ShapeDtypeStruct | jax.Array) -> pl.BlockSpec:
    """Whole-array block; 4-D ``[batch, len, heads, dim]`` arrays get a padded head dim."""
    if x.ndim == 4 and x.dtype != jnp.bool_:
        return _full_block(x.shape, next_pow2(x.shape[-1]))
    return _full_block(x.shape)


def _varying_like(out: jax.ShapeDtypeStruct, like: jax.Array) -> jax.ShapeDtypeStruct:
    """``out``, varying over the same manual mesh axes as ``like``, as ``shard_map``
    with ``check_vma`` needs (the field is ``manual_axis_type`` in jax 0.10, ``vma``
    before)."""
    aval = jax.typeof(like)
    for field in ("manual_axis_type", "vma"):
        if field in inspect.signature(jax.ShapeDtypeStruct).parameters and hasattr(aval, field):
            return jax.ShapeDtypeStruct(out.shape, out.dtype, **{field: getattr(aval, field)})
    return out


def launch(
    kernel: Callable,
    *,
    num_programs: int,
    inputs: Sequence[jax.Array],
    outputs: Sequence[jax.ShapeDtypeStruct],
    tuning: KernelTuning,
    config: Config,
    name: str,
):
    """Runs ``kernel`` on a 1-D grid through the Triton backend (interpreted off-GPU)."""
    return pl.pallas_call(
        kernel,
        grid=(num_programs,),
        in_specs=[_block_for(x) for x in inputs],
        out_specs=[_block_for(x) for x in outputs],
        out_shape=[_varying_like(out, inputs[0]) for out in outputs],
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        interpret=config.platform != "gpu",
        name=name,
    )(*inputs)


def _exp2_hardware(x):
    [y] = plgpu.elementwise_inline_asm(
        "ex2.approx.ftz.f32 $0, $1;",
        args=[x],
        constraints="=f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )
    return y


@dataclasses.dataclass(frozen=True)
class Kernel:
    """Static parameters every kernel body reads: the call's config, sizes and tiles."""

    config: Config
    dims: Dims
    tiles: Tiles

    @classmethod
    def create(cls, inputs: Inputs, config: Config, tuning: KernelTuning, widest: int) -> Kernel:
        """``widest``: the largest tile side `Tiles.fit` allows for 16-bit inputs."""
        dims = Dims.of(inputs)
        return cls(config, dims, Tiles.fit(tuning, dims, inputs.q.dtype, widest))

    def dot(self, a, b, *, trans_a: bool = False, trans_b: bool = False):
        """``a @ b`` (optionally transposed) with float32 accumulation. float32 inputs get
        float32 accuracy: three TF32 products on the GPU's tensor cores (Triton's default
        would be one, ~1e-3 relative; IEEE products on CUDA cores compile and run an
        order of magnitude slower), exact products in interpret mode."""
        precision = None
        if a.dtype == jnp.float32:
            gpu = self.config.platform == "gpu"
            precision = lax.DotAlgorithmPreset.TF32_TF32_F32_X3 if gpu else lax.Precision.HIGHEST
        return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=precision)

    def masked_dot(self, p, x, visible=None, *, trans_a: bool = False):
        """``p @ x`` (``pᵀ @ x`` with ``trans_a``) for a float32 tile ``p`` whose masked
        entries are 0, rounded to ``x``'s dtype for the matrix units; through
        `sm.masked_dot`, so a non-finite ``x`` reaches only the rows that see it."""
        return sm.masked_dot(functools.partial(self.dot, trans_a=trans_a), p.astype(x.dtype), x, visible)

    def ds_dot(self, ds, x, visible=None, *, trans_a: bool = False):
        """`masked_dot` for ``dS``, which unlike ``P`` is unbounded: in float16 each output
        row's entries of ``dS`` are divided by a power of two that brings them under 2**15
        and the product is multiplied back (``|dS|`` can exceed float16's 65504 where dQ
        and dK do not)."""
        if x.dtype != jnp.float16:
            return self.masked_dot(ds, x, visible, trans_a=trans_a)
        peak = jnp.max(jnp.abs(ds), axis=0 if trans_a else 1)
        inv_scale = jnp.where(peak > 2.0**15, jnp.exp2(15.0 - jnp.ceil(jnp.log2(peak))), 1.0)
        scaled = ds * (inv_scale[None, :] if trans_a else inv_scale[:, None])
        return self.masked_dot(scaled, x, visible, trans_a=trans_a) / inv_scale[:, None]

    def barrier(self) -> None:
        """Orders this program's earlier global-memory writes before its later reads
        (a block-wide barrier on the GPU; interpret mode runs sequentially)."""
        if self.config.platform == "gpu":
            plgpu.debug_barrier()

    @property
    def exp2(self):
        """Base-2 exponential: one ``ex2.approx.ftz`` instruction on the GPU (relative
        error below 2**-22; denormal results flush to 0, negligible next to the row
        maximum of 1), ``jnp.exp2`` in interpret mode."""
        return _exp2_hardware if self.config.platform == "gpu" else jnp.exp2
