"""Second opinions: PyTorch's and JAX's own attention, on the cases they can express.

The oracle stays ``parity.reference`` (float64). A second opinion runs in the case's dtype;
the suite reports its error against the oracle (a check of the oracle and of the mapping
below) and whether jaxtile agrees with it. Each one runs only where its semantics can be
made exactly jaxtile's, and names the reason where they cannot:

* ``torch.sdpa`` (``torch.nn.functional.scaled_dot_product_attention``, layout
  ``[B, H, T, D]``): ``is_causal`` is top-left aligned, so it is used only for
  ``q_len == kv_len``, and ``torch.nn.attention.bias.causal_lower_right`` (jaxtile's
  bottom-right alignment) otherwise; neither can be combined with ``attn_mask``. The
  boolean ``attn_mask`` is True = attend, like jaxtile's; segment ids become one. GQA
  through ``enable_gqa``. No windows, no soft cap.
* ``jax.nn.dpa`` (``jax.nn.dot_product_attention(implementation="xla")``, jaxtile's
  layout): its causal mask and ``local_window_size`` are top-left aligned, i.e. query
  ``i`` sits at position ``i``. jaxtile puts it at ``i + d`` (``d = kv_len - q_len``), so a
  window ``(left, right)`` is passed as ``(left - d, right + d)``, which needs both sides
  non-negative. ``mask`` is True = attend; GQA is native; the lse comes from
  ``return_residual``. Value and key head dims must be equal. No soft cap; no float16
  on CPU. Float32 runs at ``"highest"`` matmul precision (no TF32).

Neither is used where a query sees no key (SDPA gives NaN, JAX an average of all values:
jaxtile defines 0) or where the lse has a cotangent (neither differentiates its lse).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.nn.attention.bias import causal_lower_right

from parity.case import Case
from parity.run import Problem

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True)
class SecondOpinion:
    """``unsupported(problem)`` is None or why the case cannot be expressed;
    ``run(problem, torch_device)`` returns float64 arrays of some of ``QUANTITIES``."""

    name: str
    unsupported: Callable[[Problem], str | None]
    run: Callable[[Problem, str], dict[str, np.ndarray]]


def _unsupported_by_both(problem: Problem) -> str | None:
    case = problem.case
    if case.logits_soft_cap is not None:
        return "no logits_soft_cap"
    if case.lse_grad:
        return "its lse (if any) is not differentiable"
    if case.lengths is not None:
        return "no per-sequence lengths with jaxtile's alignment"
    if case.sinks:
        return "no attention sinks"
    if case.bias is not None:
        return "the bias is not passed to it"
    if problem.has_empty_rows:
        return "a fully masked row is not 0 there"
    return None


def _flat(problem: Problem) -> dict[str, np.ndarray | None]:
    """q, k, v, dout with the batch dims flattened into one ``B``, and the case's mask and
    segment ids as one boolean mask ``[B, H|1, T|1, S]`` (True = attend), or None."""
    case, arrays = problem.case, problem.arrays
    batch = math.prod(case.batch)
    flat = {name: arrays[name].reshape(batch, *arrays[name].shape[-3:]) for name in ("q", "k", "v", "dout")}
    mask = None
    if arrays["mask"] is not None:
        mask = arrays["mask"].reshape(batch, *arrays["mask"].shape[-3:])
    if arrays["q_segment_ids"] is not None:
        q_ids = arrays["q_segment_ids"].reshape(batch, 1, case.q_len, 1)
        kv_ids = arrays["kv_segment_ids"].reshape(batch, 1, 1, case.kv)
        same = q_ids == kv_ids
        mask = same if mask is None else mask & same
    flat["mask"] = mask
    return flat


def _unflat(case: Case, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Restores the batch dims: ``[B, rest...] -> [batch..., rest...]``."""
    return {name: x.reshape(*case.batch, *x.shape[1:]) for name, x in values.items()}


