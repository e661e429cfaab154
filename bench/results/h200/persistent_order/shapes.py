"""The forward on the shapes whose schedule `v3._queries_first` changes and the perf
check does not time (non-causal GQA and MQA), beside cuDNN and tokamax in the same
process. Run once per version, each from its own directory holding ``jaxtile`` and
``bench`` (``run.sh``); the ``jaxtile`` imported and its commit are printed first."""

import json

import jaxtile
from bench.check import Shape, run
from bench.probe import git_state

SHAPES = (
    Shape("gqa_32_8_full_8k", 2, 8192, 32, 128, kv_heads=8),
    Shape("mqa_16_1_full_8k", 2, 8192, 16, 128, kv_heads=1),
)

if __name__ == "__main__":
    print(jaxtile.__file__, json.dumps(git_state()), flush=True)
    run(SHAPES, ("fwd",), budget_s=0.5, floors={})
