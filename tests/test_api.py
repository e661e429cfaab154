"""The public API: input validation, and composition with JAX transformations."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, NamedTuple

import host_devices
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax_settings import jax_test_config

import jaxtile
from jaxtile import _softmax, registry

RNG = np.random.default_rng(0)


def _normal(*shape, dtype=jnp.float32):
    return jnp.asarray(RNG.standard_normal(shape), dtype)


Q = _normal(2, 16, 4, 8)
K = _normal(2, 24, 2, 8)
V = _normal(2, 24, 2, 8)


class Traced(NamedTuple):
    """An option passed as a traced value: an argument of the ``jax.jit``-ed call."""

    value: Any


_IDS = jnp.zeros((2, 16), jnp.int32)

# (description, arguments, expected exception, text the message must contain)
BAD_INPUTS = [
    ("rank mismatch", dict(key=K[0]), ValueError, "same rank"),
    ("query rank < 3", dict(query=Q[0, 0], key=K[0, 0], value=V[0, 0]), ValueError, "query.shape=(4, 8)"),
    ("query not an array", dict(query=[[1.0]]), TypeError, "query must be an array; got list"),
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
    ("zero length", dict(query=_normal(2, 0, 4, 8)), ValueError, "positive"),
    ("zero kv_len", dict(key=_normal(2, 0, 2, 8), value=_normal(2, 0, 2, 8)), ValueError, "key.shape=(2, 0, 2, 8)"),
    ("zero head_dim", dict(query=_normal(2, 16, 4, 0), key=_normal(2, 24, 2, 0)), ValueError, "positive"),
    ("negative window", dict(window=(-1, 3)), ValueError, "window=(-1, 3)"),
    ("negative int window", dict(window=-2), ValueError, "window=-2"),
    ("window not a pair", dict(window=(1, 2, 3)), TypeError, "(1, 2, 3)"),
    ("window side not an int", dict(window=(2.5, 1)), TypeError, "2.5"),
    ("window a bool", dict(window=True), TypeError, "True"),
    (
        "segment ids wrong shape",
        dict(segment_ids=(jnp.zeros((2, 15), jnp.int32), jnp.zeros((2, 24), jnp.int32))),
        ValueError,
        "(2, 15)",
    ),
    ("kv segment ids wrong shape", dict(segment_ids=(_IDS, jnp.zeros((2, 23), jnp.int32))), ValueError, "(2, 23)"),
    ("segment ids float", dict(segment_ids=(jnp.zeros((2, 16)), jnp.zeros((2, 24)))), TypeError, "integer dtype"),
    ("segment ids three arrays", dict(segment_ids=(_IDS, _IDS, _IDS)), ValueError, "3 items"),
    (
        "single segment ids, q_len != kv_len",
        dict(segment_ids=_IDS),
        ValueError,
        "q_len=16, kv_len=24",
    ),
    ("kv_lengths wrong shape", dict(kv_lengths=jnp.array([3, 4, 5])), ValueError, "shape (2,)"),
    ("kv_lengths float", dict(kv_lengths=jnp.array([3.0, 4.0])), TypeError, "integer dtype"),
    ("mask not bool", dict(mask=jnp.ones((16, 24))), TypeError, "boolean"),
    ("mask int", dict(mask=jnp.ones((16, 24), jnp.int32)), TypeError, "int32"),
    ("mask does not broadcast", dict(mask=jnp.ones((16, 23), bool)), ValueError, "(16, 23)"),
    ("mask of too high rank", dict(mask=jnp.ones((1, 2, 4, 16, 24), bool)), ValueError, "(1, 2, 4, 16, 24)"),
    ("unknown implementation", dict(implementation="flash3"), ValueError, "'flash3'"),
    ("implementation not a string", dict(implementation=2), ValueError, "implementation=2"),
    ("block not positive", dict(block_q=0), ValueError, "block_q=0"),
    ("block negative", dict(block_k=-16), ValueError, "block_k=-16"),
    ("block not an int", dict(block_q=16.0), TypeError, "16.0"),
    # Blocks are checked before anything else, wherever the implementation runs.
    *(
        row
        for i in registry.implementations()
        if i.power_of_two_blocks
        for row in (
            (f"block not power of two for {i.name}", dict(block_k=24, implementation=i.name), ValueError, "block_k=24"),
            (f"block below 16 for {i.name}", dict(block_q=8, implementation=i.name), ValueError, "block_q=8"),
        )
    ),
    # In a dtype it takes, where it can run (elsewhere it says that first).
    *(
        (
            f"head_dim too large for {i.name}",
            dict(
                query=jnp.zeros((*Q.shape[:3], i.max_head_dim + 1), min(i.dtypes)),
                key=jnp.zeros((*K.shape[:3], i.max_head_dim + 1), min(i.dtypes)),
                value=V.astype(min(i.dtypes)),
                implementation=i.name,
            ),
            NotImplementedError,
            f"head_dim={i.max_head_dim + 1}",
        )
        for i in registry.implementations()
        if i.max_head_dim is not None and i.unable(jax.default_backend()) is None
    ),
    ("mixed dtypes", dict(key=K.astype(jnp.bfloat16)), TypeError, "share a dtype"),
    ("integer query", dict(query=Q.astype(jnp.int32)), TypeError, "int32"),
    ("integer key", dict(key=K.astype(jnp.int32)), TypeError, "key.dtype=int32"),
    ("bool value", dict(value=V.astype(bool)), TypeError, "value.dtype=bool"),
    ("soft cap not positive", dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap=0.0"),
    ("soft cap negative", dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap=-1.0"),
    ("scale not finite", dict(scale=float("inf")), ValueError, "scale=inf"),
    ("scale a string", dict(scale="0.1"), TypeError, "'0.1'"),
    ("causal not a bool", dict(causal="yes"), TypeError, "causal"),
    ("return_lse not a bool", dict(return_lse=1), TypeError, "return_lse"),
    ("unknown tuning", dict(tuning="fast"), TypeError, "'fast'"),
    ("traced causal", dict(causal=Traced(True)), TypeError, "causal must be a static"),
    ("traced window", dict(window=Traced((4, 0))), TypeError, "window must be a static"),
    ("traced scale", dict(scale=Traced(0.5)), TypeError, "scale must be a static"),
    ("traced soft cap", dict(logits_soft_cap=Traced(5.0)), TypeError, "logits_soft_cap must be a static"),
    ("traced block_q", dict(block_q=Traced(16)), TypeError, "block_q must be a static"),
    ("traced block_k", dict(block_k=Traced(16)), TypeError, "block_k must be a static"),
    ("traced return_lse", dict(return_lse=Traced(True)), TypeError, "return_lse must be a static"),
    ("sinks per batch", dict(sinks=jnp.zeros((2, Q.shape[2]))), ValueError, f"sinks must have shape ({Q.shape[2]},)"),
    ("integer sinks", dict(sinks=jnp.zeros(Q.shape[2], jnp.int32)), TypeError, "sinks must have a floating dtype"),
    ("sinks a list", dict(sinks=[0.0] * Q.shape[2]), TypeError, "sinks must be an array"),
    ("bias does not broadcast", dict(bias=jnp.zeros((3, 16, 24))), ValueError, "bias of shape (3, 16, 24) does not"),
    ("integer bias", dict(bias=jnp.zeros((16, 24), jnp.int32)), TypeError, "bias.dtype=int32 is not supported"),
    ("bias a list", dict(bias=[[0.0] * 24] * 16), TypeError, "bias must be an array"),
]


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _call(changes: dict, *, abstract: bool = False):
    """Calls ``flash_attention`` on Q, K, V with ``changes``; `Traced` options become
    arguments of ``jax.jit``. With ``abstract``, every array is a ``jax.ShapeDtypeStruct``
    under ``jax.eval_shape`` instead, so nothing can run on a device."""
    args = dict(query=Q, key=K, value=V) | changes
    traced = {name: x.value for name, x in args.items() if isinstance(x, Traced)}
    if abstract:
        arrays = {name: x for name, x in args.items() if jax.tree.leaves(x) and all(map(_is_array, jax.tree.leaves(x)))}
        traced |= jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), arrays)
    fixed = {name: x for name, x in args.items() if name not in traced}

    def attend(traced):
        return jaxtile.flash_attention(**fixed, **traced)

    if abstract:
        return jax.eval_shape(attend, traced)
    return jax.jit(attend)(traced) if traced else attend({})


# Bad values of concrete arrays (traced ones cannot be checked: lengths are clipped).
BAD_VALUES = [
    (
        "kv_lengths past the cache",
        dict(kv_lengths=jnp.array([24, 25])),
        ValueError,
        "kv_lengths must lie in [0, 24]; got [25]",
    ),
    ("negative q_lengths", dict(q_lengths=jnp.array([-1, 3])), ValueError, "q_lengths must lie in [0, 16]; got [-1]"),
]


@pytest.mark.parametrize(
    "what,changes,error,text", BAD_INPUTS + BAD_VALUES, ids=[b[0] for b in BAD_INPUTS + BAD_VALUES]
)
def test_bad_input_raises_clear_error(what, changes, error, text):
    with pytest.raises(error) as info:
        _call(changes)
    assert text in str(info.value), f"{what}: message {str(info.value)!r} lacks {text!r}"


# Options passed as NumPy or concrete JAX scalars, as users write them by habit, and the
# Python values they stand for.
HABITUAL_SCALARS = [
    ("scale from jnp.sqrt", dict(scale=1 / jnp.sqrt(jnp.float32(8))), dict(scale=float(1 / np.sqrt(np.float32(8))))),
    ("scale numpy float", dict(scale=np.float32(0.25)), dict(scale=0.25)),
    ("causal numpy bool", dict(causal=np.bool_(True)), dict(causal=True)),
    ("causal jax bool", dict(causal=jnp.array(True)), dict(causal=True)),
    ("window jax int", dict(window=jnp.int32(3)), dict(window=3)),
    ("window numpy pair", dict(window=(np.int64(5), jnp.array(0))), dict(window=(5, 0))),
    ("soft cap jax float", dict(logits_soft_cap=jnp.float32(5.0)), dict(logits_soft_cap=5.0)),
    ("block numpy int", dict(block_q=np.int64(16), block_k=jnp.int32(16)), dict(block_q=16, block_k=16)),
    ("return_lse numpy bool", dict(return_lse=np.bool_(True)), dict(return_lse=True)),
]


@pytest.mark.parametrize("what,habit,python", HABITUAL_SCALARS, ids=[h[0] for h in HABITUAL_SCALARS])
def test_concrete_scalars_are_converted(what, habit, python):
    """Concrete NumPy/JAX scalars for static options give exactly the Python value's
    result; traced ones keep the clear error of `BAD_INPUTS`."""
    got, want = _call(habit), _call(python)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=what)


def test_scalar_arrays_of_the_wrong_kind_are_refused():
    for changes, text in (
        (dict(causal=jnp.array(1)), "causal must be a Python bool"),
        (dict(window=jnp.float32(2.0)), "window must be a Python int"),
        (dict(scale=jnp.ones(2)), "scale must be a Python float"),
    ):
        with pytest.raises(TypeError, match=text):
            _call(changes)


@pytest.mark.parametrize("what,changes,error,text", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_caught_from_shapes_alone(what, changes, error, text):
    """Validation needs only shapes, dtypes and static values: the same error comes from
    ``jax.ShapeDtypeStruct`` inputs under ``jax.eval_shape``, before any device work."""
    with pytest.raises(error) as info:
        _call(changes, abstract=True)
    assert text in str(info.value), f"{what}: message {str(info.value)!r} lacks {text!r}"


def check_arrays_on_different_devices_are_rejected():
    """Run on 8 host devices (`host_devices`): committed arrays on different devices fail
    with the devices named, before anything is compiled; uncommitted ones are moved."""
    first, second = jax.devices()[:2]
    q = jax.device_put(_normal(2, 16, 4, 8), first)
    k, v = (jax.device_put(x, second) for x in (_normal(2, 20, 2, 8), _normal(2, 20, 2, 8)))
    cases = (
        (dict(query=q, key=k, value=v), "query on [CpuDevice(id=0)], key on [CpuDevice(id=1)]"),
        (dict(query=q, key=q, value=q, mask=jax.device_put(jnp.ones((16, 16), bool), second)), "mask on"),
        (dict(query=q, key=q, value=q, segment_ids=(_IDS, jax.device_put(_IDS, second))), "kv_segment_ids on"),
    )
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(lambda event, *_, **__: compiles.append(event))
    for args, text in cases:
        with pytest.raises(ValueError, match="same devices") as info:
            jaxtile.flash_attention(**args)
        assert text in str(info.value), str(info.value)
    assert not compiles, f"device work before the error: {compiles}"
    uncommitted = jnp.asarray(np.asarray(q))
    out = jaxtile.flash_attention(q, uncommitted, uncommitted)
    assert out.devices() == {first}


def test_on_host_devices():
    host_devices.assert_checks_pass(__file__)


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
    # Any leading batch dims, none included, give what one flattened batch dim gives.
    f = _attend(impl, causal=True)
    for batch in ((), (3,), (2, 3)):
        q, k, v = _normal(*batch, 16, 4, 8), _normal(*batch, 20, 2, 8), _normal(*batch, 20, 2, 12)
        out = f(q, k, v)
        assert out.shape == (*batch, 16, 4, 12)
        _check_close(out, f(*(x.reshape(-1, *x.shape[-3:]) for x in (q, k, v))).reshape(out.shape))


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


def test_traced_lengths_are_clipped_to_the_sequence():
    """Lengths under ``jit`` cannot be checked; they are clipped to ``[0, len]``, the
    documented rule: the same result as the clipped concrete lengths."""
    clipped = jaxtile.flash_attention(Q, K, V, causal=True, q_lengths=jnp.array([16, 0]), kv_lengths=jnp.array([24, 3]))
    traced = jax.jit(lambda q, kv: jaxtile.flash_attention(Q, K, V, causal=True, q_lengths=q, kv_lengths=kv))(
        jnp.array([99, -4]), jnp.array([30, 3])
    )
    np.testing.assert_allclose(np.asarray(traced), np.asarray(clipped), rtol=1e-6, atol=1e-6)
    assert not np.asarray(traced[1]).any(), "a sequence of no queries has only padding rows (0)"


def test_sinks_of_minus_infinity_are_no_sinks_and_empty_rows_stay_zero():
    """A sink of ``-inf`` changes nothing; a row that sees no key keeps output 0 and
    takes the sink as its lse, with finite gradients (the sink's among them)."""
    heads = Q.shape[2]
    none = jaxtile.flash_attention(Q, K, V, causal=True, return_lse=True)
    off = jaxtile.flash_attention(Q, K, V, causal=True, sinks=jnp.full(heads, -jnp.inf), return_lse=True)
    for x, y in zip(off, none):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    sinks = jnp.linspace(-1.0, 1.0, heads)
    empty = jnp.zeros((1, 1, Q.shape[1], K.shape[1]), bool).at[..., 1:, :].set(True)  # row 0 sees nothing

    def loss(q, k, v, sinks):
        out, lse = jaxtile.flash_attention(q, k, v, mask=empty, sinks=sinks, return_lse=True)
        return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

    grads, (out, lse) = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(Q, K, V, sinks)
    assert not np.asarray(out[:, 0]).any(), "a row that sees no key is not 0"
    np.testing.assert_array_equal(np.asarray(lse[:, :, 0]), np.broadcast_to(np.asarray(sinks), lse[:, :, 0].shape))
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


@contextlib.contextmanager
def taking_sinks(impl: registry.Implementation):
    """``impl`` (an `lse_backward` record) registered as one whose forward pass takes the
    sinks itself (`registry.Implementation.takes_sinks`), folding them in after its own
    pass, so that `_core.differentiable` gives their gradient; never chosen by default."""

    def forward(inputs, config):
        out, lse, _ = impl.forward(inputs._replace(sinks=None), config)
        if inputs.sinks is not None:
            out, lse = _softmax.with_sinks(out, lse, inputs.sinks)
        return out, lse, lse

    record = dataclasses.replace(impl, name=f"{impl.name}_taking_sinks", takes_sinks=True, forward=forward, speed=-1)
    registry.register(record)
    try:
        yield record
    finally:
        registry.unregister(record.name)


def test_sinks_taken_by_the_forward_pass_give_autodiff_s_gradient():
    """The sinks' gradient `_core.differentiable` forms for a record that takes them
    (`_sinks_grad`) is the one autodiff gives the same passes with the sinks folded in
    after them: outputs, lse and the four gradients, under lse's cotangent, with a sink
    of ``-inf`` and a row that sees no key."""
    sinks = jnp.array([0.5, -jnp.inf, 2.0, -1.0])
    empty = jnp.zeros((1, 1, Q.shape[1], K.shape[1]), bool).at[..., 1:, :].set(True)  # row 0 sees nothing

    def loss(name):
        def f(q, k, v, sinks):
            out, lse = jaxtile.flash_attention(q, k, v, mask=empty, sinks=sinks, return_lse=True, implementation=name)
            return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.where(jnp.isfinite(lse), jnp.cos(lse), 0.0)), (out, lse)

        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3), has_aux=True))

    folding = registry.get("scan_v2")
    with taking_sinks(folding) as taking:
        (grads, aux), (expected_grads, expected_aux) = (loss(i.name)(Q, K, V, sinks) for i in (taking, folding))
    assert float(grads[3][1]) == 0.0, "a sink of -inf has a gradient"
    for got, expected in zip((*grads, *aux), (*expected_grads, *expected_aux)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-5, atol=2e-5)


