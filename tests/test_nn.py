"""The Flax NNX layers of ``jaxtile.nn``.

`Attention` against a PyTorch module of FlashTile's layout (fused ``qkv_proj`` or
separate projections, ``out_proj``) whose attention is the float64 parity reference:
same weights, same output and gradients (inputs and every parameter) within the float32
tolerance. `attention_fn` against Flax's own attention inside ``nnx.MultiHeadAttention``.
`Attention`'s KV-cache decoding against the same layer run on whole sequences.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxtile
from parity import reference
from parity.compare import TOLERANCES, compare

nnx = pytest.importorskip("flax.nnx")
from jaxtile import nn  # noqa: E402  (needs flax)

TOL = TOLERANCES["float32"]


class TorchAttention(torch.nn.Module):
    """FlashTile's attention layout, with the parity reference as its attention."""

    def __init__(self, embed_dim, num_heads, num_kv_heads, *, fused, bias, sinks=False, **options):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.randn(num_heads)) if sinks else None
        self.shape = (num_heads, num_kv_heads, embed_dim // num_heads)
        self.options = options
        head_dim = embed_dim // num_heads
        widths = {"q_proj": num_heads * head_dim, "k_proj": num_kv_heads * head_dim, "v_proj": num_kv_heads * head_dim}
        if fused:
            self.qkv_proj = torch.nn.Linear(embed_dim, sum(widths.values()), bias=bias)
        else:
            for name, width in widths.items():
                setattr(self, name, torch.nn.Linear(embed_dim, width, bias=bias))
        self.out_proj = torch.nn.Linear(num_heads * head_dim, embed_dim, bias=bias)

    def forward(self, x):
        num_heads, num_kv_heads, head_dim = self.shape
        if hasattr(self, "qkv_proj"):
            q, k, v = self.qkv_proj(x).split([num_heads * head_dim, *(num_kv_heads * head_dim,) * 2], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.unflatten(-1, (num_heads, head_dim))
        k, v = (t.unflatten(-1, (num_kv_heads, head_dim)) for t in (k, v))
        out, _ = reference.attention(q, k, v, sinks=self.sinks, **self.options)
        return self.out_proj(out.flatten(-2))


LAYERS = [
    dict(embed_dim=32, num_heads=4, num_kv_heads=2, fused=True, bias=True, causal=True),
    dict(embed_dim=48, num_heads=4, num_kv_heads=4, fused=True, bias=False, window=(5, 2)),
    dict(embed_dim=32, num_heads=4, num_kv_heads=1, fused=False, bias=True, causal=True, window=(7, 0)),
    dict(embed_dim=32, num_heads=4, num_kv_heads=2, fused=False, bias=False, causal=True, sinks=True),
]


@pytest.mark.parametrize("layer", LAYERS, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_attention_matches_torch_module(layer):
    torch.manual_seed(0)
    shape = {k: layer[k] for k in ("embed_dim", "num_heads", "num_kv_heads")}
    options = {k: v for k, v in layer.items() if k in ("causal", "window", "sinks")}
    module = TorchAttention(**shape, fused=layer["fused"], bias=layer["bias"], **options).double()
    ours = nn.Attention(
        **shape, fused_qkv=layer["fused"], bias=layer["bias"], block_q=16, block_k=16, rngs=nnx.Rngs(0), **options
    )
    ours.load_torch_state_dict(module.state_dict())

    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 40, layer["embed_dim"])).astype(np.float32)
    dout = rng.standard_normal(x.shape).astype(np.float32)

    x_torch = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    out_torch = module(x_torch)
    (out_torch * torch.tensor(dout, dtype=torch.float64)).sum().backward()
    expected = {"out": out_torch, "x": x_torch.grad}
    expected |= {name: p.grad for name, p in module.named_parameters()}

    def loss(layer, x):
        out = layer(x)
        return jnp.sum(out * dout), out

    with jax.default_matmul_precision("highest"):
        (_, out), (grads, dx) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(ours, jnp.asarray(x))
    got = {"out": out, "x": dx}
    for path, value in nnx.to_flat_state(nnx.state(grads)):
        name = ".".join(str(p) for p in path).replace(".kernel", ".weight")
        got[name] = value[...].T if name.endswith(".weight") else value[...]
    assert got.keys() == expected.keys()
    # A key bias shifts each row of scores by a constant, which softmax ignores: its
    # gradient is 0 up to rounding, so it is held to the scale of the value bias's.
    if "k_proj.bias" in expected:
        expected.pop("k_proj.bias")
        scale = float(expected["v_proj.bias"].abs().max())
        assert float(jnp.abs(got.pop("k_proj.bias")).max()) <= TOL.max_err * scale
    for name, ref in expected.items():
        error = compare(np.asarray(got[name]), ref.detach().numpy(), TOL)
        assert error.ok, f"{name}: {error}"


def test_load_torch_state_dict_checks_names_and_shapes():
    layer = nn.Attention(32, 4, num_kv_heads=2, rngs=nnx.Rngs(0))
    state = TorchAttention(32, 4, 2, fused=True, bias=True).state_dict()
    with pytest.raises(KeyError, match=r"out_proj\.bias"):
        layer.load_torch_state_dict({k: v for k, v in state.items() if k != "out_proj.bias"})
    state["qkv_proj.weight"] = torch.zeros(60, 32)
    with pytest.raises(ValueError, match=r"qkv_proj.weight has shape \(60, 32\); this layer needs \(64, 32\)"):
        layer.load_torch_state_dict(state)


def _flax_pair(**kwargs):
    """Two ``nnx.MultiHeadAttention`` with equal weights: Flax's attention and jaxtile's."""
    make = functools.partial(nnx.MultiHeadAttention, num_heads=4, in_features=32, decode=False, **kwargs)
    theirs = make(rngs=nnx.Rngs(0))
    ours = make(rngs=nnx.Rngs(0), attention_fn=functools.partial(nn.attention_fn, block_q=16, block_k=16))
    return theirs, ours


def _check_same(theirs, ours, x, **call):
    def loss(module, x):
        out = module(x, **call)
        return jnp.sum(jnp.sin(out)), out

    with jax.default_matmul_precision("highest"):
        (_, expected), expected_dx = nnx.value_and_grad(loss, argnums=1, has_aux=True)(theirs, x)
        (_, got), dx = nnx.value_and_grad(loss, argnums=1, has_aux=True)(ours, x)
    for name, a, b in (("out", got, expected), ("dx", dx, expected_dx)):
        error = compare(np.asarray(a), np.asarray(b, np.float64), TOL)
        assert error.ok, f"{name}: {error}"


def test_attention_fn_in_flax_multi_head_attention():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 24, 32)), jnp.float32)
    theirs, ours = _flax_pair(num_kv_heads=2)
    _check_same(theirs, ours, x)
    _check_same(theirs, ours, x, is_causal=True)
    _check_same(theirs, ours, x, mask=nnx.make_causal_mask(x[..., 0]))  # float mask, [b, 1, q, k]
    # Key padding. (A query that sees no key gets 0 from jaxtile, a uniform average from Flax.)
    valid = jnp.arange(24) < jnp.array([[20], [11]])
    _check_same(theirs, ours, x, mask=nnx.make_attention_mask(jnp.ones_like(valid), valid))


