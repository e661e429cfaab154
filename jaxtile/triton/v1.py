"""``implementation="pallas_v1"``: FlashAttention-1's loop order as Pallas kernels.

Dao et al. (2022), Algorithm 1 (forward) and Algorithm 4 (backward); comments cite
their line numbers, as in `jaxtile.scan.v1`, so the kernels read next to
`jaxtile.triton.v2`.

**One program per (batch, head)** — per kv head in the backward pass, which then loops
over the query heads of its group. FlashAttention-1 puts key/value tiles in the outer
loop, so every outer step rescales and rewrites the running output ``O_i``, ``m_i`` and
``l_i`` of every query tile in HBM (lines 8-13). Splitting key tiles across programs would
make those read-modify-writes race, and atomics cannot express the rescaling (it is not
an addition); the dQ accumulation of the backward pass could be done with atomic adds,
but not deterministically. So a program owns all of one head's rows: deterministic, no
atomics, and parallel only over batch × heads — the limitation FlashAttention-2 removed
by swapping the loops, which the benchmark shows. Between a program's write of a row
tile and its next read of it, a barrier orders the two across the program's threads.

The running ``O`` and ``dQ`` live in float32 HBM buffers (the paper keeps ``O`` in the
input dtype; repeated rounding at every outer step would cost accuracy for nothing here),
cast to the input dtype at the end.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxtile import _softmax as sm
from jaxtile import registry
from jaxtile._core import Config, Inputs, Shape
from jaxtile.triton import _kernel as pk
from jaxtile.triton import tuning as tn

# FlashAttention-1 holds O_i in registers next to S_ij; smaller tiles than FA2's.
_DEFAULT = tn.KernelTuning(64, 64, 4, 2)
_DEFAULT_WIDE = tn.KernelTuning(32, 32, 4, 1)  # head dims above 128, or float32
# What each kernel keeps in shared memory (`pk.Staging`): K_j, V_j for the outer step; Q_i
# and the float32 O_i (two tiles' worth) per inner step, and dO_i, dQ_i backward.
_FORWARD = pk.Staging(resident=(("k", "d"), ("k", "v")), streamed=(("q", "d"), ("q", "v"), ("q", "v")))
_BACKWARD = pk.Staging(
    resident=(("k", "d"), ("k", "v")),
    streamed=(("q", "d"), ("q", "v"), ("q", "v"), ("q", "d"), ("q", "d")),
    staged=(("q", "k"),),
    copies=2,
)


def _tuning(inputs: Inputs, config: Config) -> tuple[tn.KernelTuning, tn.KernelTuning]:
    """(forward, backward) launch parameters: the user's ``tuning.forward`` and
    ``tuning.dkdv``, or the defaults above; ``block_q``/``block_k`` override tiles."""
    if isinstance(config.tuning, tn.Tuning):
        forward, backward = config.tuning.forward, config.tuning.dkdv
    else:
        dims = Shape.of(inputs.q, inputs.k, inputs.v)
        wide = pk.next_pow2(max(dims.head_dim, dims.head_dim_v)) > 128 or jnp.dtype(inputs.q.dtype).itemsize > 2
        forward = backward = _DEFAULT_WIDE if wide else _DEFAULT
    tuning = tn.Tuning(forward, backward, backward).with_blocks(config.block_q, config.block_k)
    return tuning.forward, tuning.dkdv


def _forward_kernel(*refs, kernel: pk.Kernel):
    """Algorithm 1 for one (batch, head)."""
    (q_ref, k_ref, v_ref), runtime, (o_ref, m_ref, l_ref) = pk.split_refs(refs, 3, kernel.config)
    spec, logits, dims = kernel.config.mask, kernel.config.logits, kernel.dims
    bq, bk = kernel.tiles.block_q, kernel.tiles.block_k
    _, b, h = pk.program_ids(1, dims.num_heads, heaviest_first=False)
    h_kv = lax.div(h, np.int32(dims.group))
    ragged_q, ragged_kv = dims.q_len % bq != 0, dims.kv_len % bk != 0

    def init(i, carry):
        # Line 2: O = 0, l = 0, m = -inf, in HBM.
        pk.store_tile(
            o_ref, b, h, i * bq, jnp.zeros((bq, kernel.head_dim_v_p), jnp.float32), dims.q_len, dims.head_dim_v
        )
        pk.store_row_stat(m_ref, b, h, i * bq, jnp.full((bq,), -jnp.inf, jnp.float32), dims.q_len)
        pk.store_row_stat(l_ref, b, h, i * bq, jnp.zeros((bq,), jnp.float32), dims.q_len)
        return carry

    def q_step(masked, kv_start, k_j, v_j, i, carry):
        q_start = i * bq
        # Line 8: load Q_i, O_i, l_i, m_i.
        q_i = pk.load_tile(q_ref, b, h, q_start, bq, dims.q_len, dims.head_dim, ragged=ragged_q)
        o_i = pk.load_tile(o_ref, b, h, q_start, bq, dims.q_len, dims.head_dim_v, ragged=ragged_q)
        m_i = pk.load_row_stat(m_ref, b, h, q_start, bq, dims.q_len, -jnp.inf)
        l_i = pk.load_row_stat(l_ref, b, h, q_start, bq, dims.q_len, 0.0)
        # Line 9: S_ij = Q_i K_jᵀ (the scale is folded into the exponentials), plus the bias.
        bias = runtime.bias_tile(spec, b, h, q_start, kernel.tiles, kv_start, bk)
        pre = logits.pre(kernel.dot(q_i, k_j, trans_b=True), bias)
        visible = runtime.visible(spec, b, h, q_start, kernel.tiles, kv_start, bk) if masked else None
        # Line 10: m~_ij, P~_ij = exp(S_ij - m~_ij), l~_ij.
        p, m_ij, l_ij = sm.tile_softmax(pre, logits, visible, kernel.exp2)
        contained = None
        if masked:
            contained = pk.Contained(
                row=lambda c: pk.load_tile(v_ref, b, h_kv, kv_start + c, 1, dims.kv_len, dims.head_dim_v, ragged=True),
                seen=lambda c: runtime.visible(spec, b, h, q_start, kernel.tiles, kv_start + c, 1),
                count=bk,
            )
        pv = kernel.accumulate(jnp.zeros_like(o_i), p, v_j, contained)
        # Lines 11-12: m_new, l_new; O_i <- diag(l_new)^-1 (diag(l_i) e^(m_i - m_new) O_i + e^(m~ - m_new) P~ V_j).
        o_i, m_i, l_i = sm.rescaled_update(o_i, m_i, l_i, pv, m_ij, l_ij, kernel.exp2)
        # Lines 12-13: write O_i, l_i, m_i back to HBM.
        pk.store_tile(o_ref, b, h, q_start, o_i, dims.q_len, dims.head_dim_v)
        pk.store_row_stat(m_ref, b, h, q_start, m_i, dims.q_len)
        pk.store_row_stat(l_ref, b, h, q_start, l_i, dims.q_len)
        kernel.barrier()
        return carry

    def kv_step(j, carry):
        # Lines 5-6: load K_j, V_j.
        kv_start = j * bk
        k_j = pk.load_tile(k_ref, b, h_kv, kv_start, bk, dims.kv_len, dims.head_dim, ragged=ragged_kv)
        v_j = pk.load_tile(v_ref, b, h_kv, kv_start, bk, dims.kv_len, dims.head_dim_v, ragged=ragged_kv)
        # Line 7: the query tiles that can see K_j.
        for span in runtime.spans(spec, b, h, j, True, bq, bk):
            body = functools.partial(q_step, span.masked, kv_start, k_j, v_j)
            carry = pk.fori_loop(span.start, span.stop, body, carry)
        return carry

    pk.fori_loop(0, kernel.tiles.num_q_tiles(dims), init, 0)
    kernel.barrier()
    pk.fori_loop(0, kernel.tiles.num_kv_tiles(dims), kv_step, 0)


def _forward(inputs: Inputs, config: Config):
    forward, _ = _tuning(inputs, config)
    kernel = pk.Kernel.create(inputs, config, forward, _FORWARD)
    dims = kernel.dims
    stat = jax.ShapeDtypeStruct((dims.batch, dims.num_heads, dims.q_len), jnp.float32)
    out, m, l = pk.launch(
        _forward_kernel,
        kernel,
        num_programs=dims.batch * dims.num_heads,
        inputs=[
            inputs.q,
            inputs.k,
            inputs.v,
            *pk.runtime_inputs(inputs),
            *pk.tile_bounds(inputs, config.mask, kernel.tiles.block_q, kernel.tiles.block_k, transposed=True),
        ],
        outputs=[
            jax.ShapeDtypeStruct((dims.batch, dims.q_len, dims.num_heads, dims.head_dim_v), jnp.float32),
            stat,
            stat,
        ],
        name="jaxtile_fa1_forward",
    )
    return out.astype(inputs.q.dtype), sm.log_sum_exp(m, l), (m, l)


def _backward_kernel(*refs, kernel: pk.Kernel):
    """Algorithm 4 for one (batch, kv head) and the query heads of its group."""
    (q_ref, k_ref, v_ref, o_ref, do_ref, m_ref, inv_l_ref, dlse_ref), runtime, outputs = pk.split_refs(
        refs, 8, kernel.config
    )
    dq_ref, dk_ref, dv_ref, *dbias = outputs  # the bias's gradient, with a bias
    spec, logits, dims = kernel.config.mask, kernel.config.logits, kernel.dims
    bq, bk = kernel.tiles.block_q, kernel.tiles.block_k
    _, b, h_kv = pk.program_ids(1, dims.num_kv_heads, heaviest_first=False)
    ragged_q, ragged_kv = dims.q_len % bq != 0, dims.kv_len % bk != 0
    one_row = dataclasses.replace(kernel.tiles, block_q=1)

    def init(n, carry):
        # Line 5: dQ = 0, in HBM (one row tile of one head of the group per step).
        num_q_tiles = np.int32(kernel.tiles.num_q_tiles(dims))
        g, i = lax.div(n, num_q_tiles), lax.rem(n, num_q_tiles)
        zeros = jnp.zeros((bq, kernel.head_dim_p), jnp.float32)
        pk.store_tile(dq_ref, b, h_kv * dims.group + g, i * bq, zeros, dims.q_len, dims.head_dim)
        if dbias:  # and the bias's gradient, which stays 0 on the tiles the mask hides
            h = h_kv * dims.group + g
            pk.zero_scores_tiles(dbias[0], b, h, i * bq, 0, kernel.tiles.num_kv_tiles(dims), bq, bk, spec)
        return carry

    def q_step(h, masked, kv_start, k_j, v_j, i, carry):
        dk_j, dv_j = carry
        q_start = i * bq
        # Line 10: load Q_i, O_i, dO_i, dQ_i, l_i, m_i (rows past q_len: zeros, m = +inf).
        q_i = pk.load_tile(q_ref, b, h, q_start, bq, dims.q_len, dims.head_dim, ragged=ragged_q)
        o_i = pk.load_tile(o_ref, b, h, q_start, bq, dims.q_len, dims.head_dim_v, ragged=ragged_q)
        do_i = pk.load_tile(do_ref, b, h, q_start, bq, dims.q_len, dims.head_dim_v, ragged=ragged_q)
        m_i = pk.load_row_stat(m_ref, b, h, q_start, bq, dims.q_len, jnp.inf)
        inv_l_i = pk.load_row_stat(inv_l_ref, b, h, q_start, bq, dims.q_len, 0.0)
        # Lines 11-13: S_ij = τ Q_i K_jᵀ (plus the bias), masked; P_ij = diag(l_i)^-1 exp(S_ij - m_i).
        bias = runtime.bias_tile(spec, b, h, q_start, kernel.tiles, kv_start, bk)
        pre = logits.pre(kernel.dot(q_i, k_j, trans_b=True), bias)
        visible = runtime.visible(spec, b, h, q_start, kernel.tiles, kv_start, bk) if masked else None
        p = sm.probabilities(pre, m_i[:, None], logits, visible, kernel.exp2, inv_l_i[:, None])
        # Line 16: dV_j += P_ijᵀ dO_i.
        dv_j = kernel.accumulate(dv_j, p, do_i, trans_a=True)
        # Lines 17-20: dP_ij = dO_i V_jᵀ; D_i = rowsum(dO_i ∘ O_i); dS_ij = P_ij ∘ (dP_ij - D_i).
        dp = kernel.dot(do_i, v_j, trans_b=True)
        dlse = pk.load_row_stat(dlse_ref, b, h, q_start, bq, dims.q_len, 0.0)
        d_i = jnp.sum(do_i.astype(jnp.float32) * o_i.astype(jnp.float32), axis=-1) - dlse
        store_bias_grad = None
        if dbias:
            store_bias_grad = functools.partial(pk.store_scores_tile, dbias[0], b, h, q_start, kv_start, spec=spec)
        ds = pk.score_grad(p, dp, d_i[:, None], pre, logits, visible, store_bias_grad)
        # Line 21: dQ_i += dS_ij K_j, read and written back to HBM.
        by_key = by_query = None
        if masked:
            by_key = pk.Contained(
                row=lambda c: pk.load_tile(k_ref, b, h_kv, kv_start + c, 1, dims.kv_len, dims.head_dim, ragged=True),
                seen=lambda c: runtime.visible(spec, b, h, q_start, kernel.tiles, kv_start + c, 1),
                count=bk,
            )
            by_query = pk.Contained(
                row=lambda c: pk.load_tile(q_ref, b, h, q_start + c, 1, dims.q_len, dims.head_dim, ragged=True),
                seen=lambda c: runtime.visible(spec, b, h, q_start + c, one_row, kv_start, bk, transposed=True),
                count=bq,
            )
        dq_i = pk.load_tile(dq_ref, b, h, q_start, bq, dims.q_len, dims.head_dim, ragged=ragged_q)
        dq_i = kernel.accumulate(dq_i, ds, k_j, by_key, unbounded=True)
        pk.store_tile(dq_ref, b, h, q_start, dq_i, dims.q_len, dims.head_dim)
        kernel.barrier()
        # Line 22: dK_j += dS_ijᵀ Q_i.
        return kernel.accumulate(dk_j, ds, q_i, by_query, trans_a=True, unbounded=True), dv_j

    def kv_step(j, carry):
        # Lines 6-8: load K_j, V_j; dK_j = dV_j = 0.
        kv_start = j * bk
        k_j = pk.load_tile(k_ref, b, h_kv, kv_start, bk, dims.kv_len, dims.head_dim, ragged=ragged_kv)
        v_j = pk.load_tile(v_ref, b, h_kv, kv_start, bk, dims.kv_len, dims.head_dim_v, ragged=ragged_kv)

        def one_head(g, acc):
            # Line 9, for each query head of the group: the query tiles that see K_j.
            h = h_kv * dims.group + g
            for span in runtime.spans(spec, b, h, j, True, bq, bk):
                body = functools.partial(q_step, h, span.masked, kv_start, k_j, v_j)
                acc = pk.fori_loop(span.start, span.stop, body, acc)
            return acc

        zeros = (jnp.zeros((bk, kernel.head_dim_p), jnp.float32), jnp.zeros((bk, kernel.head_dim_v_p), jnp.float32))
        dk_j, dv_j = pk.fori_loop(0, dims.group, one_head, zeros)
        # Line 24: write dK_j, dV_j.
        pk.store_tile(dk_ref, b, h_kv, kv_start, dk_j, dims.kv_len, dims.head_dim)
        pk.store_tile(dv_ref, b, h_kv, kv_start, dv_j, dims.kv_len, dims.head_dim_v)
        return carry

    pk.fori_loop(0, dims.group * kernel.tiles.num_q_tiles(dims), init, 0)
    kernel.barrier()
    pk.fori_loop(0, kernel.tiles.num_kv_tiles(dims), kv_step, 0)


def _backward(inputs: Inputs, out, stats, dout, dlse, config: Config):
    """Algorithm 4 in one kernel; returns ``(dq, dk, dv, dbias)`` (`_core.Backward`)."""
    _, backward = _tuning(inputs, config)
    kernel = pk.Kernel.create(inputs, config, backward, _BACKWARD)
    dims = kernel.dims
    m, inv_l = sm.stats_base2(*stats)
    dq, dk, dv, *dbias = pk.launch(
        _backward_kernel,
        kernel,
        num_programs=dims.batch * dims.num_kv_heads,
        inputs=[
            inputs.q,
            inputs.k,
            inputs.v,
            out,
            dout,
            m,
            inv_l,
            dlse,
            *pk.runtime_inputs(inputs),
            *pk.tile_bounds(inputs, config.mask, kernel.tiles.block_q, kernel.tiles.block_k, transposed=True),
        ],
        outputs=[
            jax.ShapeDtypeStruct(inputs.q.shape, jnp.float32),
            jax.ShapeDtypeStruct(inputs.k.shape, inputs.k.dtype),
            jax.ShapeDtypeStruct(inputs.v.shape, inputs.v.dtype),
            *pk.scores_grad(inputs, dims),
        ],
        name="jaxtile_fa1_backward",
    )
    return dq.astype(inputs.q.dtype), dk, dv, dbias[0] if dbias else None


IMPLEMENTATION = registry.register(
    registry.Implementation(
        name="pallas_v1",
        summary="FlashAttention-1 as Pallas/Triton kernels, one program per batch × head",
        family="triton",
        algorithm="FlashAttention-1",
        forward=_forward,
        backward=_backward,
        memory=lambda shape, block_q, block_k, backward: pk.memory(shape, fa1=True, backward=backward),
        platforms=frozenset({"gpu"}),
        interprets=frozenset({"cpu"}),
        max_head_dim=pk.MAX_HEAD_DIM,
        power_of_two_blocks=True,
        tuning=tn.Tuning,
        speed=10,
    )
)
