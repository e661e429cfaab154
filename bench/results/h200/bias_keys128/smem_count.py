"""`Tuning.shared_memory` (the forward's count) against Mosaic GPU's own ``smem_bytes``
on 140 forward configurations: five calls of `tests/test_mosaic.py`, seven runtime
masks and biases, four tilings. Mosaic's count is read off the error it raises past a
bound made small (``_SMEM_SIZE_BOUND``, jax 0.10.2, off the GPU). Prints the number of
configurations and the least and largest excess of the model. Run from the repository
root: ``PYTHONPATH=. python bench/results/h200/bias_keys128/smem_count.py``."""

import re
import sys

import jax
import jax.experimental.mosaic.gpu.core as mosaic_gpu_core

sys.path.insert(0, "tests")
from test_mosaic import CALLS, _call

from jaxtile._core import Shape
from jaxtile.mosaic import v3

mosaic_gpu_core._SMEM_SIZE_BOUND = 1000
diffs = []
for name in ["causal", "full_d64", "window_gqa_ragged_d80_v48", "d256_causal", "two_sided_window_soft_cap"]:
    for runtime in ["", "segments", "dense", "bias", "bias32+dense", "segments+bias", "dense+segments+bias"]:
        for bk, st, pers in [(64, 2, False), (128, 2, False), (64, 3, True), (128, 2, True)]:
            inputs, config = _call(
                *CALLS[name], runtime=runtime, tuning=v3.Tuning(block_k=bk, num_stages=st, persistent=pers)
            )
            if "bias" in runtime and not v3._bias_everywhere(inputs):
                continue
            hd, hdv, tuning, beside = v3._plan(inputs, config)
            model = tuning.shared_memory(hd, hdv, Shape.of(inputs.q, inputs.k, inputs.v).itemsize, beside)
            try:
                jax.jit(lambda i, config=config: v3.forward_pass(i, config)).trace(inputs).lower(
                    lowering_platforms=("cuda",)
                )
                print("no error?", name, runtime)
                continue
            except Exception as e:
                m = re.search(r"smem_bytes=(\d+)", str(e))
                if not m:
                    print("other error", name, runtime, bk, st, pers, str(e)[:200])
                    continue
                real = int(m.group(1))
            diffs.append(model - real)
            if model < real:
                print("UNDER", name, runtime, tuning, model, real)
print(len(diffs), min(diffs), max(diffs))