@contextlib.contextmanager
def _recognising(impl, traced: list | None = None, **changes):
    """``impl`` registered as a record that recognises dense masks and runs natively here
    (`registry.Implementation.recognises_masks`), with ``changes`` to its fields;
    ``traced`` collects the masks (`MaskSpec`) its forward pass is traced with."""

    def forward(inputs, config):
        if traced is not None:
            traced.append(config.mask)
        return impl.forward(inputs, config)

    native = impl.platforms | {jax.default_backend()}
    record = dataclasses.replace(
        impl, name=f"{impl.name}_recognising", recognises_masks=True, platforms=native, forward=forward, **changes
    )
    registry.register(record)
    try:
        yield record
    finally:
        registry.unregister(record.name)


def _causal_with_padding(lengths, q_len: int, kv_len: int):
    """Flax's kind of mask, ``[batch, 1, q_len, kv_len]``: causal (bottom-right within
    each sequence's ``(q_length, kv_length)``) and padding."""
    rows, keys = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    return jnp.asarray(np.stack([(rows < q) & (keys < kv) & (keys <= rows + kv - q) for q, kv in lengths])[:, None])


def test_recognised_masks_give_the_dense_call_s_results(impl):
    """A record that recognises masks runs a dense mask as the dense call and as the
    structured ones (causal, and causal with lengths), chosen at run time; for a causal
    mask, one with padding (both read as structured) and a random one (not) it gives the
    outputs, lse and gradients (the sinks' among them) of the reference with the same
    dense mask."""
    sinks = jnp.linspace(-1.0, 1.0, Q.shape[2])
    masks = {
        "causal": _causal_with_padding([(16, 24), (16, 24)], 16, 24),
        "causal with padding": _causal_with_padding([(16, 24), (9, 13)], 16, 24),
        "random": jnp.asarray(RNG.random((2, 1, 16, 24)) < 0.6),
    }

    def loss(name):
        def f(q, k, v, sinks, mask):
            out, lse = jaxtile.flash_attention(
                q, k, v, mask=mask, sinks=sinks, return_lse=True, implementation=name, block_q=16, block_k=16
            )
            return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

        # One program per implementation, the mask an argument: each mask runs the same
        # compiled run-time choice.
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3), has_aux=True))

    traced = []
    with _recognising(impl, traced) as recognising:
        losses = {name: loss(name) for name in (recognising.name, "reference")}
        for what, mask in masks.items():
            (grads, aux), (expected_grads, expected_aux) = (f(Q, K, V, sinks, mask) for f in losses.values())
            for got, expected in zip((*grads, *aux), (*expected_grads, *expected_aux)):
                np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-5, atol=2e-5, err_msg=what)
    dense = jaxtile.mask.MaskSpec(16, 24, has_dense_mask=True)
    assert set(traced) == {dense, dense.recognised(padded=True), dense.recognised(padded=False)}


