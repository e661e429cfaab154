"""The examples: ``train_decoder.py``'s loss curve with jaxtile equals the reference's;
``serve.py`` generates the same tokens with jaxtile's paged attention and with XLA's;
``train_gpt.py`` trains the same model on jaxtile and on jax.nn (sinks folded in exactly)."""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parity.compare import TOLERANCES, compare

pytest.importorskip("flax")
pytest.importorskip("optax")

_EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _example(name: str = "train_decoder"):
    spec = importlib.util.spec_from_file_location(name, _EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_training_curve_matches_reference_step_by_step():
    example = _example()
    # Tiles of 16 so that the causal tile loops run (the sequences are 47 long).
    settings = example.Settings(steps=30, block=16)
    curve = example.train(settings)["loss"]
    reference = example.train(example.Settings(steps=30, implementation="reference"))["loss"]
    error = compare(np.asarray(curve), np.asarray(reference, np.float64), TOLERANCES["float32"])
    assert error.ok, f"loss curves differ: {error}\njaxtile   {curve}\nreference {reference}"
    assert curve[-1] < 0.9 * curve[0], f"the model did not learn: {curve}"


@jax.default_matmul_precision("highest")  # on GPUs float32 products default to TF32 in XLA
def test_serve_paged_decoding_matches_xla_and_a_full_pass(capsys):
    serve = _example("serve")
    s = serve.Settings()
    params = serve.init_params(s)
    prompts, prompt_lengths = serve.make_prompts(s)
    assert len(set(prompt_lengths.tolist())) > 1, prompt_lengths
    tokens, logits, _ = serve.generate(params, prompts, prompt_lengths, s, "jaxtile")
    xla_tokens, xla_logits, _ = serve.generate(params, prompts, prompt_lengths, s, "xla")
    np.testing.assert_array_equal(tokens, xla_tokens)
    error = compare(logits, np.asarray(xla_logits, np.float64), TOLERANCES["float32"])
    assert error.ok, f"logits differ: {error}"

    # One prefill over each whole sequence (prompt, then the generated tokens but the
    # last) gives, position by position, the logits the decode steps chose from.
    lengths = prompt_lengths + s.new_tokens - 1
    sequences = np.zeros((s.batch, s.prompt_len + s.new_tokens - 1), np.int32)
    for b, n in enumerate(prompt_lengths):
        sequences[b, : n + s.new_tokens - 1] = [*np.asarray(prompts[b, :n]), *tokens[b, :-1]]
    pool = (s.num_kv_heads, s.num_pages, s.page_size, s.head_dim)
    caches = [(np.zeros(pool, np.float32), np.zeros(pool, np.float32)) for _ in range(s.layers)]
    page_table = serve.PageTable(s).reserve(lengths)
    full, _ = serve.forward(
        params, sequences, caches, page_table, lengths, lengths, s=s, attention=serve.jaxtile_attention
    )
    steps = prompt_lengths[:, None] - 1 + np.arange(s.new_tokens)
    full = np.take_along_axis(np.asarray(full), steps[..., None], axis=1)
    error = compare(logits, np.asarray(full, np.float64), TOLERANCES["float32"])
    assert error.ok, f"decode steps differ from one pass over the whole sequence: {error}"

    assert serve.main([]) == 0
    assert "jaxtile and xla tokens identical" in capsys.readouterr().out


def test_train_gpt_toy_loss_curves_of_jaxtile_and_jax_nn_agree(tmp_path):
    """The script as a user runs it (one subprocess per backend, merged JSON, the plot).
    Same initialisation and data, float32 on the CPU: the two attentions differ only in
    summation order (online softmax in tiles of 16 vs one dense softmax, ~1e-7 relative),
    and 8 AdamW steps do not amplify that past float32's shared tolerance (1e-5 relative
    L2, 1e-4 worst step; measured ~1e-7 over 20 steps)."""
    out = tmp_path / "toy.json"
    command = [sys.executable, str(_EXAMPLES / "train_gpt.py"), "--toy", "--steps", "8", "--log-every", "0"]
    command += ["--backends", "jaxtile,jax.nn-xla", "--out", str(out)]
    process = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stdout + process.stderr
    assert "tokens/s" in process.stdout and "jax.nn-xla" in process.stdout, process.stdout
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert list(runs) == ["jaxtile", "jax.nn-xla"]
    for run in runs.values():
        assert len(run["loss"]) == len(run["step_time_s"]) == 8
        assert np.isfinite(run["loss"]).all() and run["tokens_per_s"] > 0 and run["peak_bytes"] > 0, run
    assert runs["jaxtile"]["parameters"] == runs["jax.nn-xla"]["parameters"]
    assert result["settings"]["seq_len"] == 64 and not result["settings"]["plain"]
    curve, reference = runs["jaxtile"]["loss"], runs["jax.nn-xla"]["loss"]
    error = compare(np.asarray(curve), np.asarray(reference, np.float64), TOLERANCES["float32"])
    assert error.ok, f"loss curves differ: {error}\njaxtile    {curve}\njax.nn-xla {reference}"

    from bench import plot_training

    plot_training.main([str(out), "--out", str(tmp_path / "curve.png")])
    assert (tmp_path / "curve.png").stat().st_size > 0


@pytest.mark.parametrize("window", [None, (15, 0)], ids=["causal", "window"])
@jax.default_matmul_precision("highest")  # the xla reference's products, TF32 on GPUs otherwise
def test_train_gpt_sinks_fold_into_jax_nn_exactly(window):
    """jax.nn's output times ``sigmoid(lse - sink)``, with the lse's gradient restored
    (jax.nn stops it), equals jaxtile's sinks: outputs and the gradients of q, k, v and
    the sinks, on random float32 inputs of the toy's shapes (GQA, packed documents)."""
    gpt = _example("train_gpt")
    s = gpt.TOY
    keys = jax.random.split(jax.random.key(1), 5)
    q = jax.random.normal(keys[0], (s.batch, s.seq_len, s.num_heads, s.head_dim))
    k = jax.random.normal(keys[1], (s.batch, s.seq_len, s.num_kv_heads, s.head_dim))
    v = jax.random.normal(keys[2], k.shape)
    sinks = jax.random.normal(keys[3], (s.num_heads,))
    cotangent = jax.random.normal(keys[4], q.shape)
    segment_ids = jnp.asarray(gpt.make_batch(s, 0)["segment_ids"])
    assert len(np.unique(segment_ids)) > 2, segment_ids

    def loss(attention, q, k, v, sinks):
        out = attention(q, k, v, window=window, segment_ids=segment_ids, sinks=sinks, block=s.block)
        return jnp.sum(out * cotangent), out

    def stopped_residual_fold(q, k, v, *, window, segment_ids, sinks, block):  # the fold without the restored gradient
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
        out, lse = jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=True, local_window_size=window, implementation="xla", return_residual=True
        )
        return out * jax.nn.sigmoid(lse - sinks)[..., None]

    def grads(attention):
        grad = jax.grad(functools.partial(loss, attention), argnums=(0, 1, 2, 3), has_aux=True)
        return jax.jit(grad)(q, k, v, sinks)

    (dq, dk, dv, dsinks), out = grads(gpt.jaxtile_attention)
    (xq, xk, xv, xsinks), xla_out = grads(gpt.xla_attention)
    for name, x, ref in [
        ("out", xla_out, out),
        ("dq", xq, dq),
        ("dk", xk, dk),
        ("dv", xv, dv),
        ("dsinks", xsinks, dsinks),
    ]:
        error = compare(np.asarray(x), np.asarray(ref, np.float64), TOLERANCES["float32"])
        assert error.ok, f"{name}: jax.nn-xla with folded sinks differs from jaxtile: {error}"

    (stopped_dq, *_), _ = grads(stopped_residual_fold)
    assert not compare(np.asarray(stopped_dq), np.asarray(dq, np.float64), TOLERANCES["float32"]).ok, (
        "jax.nn's residual now carries a gradient: xla_attention's restored term is counted twice"
    )
