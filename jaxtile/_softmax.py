"""Softmax arithmetic on one tile of scores, shared by every tiled implementation.

Scores live in base 2 (``exp2`` with the scale folded in, as the Triton kernels do):
the natural logits are ``s = q·k * scale`` (or ``cap * tanh(q·k * scale / cap)`` with a
soft cap), and we work with ``s2 = s * log2(e) = factor * pre(q·k)``. ``factor`` is kept
positive so that a row maximum of ``pre`` is a row maximum of ``s2``, and the scale
multiplies into the subtraction of the running max as one fused multiply-add.

Rows where no key is visible keep ``m_i = -inf`` and ``l_i = 0``; they produce an output
of 0 and an lse of ``-inf``, and the backward pass turns that lse into ``+inf`` so their
probabilities are exactly 0. No NaN is ever formed.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
_F32_TINY = 2.0**-126


@dataclasses.dataclass(frozen=True)
class Logits:
    """How a raw score ``q·k`` (and a tile of the additive bias, when ``bias``) becomes
    a base-2 logit: ``s2 = factor * pre(q·k, bias)``."""

    scale: float
    soft_cap: float | None = None
    bias: bool = False

    @property
    def _plain(self) -> bool:
        # The scale folds into exp2 only without a bias, and while scale·log2(e) stays a
        # normal float32 (otherwise masked scores would become -inf · 0 = NaN).
        return self.soft_cap is None and not self.bias and self.scale * LOG2E >= _F32_TINY

    @property
    def factor(self) -> float:
        return self.scale * LOG2E if self._plain else LOG2E

    def pre(self, qk, bias=None):
        """The part of the logit that is not a positive constant factor; ``bias``
        broadcasts against ``qk`` (None when the call has none)."""
        if self._plain:
            return qk
        if bias is not None:
            logit = qk * self.scale + bias
            return logit if self.soft_cap is None else self.soft_cap * jnp.tanh(logit / self.soft_cap)
        if self.soft_cap is None:
            return qk * self.scale
        return self.soft_cap * jnp.tanh(qk * (self.scale / self.soft_cap))

    def logit_grad(self, ds, pre):
        """Chain rule from dL/ds (natural logits) back to dL/d(scale·q·k + bias), the
        gradient of the bias, given ``pre``."""
        if self.soft_cap is None:
            return ds
        return ds * (1.0 - jnp.square(pre / self.soft_cap))

    def grad(self, ds, pre):
        """Chain rule from dL/ds (natural logits) back to dL/d(q·k), given ``pre``."""
        if self.soft_cap is None:
            return ds * self.scale
        return ds * (self.scale * (1.0 - jnp.square(pre / self.soft_cap)))


def online_softmax(pre, m_prev, l_prev, logits: Logits, visible=None, exp2=jnp.exp2):
    """One step of the online softmax (FlashAttention-2, Algorithm 1, lines 8-10).

    Args:
      pre: ``[..., rows, cols]`` float32, ``logits.pre`` of one tile of scores.
      m_prev, l_prev: ``[..., rows]`` running max (base 2) and running sum.
      visible: optional bool ``[..., rows, cols]``; masked scores are dropped.
      exp2: the base-2 exponential to use (kernels pass a faster hardware one).
    Returns:
      ``(p, alpha, m_new, l_new)``: unnormalised probabilities ``exp2(s2 - m_new)``,
      the factor ``exp2(m_prev - m_new)`` that rescales the old accumulator, and the
      updated statistics.
    """
    if visible is not None:
        pre = jnp.where(visible, pre, -jnp.inf)
    m_new = jnp.maximum(m_prev, jnp.max(pre, axis=-1) * logits.factor)
    # Only a masked tile (or a bias of -inf) can leave a row with no finite score so far.
    m_base = m_new if visible is None and not logits.bias else jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = exp2(pre * logits.factor - m_base[..., None])
    alpha = exp2(m_prev - m_base)
    l_new = alpha * l_prev + jnp.sum(p, axis=-1)
    return p, alpha, m_new, l_new


def log_sum_exp(m, l):
    """The natural-log lse ``(m + log2 l) · ln 2`` of base-2 statistics ``[..., rows]``;
    ``-inf`` on rows with no visible key (``l = 0``)."""
    empty = l == 0.0
    return jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) * LN2)


def finalize(acc, m, l):
    """Deferred normalisation (Algorithm 1, lines 12-13): ``out = acc / l``, lse.

    ``acc`` is ``[..., rows, head_dim_v]``; ``m``, ``l`` are ``[..., rows]``. Returns the
    float32 output and the natural-log lse, 0 and ``-inf`` on rows with no visible key.
    """
    out = acc / jnp.where(l == 0.0, 1.0, l)[..., None]
    return out, log_sum_exp(m, l)


def tile_softmax(pre, logits: Logits, visible=None, exp2=jnp.exp2):
    """The softmax statistics of one tile on its own (FlashAttention-1, Algorithm 1, line 10).

    Args:
      pre: ``[..., rows, cols]`` float32, ``logits.pre`` of one tile of scores.
      visible: optional bool ``[..., rows, cols]``; masked scores are dropped.
    Returns:
      ``(p, m_tile, l_tile)``: ``P~ = exp2(s2 - m~)``, ``m~ = rowmax(s2)`` and
      ``l~ = rowsum(P~)``; a row that sees no key of the tile has ``m~ = -inf``,
      ``P~ = 0`` and ``l~ = 0``.
    """
    if visible is not None:
        pre = jnp.where(visible, pre, -jnp.inf)
    m_tile = jnp.max(pre, axis=-1) * logits.factor
    m_base = jnp.where(m_tile == -jnp.inf, 0.0, m_tile)
    p = exp2(pre * logits.factor - m_base[..., None])
    return p, m_tile, jnp.sum(p, axis=-1)


def rescaled_update(o_prev, m_prev, l_prev, pv, m_tile, l_tile, exp2=jnp.exp2):
    """Merges one tile into a normalised output (FlashAttention-1, Algorithm 1, lines 11-12).

    ``m_new = max(m, m~)``, ``l_new = 2^(m - m_new) l + 2^(m~ - m_new) l~`` and
    ``O_new = diag(l_new)^-1 (diag(l) 2^(m - m_new) O + 2^(m~ - m_new) P~V)``.

    Args:
      o_prev: ``[..., rows, head_dim_v]`` float32, the output normalised so far.
      m_prev, l_prev: ``[..., rows]`` its statistics (base 2).
      pv: ``[..., rows, head_dim_v]`` float32, ``P~ V`` of the tile.
      m_tile, l_tile: ``[..., rows]`` from `tile_softmax`.
    Returns:
      ``(o_new, m_new, l_new)``; rows that have seen no key yet stay at 0, ``-inf``, 0.
    """
    m_new = jnp.maximum(m_prev, m_tile)
    m_base = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = exp2(m_prev - m_base)
    beta = exp2(m_tile - m_base)
    l_new = alpha * l_prev + beta * l_tile
    o_new = (alpha * l_prev)[..., None] * o_prev + beta[..., None] * pv
    return o_new / jnp.where(l_new == 0.0, 1.0, l_new)[..., None], m_new, l_new


def lse_base2(lse):
    """The lse as the backward pass consumes it: base 2, ``+inf`` on empty rows."""
    return jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)


def stats_base2(m, l):
    """FlashAttention-1's ``(m, l)`` as its backward pass consumes them: ``(m, 1 / l)``,
    with ``m = +inf`` and ``1 / l = 0`` on empty rows so their probabilities are 0.
    ``P = probabilities(pre, m, ..., inv_l=1 / l)`` then (Algorithm 4, line 13)."""
    empty = l == 0.0
    return jnp.where(empty, jnp.inf, m), jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))


def probabilities(pre, lse2, logits: Logits, visible=None, exp2=jnp.exp2, inv_l=None):
    """Recomputed probabilities ``P = exp2(s2 - lse2)`` (Algorithm 2, line 11), or
    FlashAttention-1's ``P = diag(l)^-1 exp2(s2 - m)`` given ``lse2 = m`` and ``inv_l``
    (Algorithm 4, line 13; `stats_base2`).

    ``lse2`` and ``inv_l`` broadcast against ``pre``: ``[..., rows, 1]``, or ``[1, rows]``
    for kernels that form the scores transposed. Masked entries are 0 even on rows whose
    statistics are NaN.
    """
    p = exp2(pre * logits.factor - lse2)
    if inv_l is not None:
        p = p * inv_l
    if visible is not None:
        p = jnp.where(visible, p, 0.0)
    return p


def masked_dot(dot, p, v, visible=None):
    """``dot(p, v)``, the product ``P V`` of a tile whose masked probabilities are 0, as if
    the masked entries were absent: a NaN or Inf in row ``j`` of ``v`` reaches exactly the
    rows ``i`` with ``visible[i, j]`` (a plain product's ``0 · NaN`` reaches every row).

    ``dot`` contracts the key axis of ``p`` (and of ``visible``, same shape or broadcasting
    to it) with the rows of ``v`` into float32. Non-finite entries of ``v`` enter the
    product as 0; two exact products of 0/±1 matrices then count, per output entry, the
    non-finite values its row sees and the sum of the signs of the infinite ones: all
    infinities of one sign give ±inf, anything else NaN. ``visible=None`` (a tile with no
    masked entry) is the plain product.
    """
    if visible is None:
        return dot(p, v)
    finite = jnp.abs(v) < jnp.inf  # False for ±inf and NaN
    product = dot(p, jnp.where(finite, v, 0))
    seen = jnp.broadcast_to(visible, p.shape).astype(jnp.bfloat16)
    count = dot(seen, jnp.where(finite, 0.0, 1.0).astype(jnp.bfloat16))
    sign = dot(seen, jnp.where(v == jnp.inf, 1.0, jnp.where(v == -jnp.inf, -1.0, 0.0)).astype(jnp.bfloat16))
    special = jnp.where(count == jnp.abs(sign), sign * jnp.inf, jnp.nan).astype(product.dtype)
    return jnp.where(count > 0, special, product)


def masked_tile_dot(dot, p, v, visible=None):
    """`masked_dot` for one tile of a loop: the plain product when the tile's ``v`` is
    finite (nearly always), the contained one otherwise, chosen by ``lax.cond`` so that
    only a tile holding a non-finite value pays for the extra products."""
    if visible is None:
        return dot(p, v)
    return lax.cond(jnp.all(jnp.abs(v) < jnp.inf), dot, functools.partial(masked_dot, dot, visible=visible), p, v)


def score_grad(p, dp, delta, pre, logits: Logits, visible=None, *, of_logit: bool = False):
    """``dS = P * (dP - D)`` (Algorithm 2, line 14) taken back to dL/d(q·k), or with
    ``of_logit`` to dL/d(scale·q·k + bias) (`Logits.logit_grad`, the bias's gradient).

    ``delta`` is ``D = rowsum(dO * O)`` minus the lse cotangent, broadcast like the lse
    in `probabilities`. Masked entries (``visible`` False) are exactly 0 even where a
    hidden value made ``dP`` non-finite.
    """
    chain = logits.logit_grad if of_logit else logits.grad
    ds = chain(p * (dp - delta), pre)
    return ds if visible is None else jnp.where(visible, ds, 0.0)


def merge(out, lse):
    """Attentions of the same queries over disjoint sets of keys, as one over their union
    (the partial results of ring attention's steps, or of split-KV decoding's splits).

    Args:
      out: ``[parts, b, n, h, dv]``, each part normalised over its own keys.
      lse: ``[parts, b, h, n]`` (natural log); ``-inf`` for a part that saw no key.
    Returns:
      ``out [b, n, h, dv]`` float32, the parts weighted by ``exp(lse_part - lse)``, and
      ``lse [b, h, n]``, their log-sum-exp; 0 and ``-inf`` where no part saw a key.
    """
    peak = jnp.max(lse, axis=0, keepdims=True)
    base = jnp.where(peak == -jnp.inf, 0.0, peak)
    weight = jnp.exp(lse - base)
    total = jnp.sum(weight, axis=0, keepdims=True)
    empty = total == 0.0
    weight = jnp.swapaxes(weight / jnp.where(empty, 1.0, total), -1, -2)[..., None]
    merged = jnp.sum(out.astype(jnp.float32) * weight, axis=0)
    return merged, jnp.where(empty, -jnp.inf, base + jnp.log(jnp.where(empty, 1.0, total)))[0]


@jax.jit
def with_sinks(out, lse, sinks):
    """Attention with one more logit per query head in every row's softmax denominator,
    contributing no value (learnable attention sinks, as in gpt-oss): a `merge` with a
    part whose output is 0 and whose lse is the sink. Differentiable in all three.

    Args:
      out: ``[b, n, h, dv]``; lse: ``[b, h, n]`` (``-inf`` for a row that saw no key).
      sinks: ``[h]`` float32 (``-inf``: no sink for that head).
    Returns:
      ``out`` (its dtype) and ``lse`` over the keys and the sink; a row that sees no
      key keeps output 0.
    """
    sink = jnp.broadcast_to(sinks[None, :, None], lse.shape)
    merged, lse = merge(jnp.stack([out, jnp.zeros_like(out)]), jnp.stack([lse, sink]))
    return merged.astype(out.dtype), lse
