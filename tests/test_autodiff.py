"""Derivatives past the first reverse-mode one: second derivatives (``grad`` of ``grad``,
Hessian-vector products) and forward mode (``jvp``, ``jacfwd``), against the float64
PyTorch reference (`parity.reference`, sharing no code with jaxtile) under torch autograd.

Records that are ``jax_differentiable`` must give them, under every kind of mask;
the others (Pallas kernels, opaque to JAX) must refuse with `registry.Unsupported`
naming the implementations that can, and first derivatives must be unaffected.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxtile
from jaxtile import registry
from parity import reference
from parity.compare import TOLERANCES, compare

TOL = TOLERANCES["float32"]
BATCH, LEN, HEADS, KV_HEADS, DIM = 2, 40, 4, 2, 16
IDS = np.repeat(np.arange(4), 10)[None].repeat(BATCH, 0)

# Each kind of mask, so that the loops over every tile meet masked and empty tiles.
OPTIONS = {
    "causal_gqa": dict(causal=True),
    "window": dict(window=(7, 2)),
    "segments_soft_cap": dict(segment_ids=jnp.asarray(IDS, jnp.int32), logits_soft_cap=4.0),
    "lengths_sinks": dict(  # causal, so that the queries' positions (kv_len - q_len + i) matter
        causal=True,
        kv_lengths=jnp.array([33, 20]),
        q_lengths=jnp.array([40, 9]),
        sinks=jnp.array([0.5, -1.0, 2.0, 0.0]),
    ),
    "dense_mask_bias": dict(
        mask=jnp.asarray(np.random.default_rng(3).random((BATCH, 1, LEN, LEN)) < 0.6),
        bias=jnp.asarray(np.random.default_rng(4).standard_normal((HEADS, LEN, LEN)), jnp.float32),
    ),
}


def _arrays(seed: int = 0):
    rng = np.random.default_rng(seed)
    shapes = ((BATCH, LEN, HEADS, DIM), (BATCH, LEN, KV_HEADS, DIM), (BATCH, LEN, KV_HEADS, DIM))
    return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes)


def _attention(implementation: str, options: dict):
    return functools.partial(jaxtile.flash_attention, implementation=implementation, block_q=16, block_k=16, **options)


def _tensor(x) -> torch.Tensor:
    """A JAX array as a torch tensor, floats in float64 (as `parity.run.torch_reference`)."""
    x = np.asarray(x)
    return torch.tensor(x.astype(np.float64) if x.dtype.kind == "f" else x)


def _torch_attention(options: dict):
    """`parity.reference.attention`'s output under ``flash_attention``'s ``options`` (the
    same names, but one array of segment ids for queries and keys)."""
    options = {name: _tensor(x) if isinstance(x, jax.Array) else x for name, x in options.items()}
    if "segment_ids" in options:
        options["q_segment_ids"] = options["kv_segment_ids"] = options.pop("segment_ids")
    return lambda q, k, v: reference.attention(q, k, v, **options)[0]


@functools.cache
def _expected(mask: str) -> dict[str, list[np.ndarray]]:
    """What `_second_derivatives` and `_forward_mode` compute, from the float64 reference
    under reverse mode only: the gradient of the gradient's norm, the Hessian-vector
    product as the gradient of ``<grad, tangents>``, and the jvp tangent as the gradient
    of ``<vjp(u), tangents>`` with respect to the cotangent ``u``."""
    attention = _torch_attention(OPTIONS[mask])
    primals = [_tensor(x).requires_grad_() for x in _arrays()]
    tangents = [_tensor(x) for x in _arrays(seed=1)]

    def grad(y, xs, cotangent=None):
        return torch.autograd.grad(y, xs, cotangent, retain_graph=True, create_graph=True)

    def dot(xs, ys):
        return sum((x * y).sum() for x, y in zip(xs, ys))

    out = attention(*primals)
    grads = grad(torch.sin(out).sum(), primals)
    u = torch.zeros_like(out, requires_grad=True)
    values = dict(
        second=grad(dot(grads, grads), primals),
        out=[out],
        tangent=grad(dot(grad(out, primals, u), tangents), [u]),
        hvp=grad(dot(grads, tangents), primals),
    )
    return {name: [x.detach().numpy() for x in xs] for name, xs in values.items()}


def _close(got, expected, what: str):
    for name, x, ref in zip(("q", "k", "v"), jax.tree.leaves(got), expected):
        error = compare(np.asarray(x), ref, TOL)
        assert error.ok, f"{what} ({name}): {error}"


def _second_derivatives(attention, q, k, v):
    """The gradient of a function of the first gradient: reverse over reverse."""

    def loss(q, k, v):
        return jnp.sum(jnp.sin(attention(q, k, v)))

    def gradient_norm(q, k, v):
        return sum(jnp.sum(g**2) for g in jax.grad(loss, argnums=(0, 1, 2))(q, k, v))

    return jax.grad(gradient_norm, argnums=(0, 1, 2))(q, k, v)


def _forward_mode(attention, q, k, v):
    """``jvp`` outputs and tangents, and a Hessian-vector product (forward over reverse)."""
    tangents = _arrays(seed=1)
    out, tangent = jax.jvp(attention, (q, k, v), tangents)

    def loss(q, k, v):
        return jnp.sum(jnp.sin(attention(q, k, v)))

    _, hvp = jax.jvp(jax.grad(loss, argnums=(0, 1, 2)), (q, k, v), tangents)
    return out, tangent, hvp


def _able() -> str:
    return re.escape(str([i.name for i in registry.implementations() if i.jax_differentiable]))


def _skip_unless_it_takes_the_call(impl, mask: str):
    if "float32" not in impl.dtypes:
        pytest.skip(f"{impl.name} takes no float32")
    if impl.max_q_len is not None and impl.max_q_len < LEN:
        pytest.skip(f"{impl.name} takes at most {impl.max_q_len} queries")
    if "bias" in OPTIONS[mask] and "bias" not in impl.features:
        pytest.skip(f"{impl.name} takes no bias")


@pytest.mark.parametrize("mask", OPTIONS)
def test_second_derivatives_match_reference(impl, mask):
    _skip_unless_it_takes_the_call(impl, mask)
    args = _arrays()
    if not impl.jax_differentiable:
        with pytest.raises(
            registry.Unsupported, match=f"second derivatives and forward-mode autodiff need one of {_able()}"
        ):
            _second_derivatives(_attention(impl.name, OPTIONS[mask]), *args)
        return
    got = _second_derivatives(_attention(impl.name, OPTIONS[mask]), *args)
    _close(got, _expected(mask)["second"], f"{impl.name} grad of grad, {mask}")


@pytest.mark.parametrize("mask", OPTIONS)
def test_forward_mode_matches_reference(impl, mask):
    _skip_unless_it_takes_the_call(impl, mask)
    args = _arrays()
    if not impl.jax_differentiable:
        with pytest.raises(registry.Unsupported, match="forward-mode autodiff needs passes JAX differentiates"):
            _forward_mode(_attention(impl.name, OPTIONS[mask]), *args)
        return
    out, tangent, hvp = _forward_mode(_attention(impl.name, OPTIONS[mask]), *args)
    expected = _expected(mask)
    for name, x in (("out", out), ("tangent", tangent)):
        error = compare(np.asarray(x), expected[name][0], TOL)
        assert error.ok, f"{impl.name} jvp {name}, {mask}: {error}"
    _close(hvp, expected["hvp"], f"{impl.name} Hessian-vector product, {mask}")


def test_jacfwd_and_batched_jvp_choose_a_differentiable_implementation():
    # implementation=None under forward mode takes the fastest jax_differentiable record.
    q, k, v = (x[:1, :8, :2] for x in _arrays())
    attention = functools.partial(jaxtile.flash_attention, causal=True)
    jac = jax.jacfwd(lambda q: attention(q, k[:, :, :1], v[:, :, :1]))(q)
    reference_attention = _torch_attention(dict(causal=True))
    kv = [_tensor(x[:, :, :1]) for x in (k, v)]
    expected = torch.autograd.functional.jacobian(lambda q: reference_attention(q, *kv), _tensor(q))
    assert compare(np.asarray(jac), expected.numpy(), TOL).ok
    tangents = jnp.stack([q, 2 * q, -q])
    batched = jax.vmap(lambda t: jax.jvp(lambda q: attention(q, k, v), (q,), (t,))[1])(tangents)
    one = jax.jvp(lambda q: attention(q, k, v), (q,), (q,))[1]
    assert compare(np.asarray(batched[1]), 2 * np.asarray(one), TOL).ok


def test_first_derivatives_unchanged_by_second_order_support(impl):
    # grad inside vmap and jit, as before: the first derivative is the custom backward.
    _skip_unless_it_takes_the_call(impl, "causal_gqa")
    q, k, v = _arrays()
    attention = _attention(impl.name, dict(causal=True))
    loss = lambda q, k, v: jnp.sum(attention(q, k, v) ** 2)  # noqa: E731
    got = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q[:, None], k[:, None], v[:, None])
    primals = [_tensor(x).requires_grad_() for x in (q, k, v)]
    expected = torch.autograd.grad((_torch_attention(dict(causal=True))(*primals) ** 2).sum(), primals)
    _close([g[:, 0] for g in got], [g.numpy() for g in expected], f"{impl.name} vmap(grad)")