def test_attention_fn_top_left_causal_for_cross_attention():
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((2, 8, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 20, 4, 16)), jnp.float32) for _ in range(2))
    expected = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    error = compare(np.asarray(nn.attention_fn(q, k, v, is_causal=True)), np.asarray(expected, np.float64), TOL)
    assert error.ok, error


@pytest.mark.parametrize(
    "kwargs,text",
    [
        (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "dropout_rate=0.1"),
        (dict(module=object()), "sow_weights"),
    ],
    ids=["dropout", "sow_weights"],
)
def test_attention_fn_refuses_what_it_cannot_map(kwargs, text):
    q = jnp.ones((8, 4, 16), jnp.float32)
    with pytest.raises(NotImplementedError, match=text):
        nn.attention_fn(q, q, q, **kwargs)


def test_attention_fn_takes_flax_s_bias():
    rng = np.random.default_rng(6)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 12, 4, 16)), jnp.float32) for _ in range(3))
    bias = jnp.asarray(rng.standard_normal((1, 4, 12, 12)), jnp.float32)
    mask = jnp.asarray(rng.random((2, 1, 12, 12)) < 0.8)

    def loss(attention, q, bias):
        return jnp.sum(jnp.sin(attention(q, k, v, bias=bias, mask=mask)))

    got = jax.value_and_grad(functools.partial(loss, nn.attention_fn), argnums=(0, 1))(q, bias)
    expected = jax.value_and_grad(functools.partial(loss, nnx.dot_product_attention), argnums=(0, 1))(q, bias)
    for name, x, ref in zip(("loss", "dq", "dbias"), jax.tree.leaves(got), jax.tree.leaves(expected)):
        error = compare(np.asarray(x), np.asarray(ref, np.float64), TOL)
        assert error.ok, f"{name}: {error}"


