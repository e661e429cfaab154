"""The public API: input validation, and composition with JAX transformations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtile

RNG = np.random.default_rng(0)


def _normal(*shape, dtype=jnp.float32):
    return jnp.asarray(RNG.standard_normal(shape), dtype)


Q = _normal(2, 16, 4, 8)
K = _normal(2, 24, 2, 8)
V = _normal(2, 24, 2, 8)

# (description, arguments, expected exception, text the message must contain)
BAD_INPUTS = [
    ("rank mismatch", dict(key=K[0]), ValueError, "same rank"),
    ("query rank < 3", dict(query=Q[0, 0], key=K[0, 0], value=V[0, 0]), ValueError, "query.shape=(4, 8)"),
    ("head_dim mismatch", dict(key=_normal(2, 24, 2, 6)), ValueError, "head_dim"),
    (
        "heads not a multiple",
        dict(key=_normal(2, 24, 3, 8), value=_normal(2, 24, 3, 8)),
        ValueError,
        "num_heads=4 is not a multiple of num_kv_heads=3",
    ),
    (
        "batch dims differ",
        dict(key=_normal(3, 24, 2, 8), value=_normal(3, 24, 2, 8)),
        ValueError,
        "batch dimensions differ",
    ),
    ("kv_len differs", dict(value=_normal(2, 20, 2, 8)), ValueError, "different kv_len"),
    ("kv heads differ", dict(value=_normal(2, 24, 1, 8)), ValueError, "different num_kv_heads"),
    ("negative window", dict(window=(-1, 3)), ValueError, "window=(-1, 3)"),
    ("window not a pair", dict(window=(1, 2, 3)), TypeError, "(1, 2, 3)"),
    (
        "segment ids wrong shape",
        dict(segment_ids=(jnp.zeros((2, 15), jnp.int32), jnp.zeros((2, 24), jnp.int32))),
        ValueError,
        "(2, 15)",
    ),
    ("segment ids float", dict(segment_ids=(jnp.zeros((2, 16)), jnp.zeros((2, 24)))), TypeError, "integer dtype"),
    (
        "single segment ids, q_len != kv_len",
        dict(segment_ids=jnp.zeros((2, 16), jnp.int32)),
        ValueError,
        "q_len=16, kv_len=24",
    ),
    ("mask not bool", dict(mask=jnp.ones((16, 24))), TypeError, "boolean"),
    ("mask does not broadcast", dict(mask=jnp.ones((16, 23), bool)), ValueError, "(16, 23)"),
    ("unknown implementation", dict(implementation="flash3"), ValueError, "'flash3'"),
    ("block not positive", dict(block_q=0), ValueError, "block_q=0"),
    ("block not power of two for pallas", dict(block_k=24, implementation="pallas_v2"), ValueError, "block_k=24"),
    ("mixed dtypes", dict(key=K.astype(jnp.bfloat16)), TypeError, "share a dtype"),
    ("integer inputs", dict(query=Q.astype(jnp.int32)), TypeError, "int32"),
    ("soft cap not positive", dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap=0.0"),
    ("scale not finite", dict(scale=float("inf")), ValueError, "scale=inf"),
    ("causal not a bool", dict(causal="yes"), TypeError, "causal"),
    ("zero length", dict(query=_normal(2, 0, 4, 8)), ValueError, "positive"),
]


@pytest.mark.parametrize("what,changes,error,text", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_clear_error(what, changes, error, text):
    args = dict(query=Q, key=K, value=V)
    args.update(changes)
    with pytest.raises(error) as info:
        jaxtile.flash_attention(args.pop("query"), args.pop("key"), args.pop("value"), **args)
    assert text in str(info.value), f"{what}: message {str(info.value)!r} lacks {text!r}"


def test_traced_static_option_is_rejected():
    with pytest.raises(TypeError, match="traced"):
        jax.jit(lambda q, c: jaxtile.flash_attention(q, K, V, causal=c))(Q, True)


def _check_close(a, b, tol=2e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def _attend(impl, **kw):
    return lambda q, k, v: jaxtile.flash_attention(q, k, v, implementation=impl.name, block_q=16, block_k=16, **kw)


def _reference(**kw):
    return lambda q, k, v: jaxtile.flash_attention(q, k, v, implementation="reference", **kw)


def test_jit_grad_and_checkpoint(impl):
    def loss(f):
        return lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))

    expected = jax.grad(loss(_reference(causal=True)), argnums=(0, 1, 2))(Q, K, V)
    for transform in (lambda f: f, jax.checkpoint):
        got = jax.jit(jax.grad(loss(transform(_attend(impl, causal=True))), argnums=(0, 1, 2)))(Q, K, V)
        for g, e in zip(got, expected):
            _check_close(g, e)


def test_vmap_over_any_batch_axis(impl):
    q, k, v = (jnp.stack([x, x[::-1]], axis=1) for x in (Q, K, V))  # [2, 2, len, heads, dim]
    f = _attend(impl, window=(4, 2))
    for axis in (0, 1):
        got = jax.vmap(f, in_axes=axis, out_axes=axis)(q, k, v)
        _check_close(got, _reference(window=(4, 2))(q, k, v))


def test_leading_batch_dims(impl):
    f, ref = _attend(impl, causal=True), _reference(causal=True)
    for batch in ((), (3,), (2, 3)):
        q, k, v = _normal(*batch, 16, 4, 8), _normal(*batch, 20, 2, 8), _normal(*batch, 20, 2, 12)
        out = f(q, k, v)
        assert out.shape == (*batch, 16, 4, 12)
        _check_close(out, ref(q, k, v))


def test_return_lse_shapes_and_dtypes(impl):
    out, lse = _attend(impl, return_lse=True)(Q.astype(jnp.bfloat16), K.astype(jnp.bfloat16), V.astype(jnp.bfloat16))
    assert out.dtype == jnp.bfloat16 and out.shape == (2, 16, 4, 8)
    assert lse.dtype == jnp.float32 and lse.shape == (2, 4, 16)


def test_gradient_dtypes_follow_primals(impl):
    q, k, v = (x.astype(jnp.float16) for x in (Q, K, V))
    grads = jax.grad(lambda *a: _attend(impl)(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)
    assert [g.dtype for g in grads] == [jnp.float16] * 3


def test_default_implementation_on_cpu():
    _check_close(jaxtile.flash_attention(Q, K, V), _reference()(Q, K, V))
