"""Second opinions: PyTorch's and JAX's own attention, on the cases they can express.

The oracle stays ``parity.reference`` (float64). A second opinion runs in the case's dtype;
the suite reports its error against the oracle (a check of the oracle and of the mapping
below) and whether jaxtile agrees with it. Each one runs only where its semantics can be
made exactly jaxtile's, and names the reason where they cannot:

* ``torch.sdpa`` (``torch.nn.functional.scaled_dot_product_attention``, layout
  ``[B, H, T, D]``): ``is_causal`` is top-left aligned, so it is used only for
  ``q_len == kv_len``, and ``torch.nn.attention.bias.causal_lower_right`` (jaxtile's
  bottom-right alignment) otherwise. Neither combines with ``attn_mask``, so a causal
  case with a mask, segments or a bias passes its causal mask as a lower triangle of the
  ``attn_mask`` instead (``numpy.tri`` with offset ``kv_len - q_len``). The boolean
  ``attn_mask`` is True = attend, like jaxtile's; segment ids become one; a bias becomes
  a float ``attn_mask``, ``-inf`` where the boolean one is False. GQA through
  ``enable_gqa``. No windows, no soft cap.
* ``jax.nn.dpa`` (``jax.nn.dot_product_attention(implementation="xla")``, jaxtile's
  layout): its causal mask and ``local_window_size`` are top-left aligned, i.e. query
  ``i`` sits at position ``i``. jaxtile puts it at ``i + d`` (``d = kv_len - q_len``), so a
  window ``(left, right)`` is passed as ``(left - d, right + d)``, which needs both sides
  non-negative. ``mask`` is True = attend; ``bias`` is its own; GQA is native; the lse comes from
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
from parity.entries import jax_nn_masking
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
    if problem.has_empty_rows:
        return "a fully masked row is not 0 there"
    return None


def _flat(problem: Problem) -> dict[str, np.ndarray | None]:
    """q, k, v, dout with the batch dims flattened into one ``B``, the case's mask and
    segment ids as one boolean mask ``[B, H|1, T|1, S]`` (True = attend), and its bias as
    ``[B|1, H|1, T, S]``; each None where the case has none."""
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
    bias = arrays["bias"]
    if bias is not None:
        bias = bias[None, None] if bias.ndim == 2 else bias.reshape(batch, *bias.shape[-3:])
    flat["bias"] = bias
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
    has_attn_mask = case.mask is not None or case.segments or case.bias is not None
    if case.causal and case.q_len != case.kv and case.kv_heads != case.num_heads and not has_attn_mask:
        return "causal_lower_right does not pass enable_gqa to every backend"
    return None


def _torch_mask(case: Case, flat: dict[str, np.ndarray | None]) -> np.ndarray | None:
    """The case's ``attn_mask``, ``[B|1, H|1, T|1, S]``, from its `_flat` arrays: boolean
    (True = attend), float with a bias (``-inf`` where not attended), or None where
    ``is_causal`` or ``causal_lower_right`` alone express the masking."""
    allowed, bias = flat["mask"], flat["bias"]
    if allowed is None and bias is None:
        return None
    if case.causal:
        below = np.tri(case.q_len, case.kv, case.kv - case.q_len, dtype=bool)  # bottom-right aligned
        allowed = below if allowed is None else allowed & below
    if bias is None:
        return allowed
    return bias if allowed is None else np.where(allowed, bias, -np.inf).astype(bias.dtype)


def _torch_run(problem: Problem, device: str) -> dict[str, np.ndarray]:
    case, flat = problem.case, _flat(problem)
    dtype = TORCH_DTYPES[case.dtype]

    def tensor(x, grad=False):  # exactly the case's values
        return torch.tensor(np.asarray(x, np.float32), device=device).to(dtype).requires_grad_(grad)

    q, k, v = (tensor(flat[name], True) for name in ("q", "k", "v"))  # [B, len, heads, dim]
    mask = _torch_mask(case, flat)
    if mask is None:
        attn_mask = None if case.q_len == case.kv or not case.causal else causal_lower_right(case.q_len, case.kv)
    elif mask.dtype == bool:
        attn_mask = torch.tensor(mask, device=device)
    else:
        attn_mask = tensor(mask, True)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=attn_mask,
        is_causal=case.causal and case.q_len == case.kv and mask is None,
        scale=case.scale,
        enable_gqa=case.kv_heads != case.num_heads,
    ).transpose(1, 2)
    out.backward(tensor(flat["dout"]))
    values = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    values = _unflat(case, {name: x.detach().to(torch.float64).cpu().numpy() for name, x in values.items()})
    if flat["bias"] is not None:  # the float mask's gradient is the bias's where it attends, else 0
        dmask = attn_mask.grad.to(torch.float64).cpu().numpy()
        values["dbias"] = _bias_shaped(problem, flat["bias"].shape, dmask)
    return values


def _bias_shaped(problem: Problem, flat_shape: tuple[int, ...], dbias: np.ndarray) -> np.ndarray:
    """``dbias`` (the flat bias's shape ``[B|1, H|1, T, S]``, or broadcast wider) summed to
    the case's bias shape."""
    wide = tuple(i for i, (n, m) in enumerate(zip(flat_shape, dbias.shape)) if n == 1 and m > 1)
    return dbias.sum(wide, keepdims=True).reshape(problem.arrays["bias"].shape)


def _jax_unsupported(problem: Problem) -> str | None:
    case = problem.case
    if reason := _unsupported_by_both(problem):
        return reason
    if case.dim_v != case.head_dim:
        return "value and key head dims must be equal"
    if case.dtype == "float16" and jax.default_backend() == "cpu":
        return "its float16 dot algorithm (F16_F16_F32) does not compile on CPU"
    if jax_nn_masking(case.causal, case.window, case.q_len, case.kv) is None:
        return "bottom-right window is not a top-left local_window_size"
    return None


def _jax_run(problem: Problem, device: str) -> dict[str, np.ndarray]:
    del device  # JAX runs where jaxtile does
    case, flat = problem.case, _flat(problem)
    is_causal, window = jax_nn_masking(case.causal, case.window, case.q_len, case.kv)

    def attend(q, k, v, mask, bias):
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            bias=bias,
            mask=mask,
            scale=case.scale,
            is_causal=is_causal,
            local_window_size=window,
            implementation="xla",
            return_residual=True,
        )

    @jax.jit
    def run(q, k, v, bias, dout, mask):
        (out, lse), vjp = jax.vjp(lambda q, k, v, bias: attend(q, k, v, mask, bias), q, k, v, bias)
        return (out, jnp.swapaxes(lse, 1, 2), *vjp((dout, jnp.zeros_like(lse))))

    q, k, v, dout = (jnp.asarray(flat[name]) for name in ("q", "k", "v", "dout"))
    mask, bias = (None if flat[name] is None else jnp.asarray(flat[name]) for name in ("mask", "bias"))
    with jax.default_matmul_precision("highest"):
        values = jax.block_until_ready(run(q, k, v, bias, dout, mask))
    out, lse, dq, dk, dv, dbias = (None if x is None else np.asarray(x.astype(jnp.float32), np.float64) for x in values)
    values = _unflat(case, {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv})
    if dbias is not None:
        values["dbias"] = _bias_shaped(problem, flat["bias"].shape, dbias)
    return values


TORCH_SDPA = SecondOpinion("torch.sdpa", _torch_unsupported, _torch_run)
JAX_DPA = SecondOpinion("jax.nn.dpa", _jax_unsupported, _jax_run)
SECOND_OPINIONS = (TORCH_SDPA, JAX_DPA)