def test_attention_fn_allows_deterministic_dropout():
    q = jnp.asarray(np.random.default_rng(4).standard_normal((8, 4, 16)), jnp.float32)
    got = nn.attention_fn(q, q, q, dropout_rate=0.1, deterministic=True)
    error = compare(np.asarray(got), np.asarray(jax.nn.dot_product_attention(q, q, q), np.float64), TOL)
    assert error.ok, error


def test_attention_fn_carries_structured_masks_into_flax():
    # Window and packed documents through nnx.MultiHeadAttention, as options of the
    # attention function, against Flax's own attention given the same pattern densely.
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 24, 32)), jnp.float32)
    ids = jnp.asarray(np.sort(np.random.default_rng(6).integers(0, 3, (2, 24)), axis=1), jnp.int32)
    i, j = np.arange(24)[:, None], np.arange(24)[None, :]
    dense = (np.asarray(ids)[:, None, :, None] == np.asarray(ids)[:, None, None, :]) & (j <= i) & (j >= i - 5)
    make = functools.partial(nnx.MultiHeadAttention, num_heads=4, in_features=32, decode=False)
    theirs = make(rngs=nnx.Rngs(0))
    structured = functools.partial(nn.attention_fn, local_window_size=(5, 0), segment_ids=ids, block_q=16, block_k=16)
    ours = make(rngs=nnx.Rngs(0), attention_fn=structured)

    def loss(module, x, call):
        out = module(x, **call)
        return jnp.sum(jnp.sin(out)), out

    with jax.default_matmul_precision("highest"):
        dense_call = functools.partial(loss, call=dict(mask=jnp.asarray(dense)))
        (_, expected), expected_dx = nnx.value_and_grad(dense_call, argnums=1, has_aux=True)(theirs, x)
        causal_call = functools.partial(loss, call=dict(is_causal=True))
        (_, got), dx = nnx.value_and_grad(causal_call, argnums=1, has_aux=True)(ours, x)
    for name, a, b in (("out", got, expected), ("dx", dx, expected_dx)):
        error = compare(np.asarray(a), np.asarray(b, np.float64), TOL)
        assert error.ok, f"{name}: {error}"


def _rotary_numpy(x, positions, theta):
    """The rotary embedding by its definition: consecutive-half pairs rotated by complex
    multiplication, in float64."""
    x = np.asarray(x, np.float64)
    half = x.shape[-1] // 2
    pairs = x[..., :half] + 1j * x[..., half:]
    angles = np.asarray(positions, np.float64)[..., None, None] * theta ** (-np.arange(half) / half)
    rotated = pairs * np.exp(1j * angles)
    return np.concatenate([rotated.real, rotated.imag], axis=-1)


def test_rotary_embedding_by_definition_and_relative_positions():
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((2, 10, 3, 16)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 1000, (2, 10)))
    got = nn.rotary(x, positions, 10000.0)
    assert compare(np.asarray(got), _rotary_numpy(x, positions, 10000.0), TOL).ok
    # Scores depend on position differences only: a layer's output is unchanged when
    # every position moves by the same amount.
    layer = nn.Attention(32, 4, num_kv_heads=2, causal=True, rope_theta=10000.0, rngs=nnx.Rngs(1))
    tokens = jnp.asarray(rng.standard_normal((2, 20, 32)), jnp.float32)
    start = layer(tokens)
    shifted = layer(tokens, positions=jnp.broadcast_to(jnp.arange(20) + 517, (2, 20)))
    assert compare(np.asarray(shifted), np.asarray(start, np.float64), TOL).ok
    without = nn.Attention(32, 4, num_kv_heads=2, causal=True, rngs=nnx.Rngs(1))
    assert not np.allclose(np.asarray(without(tokens)), np.asarray(start), atol=1e-3)
    with pytest.raises(ValueError, match="even head_dim"):
        nn.rotary(x[..., :15], positions, 10000.0)
    with pytest.raises(ValueError, match="rope_theta"):
        without(tokens, positions=positions)


