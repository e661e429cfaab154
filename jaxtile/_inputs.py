"""Validation and canonicalisation of ``flash_attention``'s arguments.

Everything here runs on shapes, dtypes and Python values only, so bad input fails with a
message that names the offending values before any device work, under ``jit`` too.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtile._core import AUTOTUNE, Config, Inputs
from jaxtile._softmax import Logits
from jaxtile.mask import MaskSpec

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _is_traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


_KINDS = {"bool": (bool, np.bool_), "int": numbers.Integral, "float": numbers.Real}
_ARRAY_KINDS = {"bool": "b", "int": "iu", "float": "iuf"}  # numpy dtype kinds a 0-d array may have


def check_static(name: str, value: Any, what: str) -> Any:
    """Static options must be Python or NumPy scalars of the right kind, or concrete 0-d
    arrays holding one (``1 / jnp.sqrt(d)`` outside ``jit``), never traced; returns the
    value as a Python scalar."""
    if _is_traced(value):
        raise TypeError(f"{name} must be a static Python {what}, not a traced value (mark it static under jit)")
    if isinstance(value, (jax.Array, np.ndarray)) and value.shape == () and value.dtype.kind in _ARRAY_KINDS[what]:
        value = value.item()
    is_bool = isinstance(value, (bool, np.bool_))
    if not isinstance(value, _KINDS[what]) or (is_bool and what != "bool"):
        raise TypeError(f"{name} must be a Python {what}; got {value!r} of type {type(value).__name__}")
    return {"bool": bool, "int": int, "float": float}[what](value)


def _array(name: str, x: Any) -> Any:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array; got {type(x).__name__}")
    return x


def _check_qkv(query, key, value) -> None:
    for name, x in (("query", query), ("key", key), ("value", value)):
        _array(name, x)
        if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
            raise TypeError(f"{name}.dtype={jnp.dtype(x.dtype)} is not supported; use float32, bfloat16 or float16")
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(f"query, key and value must share a dtype; got {query.dtype=}, {key.dtype=}, {value.dtype=}")
    if query.ndim < 3:
        raise ValueError(f"query must be [batch..., q_len, num_heads, head_dim]; got {query.shape=}")
    if not query.ndim == key.ndim == value.ndim:
        raise ValueError(
            f"query, key and value must have the same rank; got {query.shape=}, {key.shape=}, {value.shape=}"
        )
    if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
        raise ValueError(
            f"batch dimensions differ: query {query.shape[:-3]}, key {key.shape[:-3]}, value {value.shape[:-3]}"
        )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"head_dim of query and key differ: {query.shape=}, {key.shape=}")
    if key.shape[-3] != value.shape[-3]:
        raise ValueError(f"key and value have different kv_len: {key.shape=}, {value.shape=}")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"key and value have different num_kv_heads: {key.shape=}, {value.shape=}")
    if 0 in query.shape[-3:] or 0 in key.shape[-3:] or 0 in value.shape[-3:]:
        raise ValueError(
            f"lengths, heads and head dims must be positive; got {query.shape=}, {key.shape=}, {value.shape=}"
        )
    num_heads, num_kv_heads = query.shape[-2], key.shape[-2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} is not a multiple of {num_kv_heads=}")


def _check_devices(arrays: dict[str, Any]) -> None:
    """Concrete committed arrays must all live on the same devices; traced ones are the
    enclosing transformation's concern, uncommitted ones follow the others."""
    placed = {
        name: x.sharding.device_set
        for name, x in arrays.items()
        if isinstance(x, jax.Array) and not _is_traced(x) and x.committed
    }
    if len(set(map(frozenset, placed.values()))) > 1:
        where = ", ".join(f"{name} on {sorted(devices, key=lambda d: d.id)}" for name, devices in placed.items())
        raise ValueError(f"the arrays must be committed to the same devices; got {where}")


def _check_window(window) -> tuple[int | None, int | None] | None:
    if window is None:
        return None
    if _is_traced(window) or getattr(window, "shape", None) == () or isinstance(window, numbers.Integral):
        pair = (window, window)
    else:
        pair = window
    if not (isinstance(pair, Sequence) and len(pair) == 2):
        raise TypeError(f"window must be an int, a (left, right) pair or None; got {window!r}")
    sides = tuple(None if side is None else check_static("window", side, "int") for side in pair)
    if any(side is not None and side < 0 for side in sides):
        raise ValueError(f"window sides must be non-negative; got {window=}")
    return sides


