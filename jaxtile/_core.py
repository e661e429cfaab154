"""What every implementation receives, and how its backward pass is attached.

The public API validates and canonicalises the user's arguments into `Inputs` (arrays)
and `Config` (static, hashable). An implementation is a ``forward`` and a recomputing
``backward`` over those; `differentiable` joins them into one ``jax.custom_vjp`` that
saves only the inputs, the output and the softmax statistics.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from jaxtile._softmax import Logits
from jaxtile.mask import MaskSpec


class Inputs(NamedTuple):
    """Canonical arrays: one batch dimension, sequence before heads.

    q: ``[batch, q_len, num_heads, head_dim]``
    k: ``[batch, kv_len, num_kv_heads, head_dim]``
    v: ``[batch, kv_len, num_kv_heads, head_dim_v]``
    q_segment_ids: ``[batch, q_len]`` int32, or None.
    kv_segment_ids: ``[batch, kv_len]`` int32, or None.
    mask: bool ``[1|batch, 1|num_heads, 1|q_len, 1|kv_len]`` (True = attend), or None.
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    q_segment_ids: jax.Array | None = None
    kv_segment_ids: jax.Array | None = None
    mask: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Config:
    """Static configuration of one attention call.

    ``block_q``/``block_k`` of None let the implementation choose. ``tuning`` holds the
    Pallas kernels' launch parameters (a `jaxtile.tuning.Tuning`, ``"autotune"``, or None
    for the table). ``platform`` is where the arrays live (``"gpu"``, ``"cpu"``, ...);
    Pallas kernels interpret elsewhere.
    """

    mask: MaskSpec
    logits: Logits
    block_q: int | None = None
    block_k: int | None = None
    tuning: Any = None
    platform: str = "cpu"


# forward(inputs, config) -> (out, lse, stats); stats is what backward needs besides out.
Forward = Callable[[Inputs, Config], tuple[jax.Array, jax.Array, Any]]
# backward(inputs, out, stats, dout, dlse, config) -> (dq, dk, dv)
Backward = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]
Attention = Callable[[Inputs, Config], tuple[jax.Array, jax.Array]]


def differentiable(forward: Forward, backward: Backward) -> Attention:
    """Returns ``attention(inputs, config) -> (out, lse)`` with a recomputing VJP.

    ``out`` is ``[batch, q_len, num_heads, head_dim_v]`` in the query dtype, ``lse`` is
    ``[batch, num_heads, q_len]`` float32. The backward pass receives the cotangent of
    ``lse`` too, so ``return_lse=True`` outputs are differentiable.
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
    def attention(inputs: Inputs, config: Config):
        out, lse, _ = forward(inputs, config)
        return out, lse

    def attention_fwd(inputs: Inputs, config: Config):
        out, lse, stats = forward(inputs, config)
        return (out, lse), (inputs, out, stats)

    def attention_bwd(config: Config, residuals, cotangents):
        inputs, out, stats = residuals
        dout, dlse = cotangents
        dq, dk, dv = backward(inputs, out, stats, dout, dlse, config)
        return (Inputs(dq, dk, dv, None, None, None),)

    attention.defvjp(attention_fwd, attention_bwd)
    return attention
