"""dQ formed in the dK/dV kernel (`BackwardTuning.fused_dq`: each step adds ``dS_ij K_j``
into a float32 dQ in global memory by TMA reduce-add, in no fixed order) against the two
kernels, at the call's default tiles (`v3.default_backward_tuning` patched to ask for it,
around the whole differentiation: the backward is traced after the forward returns, so a
patch around the forward alone leaves it out, as the first run of this script did,
`fused_ac2cc47_unpatched.log`).

1. Exactness: the gradients of both against float32 references on random inputs
   (causal, non-causal, GQA with a window and ragged lengths, head dim 80 padded to 128).
2. Speed: forward+backward of the check's head dim 128 rows and GQA, beside cuDNN and
   tokamax, one process, two passes, jax's caches cleared between variants.
"""

import contextlib
import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxtile
from bench import check
from jaxtile.mosaic import v3

ROWS = ("d128_4k_full", "d128_16k_full", "d128_4k_causal", "d128_16k_causal", "gqa_32_8_causal_8k")
CASES = {  # q shape, kv len, kv heads, causal, window
    "causal": ((2, 1024, 4, 128), 1024, 4, True, None),
    "full": ((1, 768, 4, 128), 768, 4, False, None),
    "gqa_window_ragged": ((1, 1000, 8, 128), 1000, 2, True, (100, 0)),
    "d80": ((1, 500, 4, 80), 700, 4, False, None),
}


@contextlib.contextmanager
def fused(on: bool):
    kept = v3.default_backward_tuning

    def tuning(*args, **kwargs):
        return dataclasses.replace(kept(*args, **kwargs), fused_dq=on)

    v3.default_backward_tuning = tuning
    try:
        yield
    finally:
        v3.default_backward_tuning = kept


def call(shape):
    def attend(q, k, v, bias=None, mask=None):
        return jaxtile.flash_attention(q, k, v, causal=shape.causal, window=shape.window, implementation="mosaic_v3")

    return attend


@functools.partial(jax.jit, static_argnames=("causal", "window", "impl", "on"))
def _grads(q, k, v, dout, kv_lengths, *, causal, window, impl, on):
    def loss(q, k, v):
        out = jaxtile.flash_attention(q, k, v, causal=causal, window=window, kv_lengths=kv_lengths, implementation=impl)
        return jnp.sum(out.astype(jnp.float32) * dout)

    with fused(on):  # the backward is traced after the forward returns: the patch spans both
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def exactness():
    for name, (q_shape, kv_len, kv_heads, causal, window) in CASES.items():
        keys = jax.random.split(jax.random.key(len(name)), 4)
        b, t, h, d = q_shape
        q = jax.random.normal(keys[0], q_shape, jnp.bfloat16)
        k = jax.random.normal(keys[1], (b, kv_len, kv_heads, d), jnp.bfloat16)
        v = jax.random.normal(keys[2], (b, kv_len, kv_heads, d), jnp.bfloat16)
        dout = jax.random.normal(keys[3], (b, t, h, d), jnp.float32)
        kv_lengths = jnp.array([kv_len - 37] * b, jnp.int32) if "ragged" in name else None
        grads = {}
        for label, impl, on, dtype in (
            ("reference", "reference", False, jnp.float32),
            ("two_kernels", "mosaic_v3", False, jnp.bfloat16),
            ("fused", "mosaic_v3", True, jnp.bfloat16),
        ):
            args = [x.astype(dtype) for x in (q, k, v)]
            grads[label] = _grads(*args, dout, kv_lengths, causal=causal, window=window, impl=impl, on=on)
        for label in ("two_kernels", "fused"):
            errors = []
            for got, want in zip(grads[label], grads["reference"], strict=True):
                got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
                errors.append(float(np.max(np.abs(got - want)) / np.max(np.abs(want))))
            print(f"{name:20s} {label:12s} max|err|/max|ref| dq {errors[0]:.2e} dk {errors[1]:.2e} dv {errors[2]:.2e}")


def main():
    stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
    print(jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind)
    exactness()
    for shape in (s for s in check.SHAPES if s.name in ROWS):
        variants = {
            "two_kernels": (call(shape), False),
            "fused": (call(shape), True),
            "cudnn": (check._cudnn(shape), False),
            "tokamax": (check._tokamax(shape), False),
        }
        for label in variants:
            variants[label] = ([], *variants[label])
        for _pass in range(2):
            for runs, attend, on in variants.values():
                jax.clear_caches()
                with fused(on):  # compiled (forward and backward) under the patch
                    runs.append(check._timed(attend, shape, "fwdbwd", 0.5).get("ms"))
        for label, (runs, _, _) in variants.items():
            print(
                f"{shape.name:24s} fwdbwd {label:12s} {','.join(f'{x:.4f}' if x else 'err' for x in runs)}", flush=True
            )


if __name__ == "__main__":
    main()