def test_cross_attention_reads_keys_and_values_from_the_context():
    rng = np.random.default_rng(8)
    layer = nn.Attention(32, 4, num_kv_heads=2, fused_qkv=False, rngs=nnx.Rngs(2))
    x, context = (jnp.asarray(rng.standard_normal((2, n, 32)), jnp.float32) for n in (6, 30))
    q = layer.q_proj(x).reshape(2, 6, 4, 8)
    k, v = (proj(context).reshape(2, 30, 2, 8) for proj in (layer.k_proj, layer.v_proj))
    expected = layer.out_proj(jaxtile.flash_attention(q, k, v, implementation="reference").reshape(2, 6, 32))
    assert compare(np.asarray(layer(x, context=context)), np.asarray(expected, np.float64), TOL).ok
    with pytest.raises(ValueError, match="fused_qkv=False"):
        nn.Attention(32, 4, rngs=nnx.Rngs(2))(x, context=context)


DECODE_LAYERS = [
    dict(num_kv_heads=2, causal=True, rope_theta=10000.0),
    dict(num_kv_heads=2, window=(3, 0), sinks=True, rope_theta=10000.0, fused_qkv=False),
]
DECODE_IDS = ["causal-gqa-rope", "window-sinks"]


def _decode_layer(options):
    """``Attention(32, 4, **options)``, its sinks (if any) random rather than 0."""
    layer = nn.Attention(32, 4, block_q=16, block_k=16, rngs=nnx.Rngs(4), **options)
    if layer.sinks is not None:
        layer.sinks[...] = jnp.asarray(np.random.default_rng(13).standard_normal(4), jnp.float32)
    return layer


def _noisy_cache(layer, batch, max_len, rng):
    """``layer.init_cache(batch, max_len)`` with noise in the unfilled slots, which
    decoding must never read."""
    layer.init_cache(batch, max_len)
    for cache in (layer.cached_key, layer.cached_value):
        cache[...] = jnp.asarray(rng.standard_normal(cache.shape), jnp.float32)


def _close(got, expected):
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", DECODE_LAYERS, ids=DECODE_IDS)
def test_decode_equals_the_whole_sequence(options):
    # Prefill 5 tokens, then 7 single-token steps: the rows of the whole 12-token run.
    rng = np.random.default_rng(9)
    layer = _decode_layer(options)
    x = jnp.asarray(rng.standard_normal((2, 12, 32)), jnp.float32)
    for positions in (None, jnp.broadcast_to(3 * jnp.arange(12), (2, 12))):
        expected = layer(x, positions=positions)
        _noisy_cache(layer, 2, 16, rng)
        chunks = []
        for start, stop in ((0, 5), *((t, t + 1) for t in range(5, 12))):
            given = None if positions is None else positions[:, start:stop]
            chunks.append(layer(x[:, start:stop], decode=True, positions=given))
        _close(np.concatenate(chunks, axis=1), expected)
        np.testing.assert_array_equal(layer.cache_lengths[...], [12, 12])
    # The explicit positions (with gaps) were used: they change the result.
    assert not np.allclose(np.asarray(expected), np.asarray(layer(x)), atol=1e-3)


