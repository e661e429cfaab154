"""``examples/train_decoder.py``: the loss curve with jaxtile equals the reference's."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from parity.compare import TOLERANCES, compare

pytest.importorskip("flax")
pytest.importorskip("optax")

_PATH = Path(__file__).resolve().parent.parent / "examples" / "train_decoder.py"


def _example():
    spec = importlib.util.spec_from_file_location("train_decoder", _PATH)
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