def test_recognised_masks_run_on_the_structured_call_s_own_choice():
    """With ``implementation=None`` the structured calls a dense mask reads as run on the
    implementation they choose themselves (here a faster record without dense masks, as
    mosaic_v3 is), the dense one on the dense call's; a named implementation runs all
    three. Results are the reference's either way."""
    native = next(i for i in registry.implementations() if i.tiled and jax.default_backend() in i.platforms)
    structured_traced = []

    def structured_forward(inputs, config):
        structured_traced.append(config.mask)
        return native.forward(inputs, config)

    faster = dataclasses.replace(
        native,
        name="structured_only",
        forward=structured_forward,
        features=native.features - {"dense_mask"},
        platforms=native.platforms | {jax.default_backend()},
        speed=max(i.speed for i in registry.implementations()) + 2,
    )
    mask = _causal_with_padding([(16, 24), (9, 13)], 16, 24)
    dense = jaxtile.mask.MaskSpec(16, 24, has_dense_mask=True)
    traced = []
    registry.register(faster)
    try:
        with _recognising(native, traced, speed=faster.speed - 1) as recognising:
            for name in (None, recognising.name):
                structured_traced.clear()  # (``traced`` accumulates: the jitted dense branch is traced once)
                got = jaxtile.flash_attention(Q, K, V, mask=mask, implementation=name, block_q=16, block_k=16)
                _check_close(got, _reference(mask=mask)(Q, K, V))
                structured = {dense.recognised(padded=True), dense.recognised(padded=False)}
                if name is None:
                    assert set(structured_traced) == structured and set(traced) == {dense}
                else:
                    assert not structured_traced and set(traced) == {dense, *structured}
    finally:
        registry.unregister(faster.name)


