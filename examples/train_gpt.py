"""Trains a GPT-style decoder once per attention backend, from the same initialisation and
data, and writes per-step loss, step time, tokens/s and peak memory of each to one JSON.

The model (Flax NNX): tied token embeddings, pre-norm blocks of grouped-query attention
with rotary embeddings and a GELU MLP, RMSNorm. Attention is causal on every layer, with
a sliding window of the last ``window`` tokens on odd layers; each batch row packs
documents of random lengths (``segment_ids``; attention never crosses a document); every
layer learns one attention-sink logit per query head (gpt-oss), initialised to 0.

Backends (``--backends``, a comma list; each runs in its own subprocess of this script,
``--only BACKEND``, so that each gets its own peak memory):

* ``jaxtile``: `jaxtile.dot_product_attention` with ``segment_ids`` and ``sinks``.
* ``jax.nn-xla``: ``jax.nn.dot_product_attention(implementation="xla")`` with a dense
  ``[batch, 1, seq, seq]`` document mask and the sinks folded into its output through its
  log-sum-exp residual (`xla_attention` says how, gradient included).
* ``jax.nn-cudnn`` (GPU, needs ``--plain``): cuDNN can express neither the sinks (its
  residual carries no gradient) nor cheap packed documents, so ``--plain`` trains the
  model without them (causal, windows on odd layers, attention across documents), with
  ``jaxtile`` or ``jax.nn-cudnn``.

Data: synthetic, seeded NumPy, the same for every backend. Each document is a random
token prefix followed by its repetition (a copy task inside each document); the loss is
taken on the repeated half only, less its first token (that the copy starts there cannot
be known). Tokens are uniform over the vocabulary, so no model does better than
``ln(vocab)`` (10.40 at the GPU size) without attending back within its document: below
that, the loss measures copying. 19 documents in 20 are short (8 to 64 tokens), so that
copying is learnt within the 200 steps at the GPU size (with 256 to 2048-token documents
alone the loss stayed at ``ln(vocab)`` for 1500 steps on an H100), and one in 20 long
(64 to 2048 tokens, over half of the tokens), so that the windows cut into documents.

    python examples/train_gpt.py --toy --steps 20 --out toy.json            # CPU, seconds
    python examples/train_gpt.py --out gpt.json                             # GPU, 101M params
    python examples/train_gpt.py --plain --backends jaxtile,jax.nn-cudnn --out gpt_plain.json
    python -m bench.plot_training gpt.json --out curve.png

Timing: the train step is jitted whole (compile time reported apart); the first
``WARMUP_STEPS`` steps are left out, every step is blocked on, and tokens/s is
``batch * seq_len`` over the median step time. Peak memory is the device's
``peak_bytes_in_use`` where it has one (GPU), else the compiled step's temp + argument
bytes (``memory_analysis``, CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxtile
from bench.probe import git_state
from jaxtile.nn import rotary

WARMUP_STEPS = 2  # steps left out of the timing


@dataclasses.dataclass(frozen=True)
class Settings:
    """Model, data and optimiser of one run; the defaults are the GPU size (101M parameters)."""

    vocab: int = 32768
    d_model: int = 768
    layers: int = 12
    num_heads: int = 12
    num_kv_heads: int = 4
    head_dim: int = 64
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * d_model
    rope_theta: float = 10000.0
    seq_len: int = 4096
    batch: int = 2
    window: int = 1024  # odd layers see the last `window` tokens, their own included
    doc_min: int = 8  # document lengths, even: a share `long_docs` of the documents
    doc_mid: int = 64  # uniform in [doc_mid, doc_max], the others in [doc_min, doc_mid]
    doc_max: int = 2048
    long_docs: float = 0.05
    plain: bool = False  # no sinks, no packed documents
    dtype: str = "bfloat16"  # compute dtype; parameters and optimiser state are float32
    block: int | None = None  # jaxtile's block_q = block_k; None: its default
    steps: int = 200
    warmup_steps: int = 20  # learning-rate warmup
    learning_rate: float = 1e-3
    weight_decay: float = 0.1
    seed: int = 0


TOY = Settings(
    vocab=64,
    d_model=32,
    layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    seq_len=64,
    window=16,
    doc_min=8,
    doc_mid=16,
    doc_max=32,
    dtype="float32",
    block=16,  # so that jaxtile's tile loops (and their skipping) run at seq_len 64
    steps=20,
    warmup_steps=5,
    learning_rate=3e-3,
)


# --- attention backends: (q [b, t, h, d], k, v [b, t, kv_h, d]) -> [b, t, h, d] ---------


def jaxtile_attention(q, k, v, *, window, segment_ids, sinks, block=None):
    """`jaxtile.dot_product_attention`: causal, ``window`` ``(left, 0)`` or None,
    ``segment_ids [b, t]`` or None, ``sinks [h]`` or None."""
    return jaxtile.dot_product_attention(
        q,
        k,
        v,
        is_causal=True,
        local_window_size=window,
        segment_ids=segment_ids,
        sinks=sinks,
        block_q=block,
        block_k=block,
    )


def xla_attention(q, k, v, *, window, segment_ids, sinks, block=None):
    """``jax.nn.dot_product_attention(implementation="xla")``, the documents as a dense
    ``[b, 1, t, t]`` mask, the sinks folded in exactly.

    A sink adds ``exp(sink)`` to each row's softmax denominator and nothing to its
    numerator, so with ``lse`` the row's log-sum-exp, ``out_sink = out · exp(lse) /
    (exp(lse) + exp(sink)) = out · sigmoid(lse - sink)``. jax.nn returns ``lse`` as a
    residual under ``stop_gradient``, and the fold needs its gradient: ``∂lse_i = scale ·
    Σ_j p_ij (k_j·∂q_i + q_i·∂k_j)``. A term that is 0 in value restores it:
    ``scale · q_i·m_i`` less its stopped self, with ``m_i = Σ_j p_ij k_j`` the attention
    over ``k`` as values, its probabilities stopped. XLA computes the scores and
    probabilities of the two calls once; the restored gradient costs two more products
    of the attention's size (8 instead of 6). ``block`` is jaxtile's; unused.
    """
    del block
    mask = None if segment_ids is None else (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    attend = functools.partial(
        jax.nn.dot_product_attention, mask=mask, is_causal=True, local_window_size=window, implementation="xla"
    )
    if sinks is None:
        return attend(q, k, v)
    out, lse = attend(q, k, v, return_residual=True)
    m = attend(jax.lax.stop_gradient(q), jax.lax.stop_gradient(k), k)
    lse_tangent = q.shape[-1] ** -0.5 * jnp.sum(q * m, axis=-1, dtype=jnp.float32)  # [b, t, h]
    lse = lse.astype(jnp.float32) + (lse_tangent - jax.lax.stop_gradient(lse_tangent))
    return (out * jax.nn.sigmoid(lse - sinks)[..., None]).astype(out.dtype)


def cudnn_attention(q, k, v, *, window, segment_ids, sinks, block=None):
    """``jax.nn.dot_product_attention(implementation="cudnn")``: causal and ``window``
    only (``segment_ids`` and ``sinks`` must be None: the plain model)."""
    assert segment_ids is None and sinks is None, "jax.nn-cudnn trains the --plain model"
    del block
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=window, implementation="cudnn")


BACKENDS = {"jaxtile": jaxtile_attention, "jax.nn-xla": xla_attention, "jax.nn-cudnn": cudnn_attention}


# --- model --------------------------------------------------------------------------------


class Block(nnx.Module):
    """Pre-norm block: GQA attention (rotary; causal; a window on odd layers; sinks unless
    plain), then a GELU MLP."""

    def __init__(self, s: Settings, layer: int, rngs: nnx.Rngs):
        self.s = s
        self.window = (s.window - 1, 0) if layer % 2 else None
        dense = functools.partial(nnx.Linear, use_bias=False, dtype=s.dtype, rngs=rngs)
        self.attention_norm = nnx.RMSNorm(s.d_model, dtype=s.dtype, rngs=rngs)
        self.qkv = dense(s.d_model, (s.num_heads + 2 * s.num_kv_heads) * s.head_dim)
        self.out = dense(s.num_heads * s.head_dim, s.d_model)
        self.sinks = None if s.plain else nnx.Param(jnp.zeros((s.num_heads,), jnp.float32))
        self.mlp_norm = nnx.RMSNorm(s.d_model, dtype=s.dtype, rngs=rngs)
        self.up = dense(s.d_model, s.mlp_ratio * s.d_model)
        self.down = dense(s.mlp_ratio * s.d_model, s.d_model)

    def __call__(self, x, segment_ids, attention):
        """``x [b, t, d_model]``, ``segment_ids [b, t]`` or None -> ``[b, t, d_model]``."""
        s = self.s
        q, k, v = jnp.split(
            self.qkv(self.attention_norm(x)),
            [s.num_heads * s.head_dim, (s.num_heads + s.num_kv_heads) * s.head_dim],
            axis=-1,
        )
        q = q.reshape(*q.shape[:-1], s.num_heads, s.head_dim)
        k = k.reshape(*k.shape[:-1], s.num_kv_heads, s.head_dim)
        v = v.reshape(*v.shape[:-1], s.num_kv_heads, s.head_dim)
        positions = jnp.arange(x.shape[-2])[None]
        q, k = rotary(q, positions, s.rope_theta), rotary(k, positions, s.rope_theta)
        sinks = None if self.sinks is None else self.sinks[...]
        out = attention(q, k, v, window=self.window, segment_ids=segment_ids, sinks=sinks, block=s.block)
        x = x + self.out(out.reshape(*out.shape[:-2], -1))
        return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))


class GPT(nnx.Module):
    """Tied token embedding, ``layers`` blocks, a final RMSNorm; logits through the
    embedding's transpose."""

    def __init__(self, s: Settings, rngs: nnx.Rngs):
        self.embed = nnx.Embed(s.vocab, s.d_model, dtype=s.dtype, rngs=rngs)
        self.blocks = nnx.List([Block(s, layer, rngs) for layer in range(s.layers)])
        self.norm = nnx.RMSNorm(s.d_model, dtype=s.dtype, rngs=rngs)

    def __call__(self, tokens, segment_ids, attention):
        """``tokens [b, t]`` -> float32 logits ``[b, t, vocab]``."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, segment_ids, attention)
        return self.embed.attend(self.norm(x)).astype(jnp.float32)


# --- data ---------------------------------------------------------------------------------


def make_batch(s: Settings, step: int) -> dict[str, np.ndarray]:
    """Batch ``step`` of the seeded stream: ``tokens``, ``targets`` (the next token),
    ``segment_ids`` (documents, from 1) and ``weights`` (1 where the target is a
    predictable token of a repeated half), each ``[batch, seq_len]``."""
    rng = np.random.default_rng((s.seed, step))
    tokens = np.zeros((s.batch, s.seq_len), np.int32)
    segment_ids = np.zeros_like(tokens)
    weights = np.zeros(tokens.shape, np.float32)
    for row in range(s.batch):
        start, doc = 0, 1
        while start < s.seq_len:
            low, high = (s.doc_mid, s.doc_max) if rng.random() < s.long_docs else (s.doc_min, s.doc_mid)
            length = min(2 * int(rng.integers(low // 2, high // 2 + 1)), s.seq_len - start)
            half = length // 2
            prefix = rng.integers(0, s.vocab, half, dtype=np.int32)
            tokens[row, start : start + length] = np.concatenate([prefix, prefix])
            segment_ids[row, start : start + length] = doc
            # Position t predicts token t + 1: score the repeated half after its first token.
            weights[row, start + half : start + length - 1] = 1.0
            start, doc = start + length, doc + 1
    targets = np.roll(tokens, -1, axis=1)
    return {"tokens": tokens, "targets": targets, "segment_ids": segment_ids, "weights": weights}


# --- training -----------------------------------------------------------------------------


def loss_fn(model: GPT, batch, s: Settings, attention):
    """Mean cross-entropy over the weighted (copied) positions."""
    segment_ids = None if s.plain else batch["segment_ids"]
    logits = model(batch["tokens"], segment_ids, attention)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.sum(losses * batch["weights"]) / jnp.sum(batch["weights"])


def optimizer(s: Settings) -> optax.GradientTransformation:
    """AdamW with linear warmup and cosine decay to 10%, gradients clipped to norm 1."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, s.learning_rate, s.warmup_steps, max(s.steps, s.warmup_steps + 1), s.learning_rate / 10
    )
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95, weight_decay=s.weight_decay))


