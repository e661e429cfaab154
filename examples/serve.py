"""Greedy generation from a paged key/value cache with `jaxtile.paged_attention`.

A tiny decoder-only transformer (random weights from a seed, grouped-query attention,
RoPE) serves a batch of prompts of different lengths. Each layer keeps its keys and
values in a pool of pages ``[num_kv_heads, num_pages, page_size, head_dim]``; each
sequence owns a row of the page table, filled from a free list as the sequence grows.
Prefill runs every prompt at once (padded to the longest; ``q_lengths`` marks the real
queries, causal), then each decode step writes the new token's key and value into its
page slot and attends over the cache up to ``kv_lengths``.

``--attention xla`` runs the same loop with ``jax.nn.dot_product_attention`` over the
gathered cache instead; by default both run, and must generate the same tokens (on a
GPU, XLA's float32 products default to TF32, so there the logits differ by ~1e-3).

    python examples/serve.py
    python examples/serve.py --attention jaxtile --batch 8 --prompt-len 512 --new-tokens 64 --time

The default runs at toy size on CPU in a few seconds.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxtile


@dataclasses.dataclass(frozen=True)
class Settings:
    """Model, batch and cache geometry."""

    vocab: int = 128
    embed_dim: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    layers: int = 2
    batch: int = 4
    prompt_len: int = 12  # the longest prompt; the others are shorter
    new_tokens: int = 8
    page_size: int = 4
    seed: int = 0

    @property
    def pages_per_sequence(self) -> int:
        return -(-(self.prompt_len + self.new_tokens) // self.page_size)

    @property
    def num_pages(self) -> int:
        return self.batch * self.pages_per_sequence


def init_params(s: Settings) -> dict:
    """Random weights, scaled by ``1 / sqrt(fan_in)``."""
    keys = iter(jax.random.split(jax.random.key(s.seed), 2 + 6 * s.layers))

    def dense(fan_in, fan_out):
        return jax.random.normal(next(keys), (fan_in, fan_out)) / math.sqrt(fan_in)

    q_dim, kv_dim = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    layer_shapes = dict(
        wq=(s.embed_dim, q_dim),
        wk=(s.embed_dim, kv_dim),
        wv=(s.embed_dim, kv_dim),
        wo=(q_dim, s.embed_dim),
        up=(s.embed_dim, 4 * s.embed_dim),
        down=(4 * s.embed_dim, s.embed_dim),
    )
    return dict(
        embed=jax.random.normal(next(keys), (s.vocab, s.embed_dim)),
        layers=[{name: dense(*shape) for name, shape in layer_shapes.items()} for _ in range(s.layers)],
        unembed=dense(s.embed_dim, s.vocab),
    )


def rms_norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def rope(x, positions):
    """Rotary position embedding of ``x [batch, len, heads, head_dim]`` at ``positions [batch, len]``."""
    half = x.shape[-1] // 2
    angles = positions[..., None, None] * 10000.0 ** (-jnp.arange(half) / half)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class PageTable:
    """Host-side bookkeeping: a free list of pages and each sequence's row of the table.
    Entries past a sequence's pages stay 0; they lie past its length, so no attention
    reads them unmasked."""

    def __init__(self, s: Settings):
        self.page_size = s.page_size
        self.free = collections.deque(range(s.num_pages))
        self.table = np.zeros((s.batch, s.pages_per_sequence), np.int32)
        self.used = np.zeros(s.batch, np.int64)

    def reserve(self, lengths) -> jax.Array:
        """Gives sequence ``b`` pages for its first ``lengths[b]`` positions; returns the table."""
        for b, length in enumerate(lengths):
            while self.used[b] * self.page_size < length:
                self.table[b, self.used[b]] = self.free.popleft()
                self.used[b] += 1
        return jnp.asarray(self.table)


def gather(pages, page_table):
    """The contiguous cache ``[batch, pages_per_sequence * page_size, num_kv_heads, head_dim]``."""
    num_kv_heads, _, page_size, head_dim = pages.shape
    batch, pages_per_sequence = page_table.shape
    gathered = pages[:, page_table].reshape(num_kv_heads, batch, pages_per_sequence * page_size, head_dim)
    return gathered.transpose(1, 2, 0, 3)


def jaxtile_attention(q, k_pages, v_pages, page_table, q_lengths, kv_lengths):
    return jaxtile.paged_attention(q, k_pages, v_pages, page_table, kv_lengths, q_lengths=q_lengths, causal=True)


def xla_attention(q, k_pages, v_pages, page_table, q_lengths, kv_lengths):
    """The same with ``jax.nn.dot_product_attention`` over the gathered cache. Its
    ``is_causal`` puts query ``i`` at position ``i`` (right for a prefill from an empty
    cache only), so a dense mask places it at ``i + kv_lengths - q_lengths`` as jaxtile
    does, for a decode step (the last position) and any prefill chunk alike."""
    keys, values = gather(k_pages, page_table), gather(v_pages, page_table)
    positions = (kv_lengths - q_lengths)[:, None] + jnp.arange(q.shape[1])  # [batch, q_len]
    mask = jnp.arange(keys.shape[1]) <= positions[..., None]  # [batch, q_len, kv_len]
    return jax.nn.dot_product_attention(
        q, keys, values, mask=mask[:, None], key_value_seq_lengths=kv_lengths, implementation="xla"
    )


ATTENTIONS = {"jaxtile": jaxtile_attention, "xla": xla_attention}


@jax.jit(static_argnames=("s", "attention"), donate_argnames="caches")
def forward(params, tokens, caches, page_table, q_lengths, kv_lengths, *, s: Settings, attention):
    """Runs ``tokens [batch, len]`` (the first ``q_lengths[b]`` of row ``b`` real, the last
    positions of caches ``kv_lengths`` long) through the model: writes their keys and
    values into each layer's ``(k_pages, v_pages)`` and returns the logits and caches."""
    batch, length = tokens.shape
    positions = (kv_lengths - q_lengths)[:, None] + jnp.arange(length)
    # The page slot of each token; padding goes to page num_pages, out of range: dropped.
    real = jnp.arange(length) < q_lengths[:, None]
    pages = jnp.take_along_axis(page_table, positions // s.page_size, axis=1, mode="clip")
    pages, offsets = jnp.where(real, pages, s.num_pages), positions % s.page_size
    x = params["embed"][tokens]
    written = []
    for layer, (k_pages, v_pages) in zip(params["layers"], caches):
        h = rms_norm(x)
        q = rope((h @ layer["wq"]).reshape(batch, length, s.num_heads, s.head_dim), positions)
        k = rope((h @ layer["wk"]).reshape(batch, length, s.num_kv_heads, s.head_dim), positions)
        v = (h @ layer["wv"]).reshape(batch, length, s.num_kv_heads, s.head_dim)
        k_pages = k_pages.at[:, pages, offsets].set(k.transpose(2, 0, 1, 3), mode="drop")
        v_pages = v_pages.at[:, pages, offsets].set(v.transpose(2, 0, 1, 3), mode="drop")
        out = attention(q, k_pages, v_pages, page_table, q_lengths, kv_lengths)
        x = x + out.reshape(batch, length, -1) @ layer["wo"]
        x = x + jax.nn.gelu(rms_norm(x) @ layer["up"]) @ layer["down"]
        written.append((k_pages, v_pages))
    return rms_norm(x) @ params["unembed"], written


def make_prompts(s: Settings) -> tuple[jax.Array, np.ndarray]:
    """Random prompts ``[batch, prompt_len]`` (right-padded with 0) and their lengths
    (the first is ``prompt_len``, the others random)."""
    rng = np.random.default_rng(s.seed)
    lengths = rng.integers(1, s.prompt_len + 1, s.batch)
    lengths[0] = s.prompt_len
    tokens = rng.integers(0, s.vocab, (s.batch, s.prompt_len)) * (np.arange(s.prompt_len) < lengths[:, None])
    return jnp.asarray(tokens, jnp.int32), lengths.astype(np.int32)


def generate(params, prompts, prompt_lengths: np.ndarray, s: Settings, attention: str):
    """Greedy generation of ``s.new_tokens`` per prompt: prefill, then decode steps.
    Returns the tokens ``[batch, new_tokens]``, the logits they were chosen from
    ``[batch, new_tokens, vocab]`` and the seconds of prefill and decode."""
    run = dict(s=s, attention=ATTENTIONS[attention])
    pool = (s.num_kv_heads, s.num_pages, s.page_size, s.head_dim)
    caches = [(jnp.zeros(pool), jnp.zeros(pool)) for _ in range(s.layers)]
    table = PageTable(s)
    lengths = jnp.asarray(prompt_lengths)

    start = time.perf_counter()
    logits, caches = forward(params, prompts, caches, table.reserve(prompt_lengths), lengths, lengths, **run)
    logits = jax.block_until_ready(logits[jnp.arange(s.batch), lengths - 1])
    prefill_seconds = time.perf_counter() - start

    start = time.perf_counter()
    chosen, tokens = [logits], [jnp.argmax(logits, axis=-1)]
    ones = jnp.ones(s.batch, jnp.int32)
    for step in range(1, s.new_tokens):
        page_table = table.reserve(prompt_lengths + step)
        logits, caches = forward(params, tokens[-1][:, None], caches, page_table, ones, lengths + step, **run)
        chosen.append(logits[:, 0])
        tokens.append(jnp.argmax(logits[:, 0], axis=-1))
    tokens, logits = jax.block_until_ready((jnp.stack(tokens, 1), jnp.stack(chosen, 1)))
    return np.asarray(tokens), np.asarray(logits), (prefill_seconds, time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=Settings.batch)
    parser.add_argument("--prompt-len", type=int, default=Settings.prompt_len, help="the longest prompt")
    parser.add_argument("--new-tokens", type=int, default=Settings.new_tokens)
    parser.add_argument("--page-size", type=int, default=Settings.page_size)
    parser.add_argument("--layers", type=int, default=Settings.layers)
    parser.add_argument("--attention", choices=tuple(ATTENTIONS), help="run only this one (default: both, compared)")
    parser.add_argument("--time", action="store_true", help="time a second run, after a warm-up")
    args = parser.parse_args(argv)

    s = Settings(
        batch=args.batch,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        page_size=args.page_size,
        layers=args.layers,
    )
    params = init_params(s)
    prompts, prompt_lengths = make_prompts(s)
    print(f"on {jax.default_backend()}: {s}; prompt lengths {prompt_lengths.tolist()}")
    generated = {}
    for name in [args.attention] if args.attention else list(ATTENTIONS):
        tokens, logits, seconds = generate(params, prompts, prompt_lengths, s, name)
        if args.time:
            tokens, logits, seconds = generate(params, prompts, prompt_lengths, s, name)
            prefill, decode = seconds
            decoded = s.batch * (s.new_tokens - 1)
            print(
                f"{name}: prefill {prompt_lengths.sum() / prefill:.0f} tokens/s ({prefill * 1e3:.1f} ms), "
                f"decode {decoded / decode:.0f} tokens/s ({decode * 1e3:.1f} ms for {decoded})"
            )
        for b, row in enumerate(tokens):
            print(f"{name:8s} sequence {b}: {row.tolist()}")
        generated[name] = tokens, logits
    if len(generated) < 2:
        return 0
    (tokens, logits), (xla_tokens, xla_logits) = generated["jaxtile"], generated["xla"]
    difference = np.abs(logits - xla_logits).max() / np.abs(xla_logits).max()
    same = np.array_equal(tokens, xla_tokens)
    print(f"jaxtile and xla tokens {'identical' if same else 'DIFFER'}; largest logit difference {difference:.1e}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