def test_recognise_takes_the_branch_of_each_kind_of_mask():
    """Branch 0 for a causal mask over the whole sequences, 1 with padding, 2 for a mask
    no structured call expresses."""
    spec = jaxtile.mask.MaskSpec(16, 24, has_dense_mask=True)
    random = jax.random.bernoulli(jax.random.key(3), 0.5, (2, 1, 16, 24))
    for mask, expected in (
        (_causal_with_padding([(16, 24), (16, 24)], 16, 24), 0),
        (_causal_with_padding([(16, 24), (9, 13)], 16, 24), 1),
        (random, 2),
    ):
        assert int(jaxtile.api._recognise(spec, mask)[1]) == expected


def test_recognition_stays_a_branch_under_vmap_and_jax_s_test_config():
    """Under ``vmap`` over per-example masks the verdict is one scalar for the whole batch
    (so the choice stays a ``lax.switch``, where a select would run every call), and the
    results are each example's own, under JAX's test configuration too."""
    native = next(i for i in registry.implementations() if i.tiled and jax.default_backend() in i.platforms)
    masks = jnp.stack([_causal_with_padding(fills, 16, 24) for fills in ([(16, 24), (9, 13)], [(5, 5), (16, 24)])])
    spec = jaxtile.mask.MaskSpec(16, 24, has_dense_mask=True)
    with _recognising(native) as recognising:

        def attend(q, k, v, mask):
            return jaxtile.flash_attention(q, k, v, mask=mask, implementation=recognising.name)

        for setting in (contextlib.nullcontext, jax_test_config):
            with setting():
                _, branch = jax.vmap(lambda m: jaxtile.api._recognise(spec, m), out_axes=(0, None))(masks)
                assert int(branch) == 1, "causal with padding"
                got = jax.vmap(attend, in_axes=(None, None, None, 0))(Q, K, V, masks)
                for example, mask in enumerate(masks):
                    _check_close(got[example], _reference(mask=mask)(Q, K, V))