def _check_segment_ids(segment_ids, batch: tuple[int, ...], q_len: int, kv_len: int):
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError(f"segment_ids must be one array or a (q_ids, kv_ids) pair; got {len(segment_ids)} items")
        q_ids, kv_ids = segment_ids
    else:
        if q_len != kv_len:
            raise ValueError(
                f"a single segment_ids array needs q_len == kv_len (got {q_len=}, {kv_len=}); "
                "pass (q_segment_ids, kv_segment_ids)"
            )
        q_ids = kv_ids = segment_ids
    for name, ids, n in (("query segment_ids", q_ids, q_len), ("key segment_ids", kv_ids, kv_len)):
        _array(name, ids)
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"{name} must have an integer dtype; got {ids.dtype}")
        if tuple(ids.shape) != (*batch, n):
            raise ValueError(f"{name} must have shape {(*batch, n)} ([batch..., len]); got {tuple(ids.shape)}")
    batch_size = math.prod(batch)
    return (
        jnp.reshape(q_ids, (batch_size, q_len)).astype(jnp.int32),
        jnp.reshape(kv_ids, (batch_size, kv_len)).astype(jnp.int32),
    )


def _scores_shaped(name: str, x, batch: tuple[int, ...], num_heads: int, q_len: int, kv_len: int):
    """``x`` broadcastable to ``[batch..., heads, q_len, kv_len]``, as ``[1|batch_size,
    1|heads, 1|q_len, 1|kv_len]``."""
    full = (*batch, num_heads, q_len, kv_len)
    if x.ndim > len(full) or any(m not in (1, f) for m, f in zip(x.shape[::-1], full[::-1])):
        raise ValueError(
            f"{name} of shape {tuple(x.shape)} does not broadcast to [batch..., heads, q_len, kv_len] = {full}"
        )
    x = jnp.reshape(x, (1,) * (len(full) - x.ndim) + tuple(x.shape))
    lead = x.shape[: len(batch)]
    if any(d != 1 for d in lead):
        x = jnp.broadcast_to(x, (*batch, *x.shape[len(batch) :]))
    batch_size = math.prod(batch) if any(d != 1 for d in lead) else 1
    return jnp.reshape(x, (batch_size, *x.shape[len(batch) :]))


def _check_mask(mask, batch: tuple[int, ...], num_heads: int, q_len: int, kv_len: int):
    if mask is None:
        return None
    _array("mask", mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(f"mask must be boolean (True = attend); got {mask.dtype}")
    return _scores_shaped("mask", mask, batch, num_heads, q_len, kv_len)


def _check_bias(bias, batch: tuple[int, ...], num_heads: int, q_len: int, kv_len: int):
    if bias is None:
        return None
    _array("bias", bias)
    if jnp.dtype(bias.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"bias.dtype={jnp.dtype(bias.dtype)} is not supported; use float32, bfloat16 or float16")
    return _scores_shaped("bias", bias, batch, num_heads, q_len, kv_len)


def check_lengths_array(name: str, lengths, batch: tuple[int, ...], limit: int, why: str = "") -> None:
    """Dtype and shape (``batch``); the values too (in ``[0, limit]``, ``why`` it is the
    limit) where they are concrete."""
    _array(name, lengths)
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype; got {lengths.dtype}")
    if tuple(lengths.shape) != batch:
        raise ValueError(f"{name} must have shape {batch} (the batch dimensions); got {tuple(lengths.shape)}")
    if not _is_traced(lengths):
        values = np.asarray(lengths)
        bad = (values < 0) | (values > limit)
        if bad.any():
            raise ValueError(f"{name} must lie in [0, {limit}]{why and f' ({why})'}; got {values[bad].tolist()[:8]}")


def _check_lengths(q_lengths, kv_lengths, batch: tuple[int, ...], q_len: int, kv_len: int):
    """``[batch_size, 2]`` int32 ``(q_length, kv_length)`` per sequence, or None. Concrete
    lengths outside ``[0, len]`` are an error; traced ones are clipped into it."""
    if q_lengths is None and kv_lengths is None:
        return None
    columns = []
    for name, lengths, n in (("q_lengths", q_lengths, q_len), ("kv_lengths", kv_lengths, kv_len)):
        if lengths is None:
            columns.append(jnp.full(batch, n, jnp.int32))
            continue
        check_lengths_array(name, lengths, batch, n)
        columns.append(jnp.clip(jnp.asarray(lengths).astype(jnp.int32), 0, n))
    return jnp.stack(columns, axis=-1).reshape(math.prod(batch), 2)


def check_sinks(sinks, num_heads: int):
    """``[num_heads]`` float32 sink logits, or None."""
    if sinks is None:
        return None
    _array("sinks", sinks)
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(f"sinks must have a floating dtype; got {sinks.dtype}")
    if tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks must have shape ({num_heads},) (one logit per query head); got {tuple(sinks.shape)}")
    return jnp.asarray(sinks, jnp.float32)


def _check_float(name: str, value, *, positive: bool) -> float | None:
    if value is None:
        return None
    value = check_static(name, value, "float")
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name} must be a finite{' positive' if positive else ''} float; got {name}={value}")
    return value