@pytest.mark.parametrize("options", DECODE_LAYERS, ids=DECODE_IDS)
def test_decode_a_batch_of_sequences_of_different_lengths(options):
    # As a server batches requests: two sequences prefilled alone, in chunks of 4, to 8 and
    # 4 tokens, their caches stacked, then 3 single-token steps and a chunk of 2 fed to both
    # together. Each must see only its own keys, at its own positions.
    rng = np.random.default_rng(10)
    layer = _decode_layer(options)
    x = jnp.asarray(rng.standard_normal((2, 13, 32)), jnp.float32)
    expected = [layer(x[b : b + 1])[0] for b in range(2)]
    prefill = (8, 4)
    caches = []
    for b, n in enumerate(prefill):
        _noisy_cache(layer, 1, 16, rng)
        for start in range(0, n, 4):
            _close(layer(x[b : b + 1, start : start + 4], decode=True)[0], expected[b][start : start + 4])
        caches.append([layer.cached_key[...], layer.cached_value[...], layer.cache_lengths[...]])
    layer.init_cache(2, 16)
    for cache, parts in zip((layer.cached_key, layer.cached_value, layer.cache_lengths), zip(*caches)):
        cache[...] = jnp.concatenate(parts)
    got = [[], []]
    for start, q_len in ((0, 1), (1, 1), (2, 1), (3, 2)):
        out = layer(jnp.stack([x[b, n + start : n + start + q_len] for b, n in enumerate(prefill)]), decode=True)
        for b in range(2):
            got[b].append(out[b])
    for b, n in enumerate(prefill):
        _close(np.concatenate(got[b]), expected[b][n : n + 5])
    np.testing.assert_array_equal(layer.cache_lengths[...], [13, 9])


@pytest.mark.parametrize("options", DECODE_LAYERS, ids=DECODE_IDS)
def test_decode_under_jit_matches_eager(options):
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((2, 10, 32)), jnp.float32)
    eager, jitted = _decode_layer(options), _decode_layer(options)
    noise = [jnp.asarray(rng.standard_normal((2, 12, 2, 8)), jnp.float32) for _ in range(2)]
    for layer in (eager, jitted):
        layer.init_cache(2, 12)
        layer.cached_key[...], layer.cached_value[...] = noise
    traced = []

    @nnx.jit
    def step(layer, x):
        traced.append(x.shape)
        return layer(x, decode=True)

    for start, stop in ((0, 4), *((t, t + 1) for t in range(4, 10))):
        _close(step(jitted, x[:, start:stop]), eager(x[:, start:stop], decode=True))
    for name in ("cached_key", "cached_value", "cache_lengths"):
        _close(getattr(jitted, name)[...], getattr(eager, name)[...])
    np.testing.assert_array_equal(jitted.cache_lengths[...], [10, 10])
    # The cache lengths are traced state: one compilation per chunk shape, not per step.
    assert traced == [(2, 4, 32), (2, 1, 32)]


def test_decode_refuses_what_it_cannot_do():
    rng = np.random.default_rng(12)
    layer = nn.Attention(32, 4, num_kv_heads=2, causal=True, fused_qkv=False, rngs=nnx.Rngs(5))
    x = jnp.asarray(rng.standard_normal((2, 3, 32)), jnp.float32)
    with pytest.raises(ValueError, match=r"call layer.init_cache\(batch, max_len\) first"):
        layer(x, decode=True)
    layer.init_cache(2, 8)
    refused = dict(
        context=x,
        kv_positions=jnp.broadcast_to(jnp.arange(3), (2, 3)),
        segment_ids=jnp.asarray(rng.integers(0, 2, (2, 3)), jnp.int32),
        mask=jnp.asarray(rng.random((3, 8)) < 0.5),
    )
    for name, value in refused.items():
        with pytest.raises(ValueError, match=rf"self-attention through the KV cache; it does not take \['{name}'\]"):
            layer(x, decode=True, **{name: value})
    with pytest.raises(ValueError, match=r"x of shape \[batch=2, q_len, embed_dim\]; got \(1, 3, 32\)"):
        layer(x[:1], decode=True)
    layer(x, decode=True)
    layer(x, decode=True)
    with pytest.raises(
        ValueError, match=r"q_len=3 tokens would overflow the cache \(max_len=8\): cache_lengths=\[6, 6\]"
    ):
        layer(x, decode=True)
    np.testing.assert_array_equal(layer.cache_lengths[...], [6, 6])
    with pytest.raises(ValueError, match=r"q_len=9 tokens cannot fit in the cache \(max_len=8\)"):
        layer(jnp.asarray(rng.standard_normal((2, 9, 32)), jnp.float32), decode=True)
    with pytest.raises(ValueError, match=r"batch=2, max_len=0"):
        layer.init_cache(2, 0)
