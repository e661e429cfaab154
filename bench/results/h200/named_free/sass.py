"""Compiles and runs one forward at head dim 128 (bf16, batch 4, 16 heads), jaxtile's
``mosaic_v3`` from the working directory or tokamax's Mosaic GPU kernel, with Mosaic GPU's
PTX, ptxas report and SASS (each instruction with its control bits) written to a file::

    PYTHONPATH=. NVDISASM=/path/to/nvdisasm python sass.py {mosaic_v3,tokamax} SEQ {causal,full} FILE [persistent]

Mosaic GPU prints its dumps from C++ to the process's stdout while it compiles, so that
file descriptor is pointed at FILE first. It runs nvdisasm from its CUDA root, which in
the GPU image has none: with ``NVDISASM`` set, the root becomes a folder of links to the
real root's tools and that nvdisasm.
"""

import os
import sys
import tempfile

os.environ.update(MOSAIC_GPU_DUMP_SASS_CTRL="1", MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_PTX="1")

import jax
import jax.experimental.mosaic.gpu  # sets MOSAIC_GPU_CUDA_ROOT
import jax.numpy as jnp

if nvdisasm := os.environ.get("NVDISASM"):
    root = tempfile.mkdtemp()
    os.mkdir(f"{root}/bin")
    real = f"{os.environ['MOSAIC_GPU_CUDA_ROOT']}/bin"
    for tool in os.listdir(real) if os.path.isdir(real) else ():
        os.symlink(f"{real}/{tool}", f"{root}/bin/{tool}")
    if not os.path.exists(f"{root}/bin/nvdisasm"):
        os.symlink(nvdisasm, f"{root}/bin/nvdisasm")
    os.environ["MOSAIC_GPU_CUDA_ROOT"] = root
    print("CUDA root", real, "->", root, "with", nvdisasm, file=sys.stderr)

impl, seq, mask, path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
causal, persistent = mask == "causal", sys.argv[5:] == ["persistent"]
q, k, v = (jax.random.normal(jax.random.key(i), (4, seq, 16, 128), jnp.bfloat16) for i in range(3))
if impl == "tokamax":
    import tokamax

    attend = jax.jit(lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=causal, implementation="mosaic"))
else:
    import jaxtile

    print("jaxtile", jaxtile.__file__, file=sys.stderr)
    from jaxtile.mosaic import v3

    tuning = v3.Tuning(persistent=True) if persistent else None
    attend = jax.jit(
        lambda q, k, v: jaxtile.flash_attention(q, k, v, causal=causal, implementation=impl, tuning=tuning)
    )
sys.stdout.flush()
dump = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
saved = os.dup(1)
os.dup2(dump, 1)
out = attend(q, k, v).block_until_ready()
sys.stdout.flush()
os.dup2(saved, 1)
print(impl, seq, mask, "ran:", out.shape, "finite:", bool(jnp.isfinite(out.astype(jnp.float32)).all()))
