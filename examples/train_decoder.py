"""Trains a small decoder-only transformer with jaxtile attention on a copy task.

Each sequence is ``n`` random tokens followed by the same ``n`` tokens again; the model
is trained to predict the second half, which it can only do by attending ``n``
positions back. The attention layers are `jaxtile.nn.Attention` (causal, grouped-query),
so the same model runs on any implementation: ``--compare-reference`` trains it a second
time with ``implementation="reference"`` from the same initialisation and data, and
reports how far the two loss curves are apart, step by step.

    python examples/train_decoder.py --steps 300 --out curve.json

Runs on CPU in about a minute (the default implementation there is ``scan_v2``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxtile import nn


@dataclasses.dataclass(frozen=True)
class Settings:
    """Model, task and optimiser of one training run."""

    vocab: int = 16
    copy_len: int = 24
    embed_dim: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    layers: int = 2
    batch: int = 32
    steps: int = 300
    learning_rate: float = 3e-3
    seed: int = 0
    implementation: str | None = None
    block: int | None = None  # block_q = block_k of the attention; None: the default


class Block(nnx.Module):
    """Pre-norm transformer block: causal jaxtile attention, then a GELU MLP."""

    def __init__(self, s: Settings, rngs: nnx.Rngs):
        self.attention_norm = nnx.RMSNorm(s.embed_dim, rngs=rngs)
        self.attention = nn.Attention(
            s.embed_dim,
            s.num_heads,
            num_kv_heads=s.num_kv_heads,
            causal=True,
            implementation=s.implementation,
            block_q=s.block,
            block_k=s.block,
            rngs=rngs,
        )
        self.mlp_norm = nnx.RMSNorm(s.embed_dim, rngs=rngs)
        self.up = nnx.Linear(s.embed_dim, 4 * s.embed_dim, rngs=rngs)
        self.down = nnx.Linear(4 * s.embed_dim, s.embed_dim, rngs=rngs)

    def __call__(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))


class Decoder(nnx.Module):
    """Token and learned position embeddings, ``layers`` blocks, and a vocabulary head."""

    def __init__(self, s: Settings, rngs: nnx.Rngs):
        length = 2 * s.copy_len - 1
        self.tokens = nnx.Embed(s.vocab, s.embed_dim, rngs=rngs)
        self.positions = nnx.Param(0.02 * jax.random.normal(rngs.params(), (length, s.embed_dim)))
        self.blocks = nnx.List([Block(s, rngs) for _ in range(s.layers)])
        self.norm = nnx.RMSNorm(s.embed_dim, rngs=rngs)
        self.head = nnx.Linear(s.embed_dim, s.vocab, rngs=rngs)

    def __call__(self, tokens):
        """``tokens [batch, len]`` -> logits ``[batch, len, vocab]``."""
        x = self.tokens(tokens) + self.positions[...][: tokens.shape[-1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def copy_batch(key, s: Settings):
    """``(inputs, targets)``, each ``[batch, 2·copy_len - 1]``; only the second half of
    the targets (the copy) is scored."""
    half = jax.random.randint(key, (s.batch, s.copy_len), 0, s.vocab)
    sequence = jnp.concatenate([half, half], axis=1)
    return sequence[:, :-1], sequence[:, 1:]


def _loss(model: Decoder, inputs, targets, copy_len: int):
    logits = model(inputs)[:, copy_len - 1 :]
    targets = targets[:, copy_len - 1 :]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == targets)


def train(s: Settings, log_every: int = 0) -> dict[str, list[float]]:
    """Trains from a fixed initialisation and data stream; returns the per-step loss and
    copy accuracy."""
    model = Decoder(s, nnx.Rngs(s.seed))
    optimizer = nnx.Optimizer(model, optax.adam(s.learning_rate), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, key):
        inputs, targets = copy_batch(key, s)
        grad_fn = nnx.value_and_grad(_loss, has_aux=True)
        (loss, accuracy), grads = grad_fn(model, inputs, targets, s.copy_len)
        optimizer.update(model, grads)
        return loss, accuracy

    data = jax.random.key(s.seed + 1)
    curve = {"loss": [], "accuracy": []}
    start = time.perf_counter()
    for i in range(s.steps):
        loss, accuracy = step(model, optimizer, jax.random.fold_in(data, i))
        curve["loss"].append(float(loss))
        curve["accuracy"].append(float(accuracy))
        if log_every and (i % log_every == 0 or i == s.steps - 1):
            print(
                f"step {i:4d}  loss {float(loss):.4f}  copy accuracy {float(accuracy):.3f}  ({time.perf_counter() - start:.1f}s)"
            )
    return curve


def curve_difference(curve, reference) -> float:
    """Largest per-step relative difference between two loss curves."""
    a, b = np.asarray(curve), np.asarray(reference)
    return float(np.max(np.abs(a - b) / np.abs(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--implementation", default=None, help="jaxtile implementation (default: the platform's)")
    parser.add_argument("--compare-reference", action="store_true", help='also train with implementation="reference"')
    parser.add_argument("--out", default=None, help="write the curve(s) here as JSON")
    args = parser.parse_args()

    settings = Settings(steps=args.steps, implementation=args.implementation)
    print(f"training on {jax.default_backend()}: {settings}")
    result = {"settings": dataclasses.asdict(settings), "jaxtile": train(settings, log_every=25)}
    if args.compare_reference:
        print('again with implementation="reference"')
        result["reference"] = train(dataclasses.replace(settings, implementation="reference"), log_every=100)
        result["max_relative_loss_difference"] = curve_difference(
            result["jaxtile"]["loss"], result["reference"]["loss"]
        )
        print(f"largest per-step relative loss difference: {result['max_relative_loss_difference']:.2e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
