"""The Flax NNX layers of ``jaxtile.nn``.

`Attention` against a PyTorch module of FlashTile's layout (fused ``qkv_proj`` or
separate projections, ``out_proj``) whose attention is the float64 parity reference:
same weights, same output and gradients (inputs and every parameter) within the float32
tolerance. `attention_fn` against Flax's own attention inside ``nnx.MultiHeadAttention``.
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
        (dict(bias=jnp.zeros((4, 8, 8))), "bias"),
        (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "dropout_rate=0.1"),
        (dict(module=object()), "sow_weights"),
    ],
    ids=["bias", "dropout", "sow_weights"],
)
def test_attention_fn_refuses_what_it_cannot_map(kwargs, text):
    q = jnp.ones((8, 4, 16), jnp.float32)
    with pytest.raises(NotImplementedError, match=text):
        nn.attention_fn(q, q, q, **kwargs)


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