def train(s: Settings, backend: str, log_every: int = 0) -> dict:
    """Trains ``s`` with one attention backend in this process; returns the run's record."""
    attention = BACKENDS[backend]
    model = GPT(s, nnx.Rngs(s.seed))
    parameters = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"[{backend}] {parameters / 1e6:.2f}M parameters on {jax.devices()[0].device_kind}", flush=True)
    graphdef, state = nnx.split((model, nnx.Optimizer(model, optimizer(s), wrt=nnx.Param)))
    del model

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, batch):
        model, opt = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch, s, attention)
        opt.update(model, grads)
        return nnx.state((model, opt)), loss

    batch = jax.device_put(make_batch(s, 0))
    start = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    losses, times = [], []
    for i in range(s.steps):
        batch = jax.block_until_ready(jax.device_put(make_batch(s, i)))
        start = time.perf_counter()
        state, loss = jax.block_until_ready(compiled(state, batch))
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
        if log_every and (i % log_every == 0 or i == s.steps - 1):
            print(f"[{backend}] step {i:4d}  loss {losses[-1]:.4f}  {1e3 * times[-1]:8.1f} ms", flush=True)
    median = float(np.median(times[WARMUP_STEPS:] or times))
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        peak, source = stats["peak_bytes_in_use"], "memory_stats peak_bytes_in_use"
    else:
        analysis = compiled.memory_analysis()
        peak, source = analysis.temp_size_in_bytes + analysis.argument_size_in_bytes, "memory_analysis temp + argument"
    return {
        "backend": backend,
        "loss": losses,
        "step_time_s": times,
        "compile_s": compile_s,
        "median_step_s": median,
        "tokens_per_s": s.batch * s.seq_len / median,
        "peak_bytes": int(peak),
        "peak_memory_source": source,
        "parameters": int(parameters),
        "device_kind": jax.devices()[0].device_kind,
        "platform": jax.default_backend(),
    }


