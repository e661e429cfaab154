"""pallas_v2 with dense masks (forward and forward+backward) beside cuDNN, one process:
the calls whose forward asked for 256 KiB of shared memory at head dim 128."""

import jax
import numpy as np

import jaxtile
from bench import check
from bench.probe import git_state

print(jaxtile.__file__, git_state(), jax.devices()[0].device_kind, flush=True)
SHAPES = [
    check.Shape("d64_4k_dense_unrecognised", 4, 4096, 32, 64, causal=True, dense_mask="unrecognised"),
    check.Shape("d128_4k_dense_unrecognised", 4, 4096, 16, 128, causal=True, dense_mask="unrecognised"),
    check.Shape("d128_8k_dense_causal", 2, 8192, 16, 128, causal=True, dense_mask="flax"),
]


def pallas(q, k, v, bias=None, mask=None):
    return jaxtile.flash_attention(q, k, v, mask=mask, implementation="pallas_v2")


for shape in SHAPES:
    for mode in ("fwd", "fwdbwd"):
        cudnn = check._cudnn(shape)
        ms = {"pallas_v2": [], "cudnn": []}
        for _ in range(2):
            for name, attend in (("pallas_v2", pallas), ("cudnn", cudnn)):
                row = check._timed(attend, shape, mode, 0.5)
                ms[name].append(row.get("ms", float("nan")))
                if "error" in row:
                    print(shape.name, mode, name, str(row["error"])[:300], flush=True)
        med = {n: float(np.median(v)) for n, v in ms.items()}
        flops = shape.flops(mode)
        print(
            f"{shape.name:28s} {mode:6s}",
            " ".join(f"{n}={m:.3f}ms/{flops / m / 1e9:.0f}TF" for n, m in med.items()),
            f"pallas_v2/cudnn={med['cudnn'] / med['pallas_v2']:.3f}",
            flush=True,
        )