def check_block(name: str, block, *, power_of_two: bool) -> int | None:
    """Blocks are positive ints; Pallas kernels also need powers of two >= 16."""
    if block is None:
        return None
    block = check_static(name, block, "int")
    if block <= 0:
        raise ValueError(f"{name}={block} must be positive")
    if power_of_two and (block < 16 or block & (block - 1)):
        raise ValueError(f"{name}={block} must be a power of two >= 16 for the Pallas kernels")
    return block


def check_tuning(tuning, types: tuple[type, ...]) -> None:
    """``tuning`` is None, ``"autotune"`` or an instance of one of ``types`` (the tuning
    types of the registered implementations)."""
    if tuning is None or tuning == AUTOTUNE or isinstance(tuning, types):
        return
    names = " or ".join(f"{t.__module__}.{t.__name__}" for t in types)
    raise TypeError(f"tuning must be None, {AUTOTUNE!r} or a {names}; got {tuning!r}")


def _reshape(x, shape):
    """``jnp.reshape``, or the reshaped shape of a `jax.ShapeDtypeStruct` (keys and values
    that a paged cache holds, `jaxtile.paged_attention`)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(shape, x.dtype)
    return jnp.reshape(x, shape)


def canonicalize(
    query,
    key,
    value,
    *,
    causal: bool,
    window,
    segment_ids,
    mask,
    logits_soft_cap,
    q_lengths=None,
    kv_lengths=None,
    bias=None,
    scale,
    block_q,
    block_k,
    tuning,
    tuning_types: tuple[type, ...],
    platform: str,
    top_left: bool = False,
) -> tuple[Inputs, Config, tuple[int, ...]]:
    """Validates the public arguments; returns canonical inputs, config and batch shape.
    ``top_left`` aligns positions as `MaskSpec.top_left` says."""
    _check_qkv(query, key, value)
    if isinstance(segment_ids, (tuple, list)):
        ids = dict(zip(("q_segment_ids", "kv_segment_ids"), segment_ids))
    else:
        ids = {"segment_ids": segment_ids}
    lengths = {"q_lengths": q_lengths, "kv_lengths": kv_lengths}
    _check_devices({"query": query, "key": key, "value": value, "mask": mask, "bias": bias, **ids, **lengths})
    causal = check_static("causal", causal, "bool")
    check_tuning(tuning, tuning_types)
    window = _check_window(window)
    batch = tuple(query.shape[:-3])
    q_len, num_heads, head_dim = query.shape[-3:]
    kv_len, num_kv_heads = key.shape[-3], key.shape[-2]
    q_ids, kv_ids = _check_segment_ids(segment_ids, batch, q_len, kv_len)
    dense = _check_mask(mask, batch, num_heads, q_len, kv_len)
    bias = _check_bias(bias, batch, num_heads, q_len, kv_len)
    lengths = _check_lengths(q_lengths, kv_lengths, batch, q_len, kv_len)
    soft_cap = _check_float("logits_soft_cap", logits_soft_cap, positive=True)
    scale = _check_float("scale", scale, positive=False)
    spec = MaskSpec.create(
        q_len,
        kv_len,
        causal=causal,
        window=window,
        has_segments=q_ids is not None,
        has_dense_mask=dense is not None,
        has_lengths=lengths is not None,
        top_left=top_left,
    )
    logits = Logits(1.0 / math.sqrt(head_dim) if scale is None else scale, soft_cap, bias=bias is not None)
    batch_size = math.prod(batch)
    inputs = Inputs(
        jnp.reshape(query, (batch_size, q_len, num_heads, head_dim)),
        _reshape(key, (batch_size, kv_len, num_kv_heads, head_dim)),
        _reshape(value, (batch_size, kv_len, num_kv_heads, value.shape[-1])),
        q_ids,
        kv_ids,
        dense,
        lengths,
        bias,
    )
    return inputs, Config(spec, logits, block_q, block_k, tuning, platform), batch
