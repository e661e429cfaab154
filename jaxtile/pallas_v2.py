"""``implementation="pallas_v2"``: FlashAttention-2 as Pallas kernels lowered to Triton.

Dao (2023), Algorithms 1 and 2, in three kernels:

* forward: one program per (query tile, batch, head); the key/value loop visits only
  the tiles the mask description allows, applying the element-wise mask only on
  boundary tiles; online softmax in base 2; writes out and lse.
* dK/dV: one program per (key tile, batch, kv head). It loops over the query heads of
  its group and, for each, over the query tiles that can see the key tile, accumulating
  dK and dV in registers: no atomics, no repeated K/V, bitwise-deterministic results.
  Scores are formed transposed (``K Qᵀ``) so ``Pᵀ`` and ``dSᵀ`` feed the matrix units
  without a transpose.
* dQ: one program per (query tile, batch, head), looping over key tiles.

``D = rowsum(dO ∘ O)`` and the base-2 lse are formed by XLA before the backward kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxtile import _pallas as pk
from jaxtile import _softmax as sm
from jaxtile import tuning as tn
from jaxtile._core import Config, Inputs, differentiable

_WIDEST = 128  # requested tiles are capped to this (16-bit inputs; see `pk.Tiles.fit`)


def _tuning(inputs: Inputs, config: Config) -> tn.Tuning:
    """The launch parameters of this call: the user's, autotuned, or the table's."""
    dims = pk.Dims.of(inputs)
    head_dim = max(dims.head_dim_p, dims.head_dim_v_p)
    causal = config.mask.right is not None
    if isinstance(config.tuning, tn.Tuning):
        tuning = config.tuning
    elif config.tuning == tn.AUTOTUNE and config.platform == "gpu":
        key = (dims, inputs.q.dtype, config.mask, config.logits, config.block_q, config.block_k)
        options = tn.candidates(head_dim, inputs.q.dtype, causal)
        return tn.autotuned(key, options, functools.partial(_measure, inputs, config))
    else:
        tuning = tn.default_tuning(head_dim, inputs.q.dtype, causal)
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

    def run(q, k, v):
        return attention(Inputs(q, k, v, *segments, mask), config)

    try:
        forward = jax.jit(run)
        fwd = tn.median_seconds(lambda: jax.block_until_ready(forward(q, k, v)))
        both = jax.jit(lambda q, k, v: jax.vjp(run, q, k, v)[1]((dout, jnp.zeros_like(forward(q, k, v)[1]))))
        total = tn.median_seconds(lambda: jax.block_until_ready(both(q, k, v)))
    except Exception:  # a candidate that does not fit (shared memory, registers) loses
        return float("inf"), float("inf")
    return fwd, max(total - fwd, 0.0)


def _forward_kernel(*refs, kernel: pk.Kernel):
    """Algorithm 1 for one (query tile, batch, head)."""
    (q_ref, k_ref, v_ref), runtime, (o_ref, lse_ref) = pk.split_refs(refs, 3, kernel.config.mask)
    spec, logits, dims = kernel.config.mask, kernel.config.logits, kernel.dims
    bq, bk = kernel.tiles.block_q, kernel.tiles.block_k
    t, b, h = pk.program_ids(kernel.tiles.num_q_tiles(dims), dims.num_heads, heaviest_first=spec.right is not None)
    h_kv = lax.div(h, dims.group)
    q_start = t * bq
    # Line 4: load Q_i (stays in registers); initialise O_i, l_i, m_i.
    q = pk.load_tile(q_ref, b, h, q_start, bq, dims.q_len, dims.head_dim, ragged=dims.q_len % bq != 0)

    def body(masked, j, carry):
        acc, m_i, l_i = carry
        kv_start = j * bk
        # Lines 6-8: load K_j; S_ij = Q_i K_jᵀ. (Each tile is loaded just before its
        # first use, which lets Triton's pipeliner wait on K_j alone before the first dot.)
        k_j = pk.load_tile(k_ref, b, h_kv, kv_start, bk, dims.kv_len, dims.head_dim, ragged=masked)
        qk = kernel.dot(q, k_j, trans_b=True)
        pre = logits.pre(qk)
        visible = runtime.visible(spec, b, h, q_start, bq, kv_start, bk) if masked else None
        # Lines 9-10: online softmax; O_i = diag(exp(m_old - m_new)) O_i + P_ij V_j.
        p, alpha, m_i, l_i = sm.online_softmax(pre, m_i, l_i, logits, visible, kernel.exp2)
        v_j = pk.load_tile(v_ref, b, h_kv, kv_start, bk, dims.kv_len, dims.head_dim_v, ragged=masked)
        pv = kernel.masked_dot(p, v_j, visible)
        return acc * alpha[:, None] + pv, m_i, l_i

    carry = (
        jnp.zeros((bq, dims.head_dim_v_p), jnp.float32),
        jnp.full((bq,), -jnp.inf, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
    )
    for span in spec.kv_spans(t, bq, bk):
        carry = lax.fori_loop(span.start, span.stop, functools.partial(body, span.masked), carry)
    # Lines 12-13: normalise once; L_i = m_i + log(l_i).
    out, lse = sm.finalize(*carry)
    pk.store_tile(o_ref, b, h, q_start, out, dims.q_len, dims.head_dim_v)
    pk.store_row_stat(lse_ref, b, h, q_start, lse, dims.q_len)


def _forward(inputs: Inputs, config: Config):
    tuning = _tuning(inputs, config)
    kernel = pk.Kernel.create(inputs, config, tuning.forward, _WIDEST)
    dims = kernel.dims
    out, lse = pk.launch(
        functools.partial(_forward_kernel, kernel=kernel),
        num_programs=kernel.tiles.num_q_tiles(dims) * dims.batch * dims.num_heads,
        inputs=[inputs.q, inputs.k, inputs.v, *pk.runtime_inputs(inputs)],
        outputs=[
            jax.ShapeDtypeStruct((dims.batch, dims.q_len, dims.num_heads, dims.head_dim_v), inputs.q.dtype),
            jax.ShapeDtypeStruct((dims.batch, dims.num_heads, dims.q_len), jnp.float32),
        ],
        tuning=tuning.forward,
        config=config,
        name="jaxtile_fa2_forward",
    )
    return out, lse, lse


def _dkdv_kernel(*refs, kernel: pk.Kernel):
    """Algorithm 2, lines 6-18, for one (key tile, batch, kv head), transposed."""
    (q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref), runtime, (dk_ref, dv_ref) = pk.split_refs(
        refs, 6, kernel.config.mask
    )
    spec, logits, dims = kernel.config.mask, kernel.config.logits, kernel.dims
    bq, bk = kernel.tiles.block_q, kernel.tiles.block_k
    j, b, h_kv = pk.program_ids(kernel.tiles.num_kv_tiles(dims), dims.num_kv_heads, heaviest_first=False)
    kv_start = j * bk
    ragged_kv = dims.kv_len % bk != 0
    # Lines 6-7: load K_j, V_j; dK_j = dV_j = 0.
    k_j = pk.load_tile(k_ref, b, h_kv, kv_start, bk, dims.kv_len, dims.head_dim, ragged=ragged_kv)
    v_j = pk.load_tile(v_ref, b, h_kv, kv_start, bk, dims.kv_len, dims.head_dim_v, ragged=ragged_kv)
    ragged_q = dims.q_len % bq != 0

    def body(h, masked, i, carry):
        dk_j, dv_j = carry
        q_start = i * bq
        # Lines 8-11: load Q_i and L_i (rows past q_len: zeros and L = +inf);
        # Sᵀ = K_j Q_iᵀ, Pᵀ = exp(Sᵀ - L_i).
        q_i = pk.load_tile(q_ref, b, h, q_start, bq, dims.q_len, dims.head_dim, ragged=ragged_q)
        qk_t = kernel.dot(k_j, q_i, trans_b=True)
        pre_t = logits.pre(qk_t)
        visible = runtime.visible(spec, b, h, q_start, bq, kv_start, bk, transposed=True) if masked else None
        lse2 = pk.load_row_stat(lse2_ref, b, h, q_start, bq, dims.q_len, jnp.inf)
        p_t = sm.probabilities(pre_t, lse2[None, :], logits, visible, kernel.exp2)
        # Line 12: load dO_i; dV_j += Pᵀ dO_i.
        do_i = pk.load_tile(do_ref, b, h, q_start, bq, dims.q_len, dims.head_dim_v, ragged=ragged_q)
        dv_j += kernel.dot(p_t.astype(do_i.dtype), do_i)
        # Lines 13-14: dPᵀ = V_j dO_iᵀ, dSᵀ = Pᵀ ∘ (dPᵀ - D_i).
        dp_t = kernel.dot(v_j, do_i, trans_b=True)
        delta = pk.load_row_stat(delta_ref, b, h, q_start, bq, dims.q_len, 0.0)
        ds_t = sm.score_grad(p_t, dp_t, delta[None, :], pre_t, logits, visible)
        # Line 16: dK_j += dSᵀ Q_i.
        dk_j += kernel.ds_dot(ds_t, q_i, visible)
        return dk_j, dv_j

    def one_head(g, carry):
        h = h_kv * dims.group + g
        for span in spec.q_spans(j, bq, bk):
            carry = lax.fori_loop(span.start, span.stop, functools.partial(body, h, span.masked), carry)
        return carry

    carry = (jnp.zeros((bk, dims.head_dim_p), jnp.float32), jnp.zeros((bk, dims.head_dim_v_p), jnp.float32))
    dk_j, dv_j = lax.fori_loop(0, dims.group, one_head, carry)
    # Line 18: write dK_j, dV_j.
    pk.store_tile(dk_ref, b, h_kv, kv_start, dk_j, dims.kv_len, dims.head_dim)
    pk.store_tile(dv_ref, b, h_kv, kv_start, dv_j, dims.kv_len, dims.head_dim_v)


def _dq_kernel(*refs, kernel: pk.Kernel):
    """Algorithm 2, line 15, for one (query tile, batch, head): dQ_i = Σ_j dS_ij K_j."""
    (q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref), runtime, (dq_ref,) = pk.split_refs(refs, 6, kernel.config.mask)
    spec, logits, dims = kernel.config.mask, kernel.config.logits, kernel.dims
    bq, bk = kernel.tiles.block_q, kernel.tiles.block_k
    t, b, h = pk.program_ids(kernel.tiles.num_q_tiles(dims), dims.num_heads, heaviest_first=spec.right is not None)
    h_kv = lax.div(h, dims.group)
    q_start = t * bq
    ragged_q = dims.q_len % bq != 0
    q_i = pk.load_tile(q_ref, b, h, q_start, bq, dims.q_len, dims.head_dim, ragged=ragged_q)
    do_i = pk.load_tile(do_ref, b, h, q_start, bq, dims.q_len, dims.head_dim_v, ragged=ragged_q)
    lse2 = pk.load_row_stat(lse2_ref, b, h, q_start, bq, dims.q_len, jnp.inf)
    delta = pk.load_row_stat(delta_ref, b, h, q_start, bq, dims.q_len, 0.0)

    def body(masked, j, dq_i):
        kv_start = j * bk
        k_j = pk.load_tile(k_ref, b, h_kv, kv_start, bk, dims.kv_len, dims.head_dim, ragged=masked)
        qk = kernel.dot(q_i, k_j, trans_b=True)
        pre = logits.pre(qk)
        visible = runtime.visible(spec, b, h, q_start, bq, kv_start, bk) if masked else None
        p = sm.probabilities(pre, lse2[:, None], logits, visible, kernel.exp2)
        v_j = pk.load_tile(v_ref, b, h_kv, kv_start, bk, dims.kv_len, dims.head_dim_v, ragged=masked)
        dp = kernel.dot(do_i, v_j, trans_b=True)
        ds = sm.score_grad(p, dp, delta[:, None], pre, logits, visible)
        return dq_i + kernel.ds_dot(ds, k_j, visible)

    dq_i = jnp.zeros((bq, dims.head_dim_p), jnp.float32)
    for span in spec.kv_spans(t, bq, bk):
        dq_i = lax.fori_loop(span.start, span.stop, functools.partial(body, span.masked), dq_i)
    pk.store_tile(dq_ref, b, h, q_start, dq_i, dims.q_len, dims.head_dim)


def _backward(inputs: Inputs, out, lse, dout, dlse, config: Config):
    """Algorithm 2 as a dK/dV kernel and a dQ kernel; returns ``(dq, dk, dv)``."""
    tuning = _tuning(inputs, config)
    # Line 4: D_i = rowsum(dO_i ∘ O_i), minus the lse cotangent; lse in base 2.
    delta = jnp.swapaxes(jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1), 1, 2) - dlse
    lse2 = sm.lse_base2(lse)
    operands = [inputs.q, inputs.k, inputs.v, dout, lse2, delta, *pk.runtime_inputs(inputs)]

    kdkv = pk.Kernel.create(inputs, config, tuning.dkdv, _WIDEST)
    dims = kdkv.dims
    dk, dv = pk.launch(
        functools.partial(_dkdv_kernel, kernel=kdkv),
        num_programs=kdkv.tiles.num_kv_tiles(dims) * dims.batch * dims.num_kv_heads,
        inputs=operands,
        outputs=[
            jax.ShapeDtypeStruct(inputs.k.shape, inputs.k.dtype),
            jax.ShapeDtypeStruct(inputs.v.shape, inputs.v.dtype),
        ],
        tuning=tuning.dkdv,
        config=config,
        name="jaxtile_fa2_dkdv",
    )
    kdq = pk.Kernel.create(inputs, config, tuning.dq, _WIDEST)
    (dq,) = pk.launch(
        functools.partial(_dq_kernel, kernel=kdq),
        num_programs=kdq.tiles.num_q_tiles(dims) * dims.batch * dims.num_heads,
        inputs=operands,
        outputs=[jax.ShapeDtypeStruct(inputs.q.shape, inputs.q.dtype)],
        tuning=tuning.dq,
        config=config,
        name="jaxtile_fa2_dq",
    )
    return dq, dk, dv


attention = differentiable(_forward, _backward)
