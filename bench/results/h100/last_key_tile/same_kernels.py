"""Which rows of the perf check c78b73a's change reaches: the forward of each row of
`bench.check.SHAPES`, traced for the GPU, printed as a jaxpr (the kernel's body with it,
without source lines) and hashed. Run it once from each version's directory, with
``PYTHONPATH`` naming that directory (it prints the ``jaxtile.__file__`` it imported),
and compare the hashes: rows whose hashes agree run the same kernel on the same operands.

    PYTHONPATH=DIR python bench/results/h100/last_key_tile/same_kernels.py > hashes.json
"""

import hashlib
import json
import sys

import jax
import jax.numpy as jnp

import jaxtile
from bench import check
from jaxtile._core import Config, Inputs
from jaxtile._softmax import Logits
from jaxtile.mask import MaskSpec
from jaxtile.mosaic import v3


def _forward(shape: check.Shape) -> str:
    """The forward's jaxpr for ``shape``, its runtime parts (segment ids, the dense mask,
    the bias, the sinks) abstract."""

    def array(dims, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(dims, dtype)

    q = array((shape.batch, shape.seq, shape.heads, shape.head_dim))
    kv = array((shape.batch, shape.seq, shape.num_kv_heads, shape.head_dim))
    ids = [array((shape.batch, shape.seq), jnp.int32)] * 2 if shape.documents else [None, None]
    mask = array((1, 1, shape.seq, shape.seq), jnp.bool_) if shape.dense_mask else None
    bias = array((1, shape.heads, shape.seq, shape.seq)) if shape.bias else None
    sinks = array((shape.heads,), jnp.float32) if shape.sinks else None
    spec = MaskSpec.create(
        shape.seq,
        shape.seq,
        causal=shape.causal and not shape.dense_mask,
        window=shape.window,
        has_segments=bool(shape.documents),
        has_dense_mask=bool(shape.dense_mask),
    )
    config = Config(spec, Logits(shape.head_dim**-0.5, None, bias=shape.bias), platform="gpu")

    def forward(q, k, v, *runtime):
        q_ids, kv_ids, mask, bias, sinks = runtime
        return v3.forward_pass(Inputs(q, k, v, q_ids, kv_ids, mask=mask, bias=bias, sinks=sinks), config)

    return str(jax.make_jaxpr(forward)(q, kv, kv, *ids, mask, bias, sinks))


print(jaxtile.__file__, file=sys.stderr)
print(json.dumps({s.name: hashlib.sha256(_forward(s).encode()).hexdigest()[:16] for s in check.SHAPES}, indent=1))
