"""MQA at head dim 256 (the backward with roles takes no query-head shares): forward+backward
beside cuDNN, in one process."""

import jax

import jaxtile
from bench import check

print(jaxtile.__file__, jax.__version__, jax.devices()[0].device_kind, flush=True)
for shape in (
    check.Shape("mqa_d256_b1_4k", 1, 4096, 16, 256, kv_heads=1, causal=True),
    check.Shape("mqa_d256_b1_8k", 1, 8192, 16, 256, kv_heads=1, causal=True),
    check.Shape("mqa_d256_b2_8k", 2, 8192, 16, 256, kv_heads=1, causal=True),
):
    for mode in ("fwd", "fwdbwd"):
        j = min(check._timed(check._jaxtile(shape), shape, mode, 0.5)["ms"] for _ in range(2))
        c = min(check._timed(check._cudnn(shape), shape, mode, 0.5)["ms"] for _ in range(2))
        tf = shape.flops(mode) / j / 1e9
        print(f"{shape.name} {mode} jaxtile {j:.3f} ms {tf:.0f} TFLOP/s cudnn {c:.3f} ms {c / j:.3f}x", flush=True)