def _torch_unsupported(problem: Problem) -> str | None:
    case = problem.case
    if reason := _unsupported_by_both(problem):
        return reason
    if case.window is not None:
        return "no sliding window"
    if case.causal and (case.mask is not None or case.segments):
        return "causal masking cannot be combined with attn_mask"
    if case.causal and case.q_len != case.kv and case.kv_heads != case.num_heads:
        return "causal_lower_right does not pass enable_gqa to every backend"
    return None


def _torch_run(problem: Problem, device: str) -> dict[str, np.ndarray]:
    case, flat = problem.case, _flat(problem)
    dtype = TORCH_DTYPES[case.dtype]

    def tensor(name, grad=False):  # [B, len, heads, dim], exactly the case's values
        return torch.tensor(flat[name].astype(np.float32), device=device).to(dtype).requires_grad_(grad)

    q, k, v = tensor("q", True), tensor("k", True), tensor("v", True)
    if not case.causal:
        attn_mask = None if flat["mask"] is None else torch.tensor(flat["mask"], device=device)
    elif case.q_len == case.kv:
        attn_mask = None
    else:
        attn_mask = causal_lower_right(case.q_len, case.kv)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=attn_mask,
        is_causal=case.causal and case.q_len == case.kv,
        scale=case.scale,
        enable_gqa=case.kv_heads != case.num_heads,
    ).transpose(1, 2)
    out.backward(tensor("dout"))
    values = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return _unflat(case, {name: x.detach().to(torch.float64).cpu().numpy() for name, x in values.items()})


def _jax_masking(case: Case) -> tuple[bool, tuple[int, int] | None] | None:
    """``(is_causal, local_window_size)`` for the case's causal and window masking, or
    None when a side of the window would be negative (see the module docstring)."""
    offset = case.kv - case.q_len
    is_causal = case.causal and offset == 0
    if case.window is None:
        left, right = None, None
    elif isinstance(case.window, int):
        left, right = case.window, case.window
    else:
        left, right = case.window
    if case.causal and not is_causal:
        right = 0 if right is None else min(right, 0)
    if left is None and right is None:
        return is_causal, None
    unbounded = case.q_len + case.kv
    window = (unbounded if left is None else left - offset, unbounded if right is None else right + offset)
    return (is_causal, window) if min(window) >= 0 else None


def _jax_unsupported(problem: Problem) -> str | None:
    case = problem.case
    if reason := _unsupported_by_both(problem):
        return reason
    if case.dim_v != case.head_dim:
        return "value and key head dims must be equal"
    if case.dtype == "float16" and jax.default_backend() == "cpu":
        return "its float16 dot algorithm (F16_F16_F32) does not compile on CPU"
    if _jax_masking(case) is None:
        return "bottom-right window is not a top-left local_window_size"
    return None


def _jax_run(problem: Problem, device: str) -> dict[str, np.ndarray]:
    del device  # JAX runs where jaxtile does
    case, flat = problem.case, _flat(problem)
    is_causal, window = _jax_masking(case)

    def attend(q, k, v, mask):
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            mask=mask,
            scale=case.scale,
            is_causal=is_causal,
            local_window_size=window,
            implementation="xla",
            return_residual=True,
        )

    @jax.jit
    def run(q, k, v, dout, mask):
        (out, lse), vjp = jax.vjp(lambda q, k, v: attend(q, k, v, mask), q, k, v)
        return (out, jnp.swapaxes(lse, 1, 2), *vjp((dout, jnp.zeros_like(lse))))

    q, k, v, dout = (jnp.asarray(flat[name]) for name in ("q", "k", "v", "dout"))
    mask = None if flat["mask"] is None else jnp.asarray(flat["mask"])
    with jax.default_matmul_precision("highest"):
        values = jax.block_until_ready(run(q, k, v, dout, mask))
    names = ("out", "lse", "dq", "dk", "dv")
    return _unflat(case, {name: np.asarray(x.astype(jnp.float32), np.float64) for name, x in zip(names, values)})


TORCH_SDPA = SecondOpinion("torch.sdpa", _torch_unsupported, _torch_run)
JAX_DPA = SecondOpinion("jax.nn.dpa", _jax_unsupported, _jax_run)
SECOND_OPINIONS = (TORCH_SDPA, JAX_DPA)
