"""``implementation="pallas_v2"``: FlashAttention-2 as Pallas kernels lowered to Triton.

Dao (2023), Algorithms 1 and 2, in three kernels:

* forward: one program per (query tile, batch, head) — or, for queries too short to fill
  a tile (decoding), per group of query heads sharing a kv head (`pk.Tiles`); the
  key/value loop visits only the tiles the mask description allows (segment ids and a
  dense mask included, through `MaskSpec.tile_bounds`), applying the element-wise mask
  only on boundary tiles; online softmax in base 2; writes out and lse.
* dK/dV: one program per (key tile, batch, kv head), or per share of the kv head's query
  heads when there are too few kv heads to fill the GPU (MQA; the float32 shares are
  summed by XLA in a fixed order). It loops over its query heads and, for each, over the
  query tiles that can see the key tile, accumulating dK and dV in registers: no
  atomics, no repeated K/V, bitwise-deterministic results. Scores are formed transposed
  (``K Qᵀ``) so ``Pᵀ`` and ``dSᵀ`` feed the matrix units without a transpose.
* dQ: one program per query tile as in the forward, looping over key tiles.

Only boundary tiles pay for exactness: their products zero the non-finite entries of
the operand they contract and, in the rare tile that has any, add them back to exactly
the rows that see them (`pk.Kernel.accumulate`); interior tiles are plain products.
``D = rowsum(dO ∘ O)`` and the base-2 lse are formed by XLA before the backward kernels.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxtile import _softmax as sm
from jaxtile import registry
from jaxtile._core import AUTOTUNE, Config, Inputs, Shape, differentiable
from jaxtile.triton import _kernel as pk
from jaxtile.triton import tuning as tn


def _tuning(inputs: Inputs, config: Config) -> tn.Tuning:
    """The launch parameters of this call: the user's, autotuned, or the table's."""
    dims = Shape.of(inputs.q, inputs.k, inputs.v)
    head_dim = pk.next_pow2(max(dims.head_dim, dims.head_dim_v))
    kind = tn.mask_kind(config.mask)
    if isinstance(config.tuning, tn.Tuning):
        tuning = config.tuning
    elif config.tuning == AUTOTUNE and config.platform == "gpu":
        key = (dims, inputs.q.dtype, config.mask, config.logits, config.block_q, config.block_k)
        options = tn.candidates(head_dim, inputs.q.dtype, kind)
        return tn.autotuned(key, options, functools.partial(_measure, inputs, config))
    else:
        tuning = tn.default_tuning(head_dim, inputs.q.dtype, kind)
    return tuning.with_blocks(config.block_q, config.block_k)


def _measure(inputs: Inputs, config: Config, tuning: tn.Tuning) -> tuple[float, float]:
    """Forward and backward seconds of one candidate, on random data of the same shapes."""
    config = dataclasses.replace(config, tuning=tuning.with_blocks(config.block_q, config.block_k))
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, dout = (
        jax.random.normal(key, x.shape, x.dtype) for key, x in zip(keys, (inputs.q, inputs.k, inputs.v, inputs.q))
    )
    dout = dout[..., : inputs.v.shape[-1]]
    segments = [None if x is None else jnp.zeros(x.shape, x.dtype) for x in inputs[3:5]]
    mask = None if inputs.mask is None else jnp.ones(inputs.mask.shape, jnp.bool_)
    bias = None if inputs.bias is None else jax.random.normal(keys[0], inputs.bias.shape, inputs.bias.dtype)

    attention = differentiable(_forward, _backward)

    def run(q, k, v):
        return attention(Inputs(q, k, v, *segments, mask, inputs.lengths, bias), config)

    forward = jax.jit(run)
    fwd = tn.median_seconds(lambda: jax.block_until_ready(forward(q, k, v)))
    both = jax.jit(lambda q, k, v: jax.vjp(run, q, k, v)[1]((dout, jnp.zeros_like(forward(q, k, v)[1]))))
    total = tn.median_seconds(lambda: jax.block_until_ready(both(q, k, v)))
    return fwd, max(total - fwd, 0.0)


# The dK/dV kernel splits a kv head's query heads over programs below this many programs
# (`Shape.head_shares`).
_MIN_PROGRAMS = 1024
# What each kernel keeps in shared memory (`pk.Staging`), for `pk.Tiles.fit`.
_FORWARD = pk.Staging(resident=(("q", "d"),), streamed=(("k", "d"), ("k", "v")), split_float32=True)
_DKDV = pk.Staging(resident=(("k", "d"), ("k", "v")), streamed=(("q", "d"), ("q", "v")), split_float32=True)
_DQ = pk.Staging(resident=(("q", "d"), ("q", "v")), streamed=(("k", "d"), ("k", "v")), split_float32=True)


def _packable(inputs: Inputs) -> bool:
    """Query heads of a group can share a tile unless a dense mask or a bias differs by
    head."""
    return all(x is None or x.shape[1] == 1 for x in (inputs.mask, inputs.bias))


def _forward_kernel(*refs, kernel: pk.Kernel, splits: int, pages: pk.Pages | None, sinks: bool):
    """Algorithm 1 for one (query tile, batch, packed heads) — and, with ``splits`` > 1,
    one of ``splits`` equal shares of its key tiles (split-KV decoding: the partial
    results of the shares merge by their lse, `jaxtile._softmax.merge`). With ``pages``,
    K and V are page pools read through a page table (the ref after them). With
    ``sinks``, a ref of the heads' sinks in base 2 (``[heads]``) follows the mask's."""
    (q_ref, k_ref, v_ref, *table), runtime, (*sinks_ref, o_ref, lse_ref) = pk.split_refs(
        refs, 3 + (pages is not None), kernel.config
    )
    spec, logits, dims, tiles = kernel.config.mask, kernel.config.logits, kernel.dims, kernel.tiles
    n, bk = tiles.positions, tiles.block_k
    t, part, hb = pk.program_ids(tiles.num_q_tiles(dims), dims.num_heads // tiles.pack, spec.heaviest_last)
    # Outputs are [splits * batch, ...]: this program writes row `part` of its share.
    b, share = (lax.rem(part, np.int32(dims.batch)), lax.div(part, np.int32(dims.batch))) if splits > 1 else (part, 0)
    h0 = hb * tiles.pack
    h_kv = lax.div(h0, np.int32(dims.group))
    q_start = t * n
    # Line 4: load Q_i (stays in registers); initialise O_i, l_i, m_i.
    q = pk.load_rows(q_ref, b, h0, q_start, tiles, dims.q_len, dims.head_dim, ragged=dims.q_len % n != 0)

    def lookup(start, block=bk):
        """With pages, the page ids of keys ``start:start+block`` (`pk.Pages.lookup`)."""
        return None if pages is None else pages.lookup(table[0], b, start, block)

    def load_kv(ref, start, dim, masked, ids, block=bk):
        if pages is None:
            return pk.load_tile(ref, b, h_kv, start, block, dims.kv_len, dim, ragged=masked)
        return pages.load(ref, ids, h_kv, start, block, dims.kv_len, dim, ragged=masked)

    ahead = pages is not None and pages.ids_ahead

    def body(masked, j, carry):
        acc, m_i, l_i, ids = carry
        kv_start = j * bk
        # With pages, the next tile's page ids are read one step ahead (so that this
        # tile's loads do not wait on the page table), or this tile's now.
        ids, next_ids = (ids, lookup(kv_start + bk)) if ahead else (lookup(kv_start), None)
        # Lines 6-8: load K_j; S_ij = Q_i K_jᵀ, plus the bias. (Each tile is loaded just
        # before its first use, which lets Triton's pipeliner wait on K_j alone before the
        # first dot.)
        k_j = load_kv(k_ref, kv_start, dims.head_dim, masked, ids)
        bias = runtime.bias_tile(spec, b, h0, q_start, tiles, kv_start, bk)
        pre = logits.pre(kernel.dot(q, k_j, trans_b=True), bias)
        visible = runtime.visible(spec, b, h0, q_start, tiles, kv_start, bk) if masked else None
        # Lines 9-10: online softmax; O_i = diag(exp(m_old - m_new)) O_i + P_ij V_j.
        p, alpha, m_i, l_i = sm.online_softmax(pre, m_i, l_i, logits, visible, kernel.exp2)
        v_j = load_kv(v_ref, kv_start, dims.head_dim_v, masked, ids)
        contained = None
        if masked:
            contained = pk.Contained(
                row=lambda c: load_kv(v_ref, kv_start + c, dims.head_dim_v, True, lookup(kv_start + c, 1), 1),
                seen=lambda c: runtime.visible(spec, b, h0, q_start, tiles, kv_start + c, 1),
                count=bk,
            )
        return kernel.accumulate(acc * alpha[:, None], p, v_j, contained), m_i, l_i, next_ids

    # Line 4: O_i = 0, l_i = 0, m_i = -inf; a sink is each row's first logit, with value
    # 0 (m_i = sink, l_i = 1; l_i = 0 for a sink of -inf).
    acc = jnp.zeros((tiles.block_q, kernel.head_dim_v_p), jnp.float32)
    m_i = jnp.full((tiles.block_q,), -jnp.inf, jnp.float32)
    l_i = jnp.zeros((tiles.block_q,), jnp.float32)
    if sinks:
        m_i = pk.load_heads_stat(sinks_ref[0], h0, tiles)
        l_i = jnp.where(m_i == -jnp.inf, 0.0, 1.0)
    carry = (acc, m_i, l_i)
    spans = runtime.spans(spec, b, h0, t, False, n, bk)
    if splits > 1:
        # Equal shares of the tiles this query tile visits (the spans are contiguous), so
        # that lengths, windows and the diagonal leave no share idle while others work.
        lo, hi = spans[0].start, spans[-1].stop
        per_share = lax.div(hi - lo + np.int32(splits - 1), np.int32(splits))
        first = lo + share * per_share
        spans = [span.within(first, first + per_share) for span in spans]
    for span in spans:
        carry = (*carry[:3], lookup(span.start * bk) if ahead else None)
        carry = pk.fori_loop(span.start, span.stop, functools.partial(body, span.masked), carry)
    # Lines 12-13: normalise once; L_i = m_i + log(l_i).
    out, lse = sm.finalize(*carry[:3])
    pk.store_rows(o_ref, part, h0, q_start, out, tiles, dims.q_len, dims.head_dim_v)
    pk.store_rows_stat(lse_ref, part, h0, q_start, lse, tiles, dims.q_len)


def forward_pass(
    inputs: Inputs,
    config: Config,
    tuning: tn.KernelTuning,
    *,
    splits: Callable[[Shape, pk.Tiles], int] | None = None,
    paged: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    ids_ahead: bool = True,
):
    """The forward kernel: ``out [splits, batch, q_len, heads, dv]`` (the query's dtype
    without splits, float32 partial results with them) and ``lse [splits, batch, heads,
    q_len]``. ``splits(dims, tiles)`` gives the number of equal shares of the key tiles
    (split-KV decoding; one without it). With ``paged = (k_pages, v_pages, page_table)``
    (`pk.Pages`) the kernel reads K and V from the pages, and ``inputs.k``/``inputs.v``
    only give the shape of the cache they hold (``[batch, pages_per_sequence ·
    page_size, num_kv_heads, dim]``); ``ids_ahead`` is `pk.Pages`'. ``inputs.sinks`` are
    each row's first logit (one share only: the merge of several would count them once
    per share)."""
    pages = None if paged is None else pk.Pages(paged[0].shape[2], paged[0].shape[1], ids_ahead)
    kernel = pk.Kernel.create(inputs, config, tuning, _FORWARD, packable=_packable(inputs))
    dims, tiles = kernel.dims, kernel.tiles
    shares = 1 if splits is None else splits(dims, tiles)
    if inputs.sinks is not None and shares > 1:
        raise ValueError(f"sinks need the keys in one share; got {shares=} (fold them into the merged result)")
    bounds = pk.tile_bounds(inputs, config.mask, tiles.positions, tiles.block_k, transposed=False)
    sinks = [] if inputs.sinks is None else [inputs.sinks * sm.LOG2E]
    rows = shares * dims.batch
    out, lse = pk.launch(
        functools.partial(_forward_kernel, splits=shares, pages=pages, sinks=inputs.sinks is not None),
        kernel,
        num_programs=tiles.num_q_tiles(dims) * rows * (dims.num_heads // tiles.pack),
        inputs=[inputs.q, *(paged or (inputs.k, inputs.v)), *pk.runtime_inputs(inputs), *bounds, *sinks],
        outputs=[
            jax.ShapeDtypeStruct(
                (rows, dims.q_len, dims.num_heads, dims.head_dim_v), inputs.q.dtype if shares == 1 else jnp.float32
            ),
            jax.ShapeDtypeStruct((rows, dims.q_len, dims.num_heads), jnp.float32),
        ],
        name="jaxtile_fa2_forward" if shares == 1 else "jaxtile_split_kv_forward",
    )
    out = out.reshape(shares, dims.batch, *out.shape[1:])
    return out, jnp.swapaxes(lse, 1, 2).reshape(shares, dims.batch, dims.num_heads, dims.q_len)


def _forward(inputs: Inputs, config: Config):
    out, lse = forward_pass(inputs, config, _tuning(inputs, config).forward)
    return out[0], lse[0], lse[0]


def _paged_forward(inputs: Inputs, config: Config, paged):
    out, lse = forward_pass(inputs, config, _tuning(inputs, config).forward, paged=paged)
    return out[0], lse[0]


def _dkdv_kernel(*refs, kernel: pk.Kernel, splits: int):
    """Algorithm 2, lines 6-18, for one (key tile, batch, kv head, share of its query
    heads), transposed."""
    (q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref), runtime, (dk_ref, dv_ref) = pk.split_refs(
        refs, 6, kernel.config
    )
    spec, logits, dims, tiles = kernel.config.mask, kernel.config.logits, kernel.dims, kernel.tiles
    bq, bk = tiles.block_q, tiles.block_k
    j, b, share = pk.program_ids(tiles.num_kv_tiles(dims), dims.num_kv_heads * splits, heaviest_first=False)
    h_kv = lax.div(share, np.int32(splits))
    heads = dims.group // splits
    kv_start = j * bk
    ragged_kv = dims.kv_len % bk != 0
    # Lines 6-7: load K_j, V_j; dK_j = dV_j = 0.
    k_j = pk.load_tile(k_ref, b, h_kv, kv_start, bk, dims.kv_len, dims.head_dim, ragged=ragged_kv)
    v_j = pk.load_tile(v_ref, b, h_kv, kv_start, bk, dims.kv_len, dims.head_dim_v, ragged=ragged_kv)
    ragged_q = dims.q_len % bq != 0
    one_row = dataclasses.replace(tiles, block_q=1, pack=1)

    def body(h, masked, i, carry):
        dk_j, dv_j = carry
        q_start = i * bq
        # Lines 8-11: load Q_i and L_i (rows past q_len: zeros and L = +inf);
        # Sᵀ = K_j Q_iᵀ (plus the bias), Pᵀ = exp(Sᵀ - L_i).
        q_i = pk.load_tile(q_ref, b, h, q_start, bq, dims.q_len, dims.head_dim, ragged=ragged_q)
        bias_t = runtime.bias_tile(spec, b, h, q_start, tiles, kv_start, bk, transposed=True)
        pre_t = logits.pre(kernel.dot(k_j, q_i, trans_b=True), bias_t)
        visible = runtime.visible(spec, b, h, q_start, tiles, kv_start, bk, transposed=True) if masked else None
        lse2 = pk.load_row_stat(lse2_ref, b, h, q_start, bq, dims.q_len, jnp.inf)
        p_t = sm.probabilities(pre_t, lse2[None, :], logits, visible, kernel.exp2)
        # Line 12: load dO_i; dV_j += Pᵀ dO_i.
        do_i = pk.load_tile(do_ref, b, h, q_start, bq, dims.q_len, dims.head_dim_v, ragged=ragged_q)
        dv_j = kernel.accumulate(dv_j, p_t, do_i)
        # Lines 13-14: dPᵀ = V_j dO_iᵀ, dSᵀ = Pᵀ ∘ (dPᵀ - D_i).
        dp_t = kernel.dot(v_j, do_i, trans_b=True)
        delta = pk.load_row_stat(delta_ref, b, h, q_start, bq, dims.q_len, 0.0)
        ds_t = sm.score_grad(p_t, dp_t, delta[None, :], pre_t, logits, visible)
        # Line 16: dK_j += dSᵀ Q_i.
        contained = None
        if masked:
            contained = pk.Contained(
                row=lambda c: pk.load_tile(q_ref, b, h, q_start + c, 1, dims.q_len, dims.head_dim, ragged=True),
                seen=lambda c: runtime.visible(spec, b, h, q_start + c, one_row, kv_start, bk, transposed=True),
                count=bq,
            )
        return kernel.accumulate(dk_j, ds_t, q_i, contained, unbounded=True), dv_j

    def one_head(g, carry):
        h = share * heads + g
        for span in runtime.spans(spec, b, h, j, True, bq, bk):
            carry = pk.fori_loop(span.start, span.stop, functools.partial(body, h, span.masked), carry)
        return carry

    carry = (jnp.zeros((bk, kernel.head_dim_p), jnp.float32), jnp.zeros((bk, kernel.head_dim_v_p), jnp.float32))
    dk_j, dv_j = pk.fori_loop(0, heads, one_head, carry)
    # Line 18: write dK_j, dV_j (this share's part of them).
    pk.store_tile(dk_ref, b, share, kv_start, dk_j, dims.kv_len, dims.head_dim)
    pk.store_tile(dv_ref, b, share, kv_start, dv_j, dims.kv_len, dims.head_dim_v)


def _dq_kernel(*refs, kernel: pk.Kernel):
    """Algorithm 2, line 15, for one (query tile, batch, packed heads): dQ_i = Σ_j dS_ij K_j.
    With a bias (one head per tile), it also writes the bias's gradient, dS before the
    scale (`Logits.logit_grad`), on every key tile: 0 where the mask hides the tile."""
    (q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref), runtime, (dq_ref, *dbias) = pk.split_refs(
        refs, 6, kernel.config
    )
    spec, logits, dims, tiles = kernel.config.mask, kernel.config.logits, kernel.dims, kernel.tiles
    n, bk = tiles.positions, tiles.block_k
    t, b, hb = pk.program_ids(tiles.num_q_tiles(dims), dims.num_heads // tiles.pack, spec.heaviest_last)
    h0 = hb * tiles.pack
    h_kv = lax.div(h0, np.int32(dims.group))
    q_start = t * n
    ragged_q = dims.q_len % n != 0
    q_i = pk.load_rows(q_ref, b, h0, q_start, tiles, dims.q_len, dims.head_dim, ragged=ragged_q)
    do_i = pk.load_rows(do_ref, b, h0, q_start, tiles, dims.q_len, dims.head_dim_v, ragged=ragged_q)
    lse2 = pk.load_rows_stat(lse2_ref, b, h0, q_start, tiles, dims.q_len, jnp.inf)
    delta = pk.load_rows_stat(delta_ref, b, h0, q_start, tiles, dims.q_len, 0.0)

    def body(masked, j, dq_i):
        kv_start = j * bk
        k_j = pk.load_tile(k_ref, b, h_kv, kv_start, bk, dims.kv_len, dims.head_dim, ragged=masked)
        bias = runtime.bias_tile(spec, b, h0, q_start, tiles, kv_start, bk)
        pre = logits.pre(kernel.dot(q_i, k_j, trans_b=True), bias)
        visible = runtime.visible(spec, b, h0, q_start, tiles, kv_start, bk) if masked else None
        p = sm.probabilities(pre, lse2[:, None], logits, visible, kernel.exp2)
        v_j = pk.load_tile(v_ref, b, h_kv, kv_start, bk, dims.kv_len, dims.head_dim_v, ragged=masked)
        dp = kernel.dot(do_i, v_j, trans_b=True)
        store_bias_grad = None
        if dbias:
            store_bias_grad = functools.partial(pk.store_scores_tile, dbias[0], b, h0, q_start, kv_start, spec=spec)
        ds = pk.score_grad(p, dp, delta[:, None], pre, logits, visible, store_bias_grad)
        contained = None
        if masked:
            contained = pk.Contained(
                row=lambda c: pk.load_tile(k_ref, b, h_kv, kv_start + c, 1, dims.kv_len, dims.head_dim, ragged=True),
                seen=lambda c: runtime.visible(spec, b, h0, q_start, tiles, kv_start + c, 1),
                count=bk,
            )
        return kernel.accumulate(dq_i, ds, k_j, contained, unbounded=True)

    dq_i = jnp.zeros((tiles.block_q, kernel.head_dim_p), jnp.float32)
    spans = runtime.spans(spec, b, h0, t, False, n, bk)
    for span in spans:
        dq_i = pk.fori_loop(span.start, span.stop, functools.partial(body, span.masked), dq_i)
    if dbias:  # the spans are contiguous: the hidden key tiles lie before and after them
        pk.zero_scores_tiles(dbias[0], b, h0, q_start, 0, spans[0].start, n, bk, spec)
        pk.zero_scores_tiles(dbias[0], b, h0, q_start, spans[-1].stop, tiles.num_kv_tiles(dims), n, bk, spec)
    pk.store_rows(dq_ref, b, h0, q_start, dq_i, tiles, dims.q_len, dims.head_dim)


def _backward(inputs: Inputs, out, lse, dout, dlse, config: Config):
    """Algorithm 2 as a dK/dV kernel and a dQ kernel (which also writes the bias's
    gradient); returns ``(dq, dk, dv, dbias)`` (`_core.Backward`)."""
    tuning = _tuning(inputs, config)
    spec = config.mask
    # Line 4: D_i = rowsum(dO_i ∘ O_i), minus the lse cotangent; lse in base 2. The dK/dV
    # kernel reads them per head ([b, h, t]), the dQ kernel per packed tile ([b, t, h]).
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - jnp.swapaxes(dlse, 1, 2)
    lse2 = sm.lse_base2(lse)
    heads_first = [lse2, jnp.swapaxes(delta, 1, 2)]
    positions_first = [jnp.swapaxes(lse2, 1, 2), delta]
    runtime = pk.runtime_inputs(inputs)

    kdkv = pk.Kernel.create(inputs, config, tuning.dkdv, _DKDV)
    dims, tiles = kdkv.dims, kdkv.tiles
    splits = dims.head_shares(tiles.num_kv_tiles(dims), _MIN_PROGRAMS)
    # With several shares, each writes its float32 part of dK, dV; XLA sums them in a
    # fixed order (deterministic, no atomics).
    parts = [
        jax.ShapeDtypeStruct(
            (dims.batch, dims.kv_len, dims.num_kv_heads * splits, x.shape[-1]), x.dtype if splits == 1 else jnp.float32
        )
        for x in (inputs.k, inputs.v)
    ]
    dk, dv = pk.launch(
        functools.partial(_dkdv_kernel, splits=splits),
        kdkv,
        num_programs=tiles.num_kv_tiles(dims) * dims.batch * dims.num_kv_heads * splits,
        inputs=[
            inputs.q,
            inputs.k,
            inputs.v,
            dout,
            *heads_first,
            *runtime,
            *pk.tile_bounds(inputs, spec, tiles.block_q, tiles.block_k, transposed=True),
        ],
        outputs=parts,
        name="jaxtile_fa2_dkdv",
    )
    if splits > 1:
        dk, dv = (
            jnp.sum(x.reshape(*x.shape[:2], dims.num_kv_heads, splits, x.shape[-1]), axis=3).astype(like.dtype)
            for x, like in ((dk, inputs.k), (dv, inputs.v))
        )
    kdq = pk.Kernel.create(inputs, config, tuning.dq, _DQ, packable=_packable(inputs) and inputs.bias is None)
    tiles = kdq.tiles
    dq, *dbias = pk.launch(
        _dq_kernel,
        kdq,
        num_programs=tiles.num_q_tiles(dims) * dims.batch * (dims.num_heads // tiles.pack),
        inputs=[
            inputs.q,
            inputs.k,
            inputs.v,
            dout,
            *positions_first,
            *runtime,
            *pk.tile_bounds(inputs, spec, tiles.positions, tiles.block_k, transposed=False),
        ],
        outputs=[jax.ShapeDtypeStruct(inputs.q.shape, inputs.q.dtype), *pk.scores_grad(inputs, dims)],
        name="jaxtile_fa2_dq",
    )
    return dq, dk, dv, dbias[0] if dbias else None


IMPLEMENTATION = registry.register(
    registry.Implementation(
        name="pallas_v2",
        summary="FlashAttention-2 as Pallas/Triton kernels: forward, dK/dV, dQ",
        family="triton",
        algorithm="FlashAttention-2",
        forward=_forward,
        backward=_backward,
        memory=lambda shape, block_q, block_k, backward: pk.memory(shape, fa1=False, backward=backward),
        paged_forward=_paged_forward,
        platforms=frozenset({"gpu"}),
        interprets=frozenset({"cpu"}),
        max_head_dim=pk.MAX_HEAD_DIM,
        power_of_two_blocks=True,
        recognises_masks=True,
        lse_backward=True,
        takes_sinks=True,
        tuning=tn.Tuning,
        speed=50,
    )
)
