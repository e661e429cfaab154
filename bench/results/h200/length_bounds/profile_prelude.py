"""What a call with per-sequence lengths runs around its attention kernel (H200).

Each call is jitted, warmed up, then run back to back under `jax.profiler.trace`
(`bench.profile`): jaxtile's default and cuDNN (``jax.nn.dot_product_attention``) on the
decode benchmark's single-query shapes, full and ragged (`bench.decode`), and a ragged
causal prefill (8 sequences of up to 2K, head dim 128) on mosaic_v3, forward and
forward+backward. Usage: PYTHONPATH=. python profile_prelude.py OUT
"""

import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxtile
from bench import decode
from bench.profile import summarise, traced

CALLS = 20


def show(name, fn, args):
    run = jax.jit(fn)
    for _ in range(3):
        jax.block_until_ready(run(*args))
    with tempfile.TemporaryDirectory() as tmp:
        traced(lambda: run(*args), Path(tmp), CALLS)
        print(f"== {name}\n{summarise(Path(tmp), CALLS, top=8)}", flush=True)


def main(out: Path):
    print("jaxtile from", jaxtile.__file__, "on", jax.devices()[0].device_kind, "jax", jax.__version__)
    for case in decode.CASES[:3]:
        q, k, v = decode._inputs(case)
        ragged = jnp.asarray(decode._kv_lengths(case))
        for layout, lengths in (("dense", None), ("ragged", ragged)):
            show(
                f"{case.name} {layout} jaxtile",
                lambda q, k, v, L: decode._jaxtile(q, k, v, L, implementation=None),
                (q, k, v, lengths),
            )
            show(f"{case.name} {layout} cudnn", decode._cudnn, (q, k, v, lengths))
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((8, 2048, 16, 128), np.float32)).astype(jnp.bfloat16) for _ in range(3))
    lengths = jnp.asarray(rng.integers(1024, 2048, 8, endpoint=True).astype(np.int32))

    def prefill(q, k, v, L):
        return jaxtile.flash_attention(q, k, v, causal=True, q_lengths=L, kv_lengths=L)

    def loss(q, k, v, L):
        return jax.grad(lambda q, k, v: prefill(q, k, v, L).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)

    show("prefill 8x2K ragged causal d128 fwd", prefill, (q, k, v, lengths))
    show("prefill 8x2K ragged causal d128 fwdbwd", loss, (q, k, v, lengths))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