def max_relative_difference(curve, reference) -> float:
    """Largest per-step relative difference between two loss curves."""
    a, b = np.asarray(curve), np.asarray(reference)
    return float(np.max(np.abs(a - b) / np.abs(b)))


def table(result: dict) -> str:
    """One line per backend: final loss, median step, tokens/s, peak memory, compile time."""
    lines = [f"{'backend':<14}{'final loss':>11}{'step ms':>10}{'tokens/s':>11}{'peak MiB':>10}{'compile s':>10}"]
    for name, run in result["runs"].items():
        if "error" in run:
            lines.append(f"{name:<14}  {run['error']}")
            continue
        lines.append(
            f"{name:<14}{run['loss'][-1]:>11.4f}{1e3 * run['median_step_s']:>10.2f}{run['tokens_per_s']:>11.0f}"
            f"{run['peak_bytes'] / 2**20:>10.1f}{run['compile_s']:>10.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--toy", action="store_true", help="the CPU size (seconds)")
    parser.add_argument("--plain", action="store_true", help="no sinks, no packed documents (for jax.nn-cudnn)")
    parser.add_argument("--steps", type=int, help="training steps (default: 200, toy 20)")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--backends", default="jaxtile,jax.nn-xla", help=f"comma list of {', '.join(BACKENDS)}")
    parser.add_argument("--only", choices=BACKENDS, help="run this backend in this process (what --backends spawns)")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--out", default="train_gpt.json")
    args = parser.parse_args(argv)

    overrides = {"steps": args.steps, "batch": args.batch, "seq_len": args.seq_len, "plain": args.plain or None}
    s = dataclasses.replace(TOY if args.toy else Settings(), **{k: v for k, v in overrides.items() if v is not None})
    backends = [args.only] if args.only else args.backends.split(",")
    for backend in backends:
        if backend not in BACKENDS:
            parser.error(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
        if backend == "jax.nn-cudnn" and not s.plain:
            parser.error("jax.nn-cudnn expresses neither sinks nor packed documents: add --plain")
    result = {"settings": dataclasses.asdict(s), "jax_version": jax.__version__, "git": git_state(), "runs": {}}

    if args.only:
        result["runs"][args.only] = train(s, args.only, args.log_every)
    else:
        # One process per backend: the device's peak memory is process-wide and only grows.
        with tempfile.TemporaryDirectory() as tmp:
            for backend in backends:
                path = Path(tmp) / f"{backend}.json"
                command = [sys.executable, __file__, *argv, "--only", backend, "--out", str(path)]
                code = subprocess.run(command).returncode
                if code:
                    result["runs"][backend] = {"backend": backend, "error": f"exited with status {code}"}
                else:
                    result["runs"][backend] = json.loads(path.read_text())["runs"][backend]
    runs = [run for run in result["runs"].values() if "error" not in run]
    if len(runs) > 1:
        result["max_relative_loss_difference"] = {
            run["backend"]: max_relative_difference(run["loss"], runs[0]["loss"]) for run in runs[1:]
        }
    Path(args.out).write_text(json.dumps(result, indent=1))
    if not args.only:
        print(table(result))
        for name, difference in result.get("max_relative_loss_difference", {}).items():
            print(f"largest per-step relative loss difference, {name} vs {runs[0]['backend']}: {difference:.2e}")
        print(f"wrote {args.out}")
    return int(len(runs) < len(result["runs"]))


if __name__ == "__main__":
    sys.exit(main())
