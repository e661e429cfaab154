"""Naive attention in PyTorch, written from ``shared/API.md`` and nothing else.

It materialises the scores, repeats kv heads for GQA, builds the mask from positions
directly, and computes in float64 (on whatever device the tensors are on). It shares no
code with jaxtile, so agreement between the two means something.
"""

from __future__ import annotations

import math

import torch


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: int | tuple[int | None, int | None] | None = None,
    q_segment_ids: torch.Tensor | None = None,
    kv_segment_ids: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    q_lengths: torch.Tensor | None = None,
    kv_lengths: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[batch..., T, H, D]``, k ``[batch..., S, Hkv, D]``, v ``[batch..., S, Hkv, Dv]``.

    Returns ``out [batch..., T, H, Dv]`` and ``lse [batch..., H, T]`` in float64; rows
    that see no key give 0 and ``-inf``. ``mask`` is True = attend and broadcasts to
    ``[batch..., H, T, S]``. ``q_lengths``/``kv_lengths`` ``[batch...]``: queries and keys
    past them are padding, and query ``i`` of a sequence sits at position ``i + kv_length
    - q_length``. ``sinks [H]``: one more logit per row of head ``h``, in the softmax
    but with no value (so rows that see no key get 0 and the sink as lse). ``bias``
    broadcasts to ``[batch..., H, T, S]`` and is added to the scaled scores, before the
    soft cap. Differentiable with torch autograd.
    """
    q, k, v = (x.to(torch.float64) for x in (q, k, v))
    q_len, num_heads, head_dim = q.shape[-3:]
    kv_len, num_kv_heads = k.shape[-3], k.shape[-2]
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=-2)
    v = v.repeat_interleave(group, dim=-2)

    scores = torch.einsum("...thd,...shd->...hts", q, k)
    scores = scores * (1.0 / math.sqrt(head_dim) if scale is None else scale)
    if bias is not None:
        scores = scores + bias.to(torch.float64)
    if logits_soft_cap is not None:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)

    device = q.device
    row = torch.arange(q_len, device=device)[:, None]
    pos_k = torch.arange(kv_len, device=device)[None, :]
    if q_lengths is None and kv_lengths is None:
        pos_q = row + (kv_len - q_len)
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    else:
        batch = q.shape[:-3]
        q_lengths = torch.full(batch, q_len, device=device) if q_lengths is None else q_lengths
        kv_lengths = torch.full(batch, kv_len, device=device) if kv_lengths is None else kv_lengths
        q_lengths, kv_lengths = q_lengths[..., None, None, None], kv_lengths[..., None, None, None]
        pos_q = row + (kv_lengths - q_lengths)  # [batch..., 1, T, 1]
        allowed = (row < q_lengths) & (pos_k < kv_lengths)
    if causal:
        allowed = allowed & (pos_k <= pos_q)
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        if left is not None:
            allowed = allowed & (pos_k >= pos_q - left)
        if right is not None:
            allowed = allowed & (pos_k <= pos_q + right)
    allowed = allowed.expand(*scores.shape)
    if q_segment_ids is not None:
        same = q_segment_ids[..., :, None] == kv_segment_ids[..., None, :]
        allowed = allowed & same.unsqueeze(-3)
    if mask is not None:
        allowed = allowed & mask

    scores = scores.masked_fill(~allowed, -math.inf)
    if sinks is not None:  # a last column of logits whose value is zero
        sink = sinks.to(torch.float64)[:, None, None].expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
        v = torch.cat([v, torch.zeros_like(v[..., :1, :, :])], dim=-3)
    row_max = scores.amax(dim=-1, keepdim=True)
    empty = torch.isinf(row_max)
    weights = torch.exp(scores - torch.where(empty, 0.0, row_max))
    total = weights.sum(dim=-1, keepdim=True)
    probs = weights / torch.where(empty, 1.0, total)
    out = torch.einsum("...hts,...shd->...thd", probs, v)
    lse = torch.where(empty, -math.inf, row_max + torch.log(torch.where(empty, 1.0, total)))
    return out, lse.squeeze(-1)
