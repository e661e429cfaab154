"""The examples: ``train_decoder.py``'s loss curve with jaxtile equals the reference's;
``serve.py`` generates the same tokens with jaxtile's paged attention and with XLA's."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
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
