"""Whether the recognised call runs at the host's pace: XLA's GPU conditional copies its
branch index to the host and waits for the stream before it launches the branch
(``ConditionalThunk::ExecuteOnStream``), so every call of a `lax.switch` makes the host
wait for the GPU. The causal call, the recognised call and a switch on an argument
between two causal calls are timed with the host idle and with a Python thread
contending for the interpreter (as other work in a training loop's process would), in
one process, each twice, jax's caches cleared between variants."""

import json
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

import jaxtile
from bench import check

stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
print(jaxtile.__file__, stamp.get("commit"), jax.__version__, jax.devices()[0].device_kind, flush=True)

shape = next(s for s in check.SHAPES if s.name == "d64_4k_dense_causal")
(q, k, v), mask, _ = check._inputs(shape, "fwd")
index = jnp.int32(0)


def causal(q, k, v, mask, index):
    return jaxtile.flash_attention(q, k, v, causal=True)


def recognised(q, k, v, mask, index):
    return jaxtile.flash_attention(q, k, v, mask=mask)


def switch_given(q, k, v, mask, index):
    call = lambda: jaxtile.flash_attention(q, k, v, causal=True)  # noqa: E731
    return lax.switch(index, [call, call])


def cudnn(q, k, v, mask, index):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def busy(stop: threading.Event):
    while not stop.is_set():
        sum(i * i for i in range(1000))


VARIANTS = dict(causal=causal, recognised=recognised, switch_given=switch_given, cudnn=cudnn)
ms = {}
for host in ("idle", "busy"):
    for _pass in range(2):
        for name, fn in VARIANTS.items():
            jax.clear_caches()
            compiled = jax.jit(fn).lower(q, k, v, mask, index).compile()
            stop = threading.Event()
            thread = threading.Thread(target=busy, args=(stop,))
            if host == "busy":
                thread.start()
                time.sleep(0.05)
            timing = check._worker.time_batches(lambda c=compiled: c(q, k, v, mask, index), jax.block_until_ready, 0.5)
            stop.set()
            if host == "busy":
                thread.join()
            ms.setdefault((host, name), []).append(timing.ms)
            print(f"{host} {name} {timing.ms:.4f} ms (lo {timing.ms_lo:.4f}, hi {timing.ms_hi:.4f})", flush=True)
for (host, name), values in ms.items():
    print(f"{host:5s} {name:13s} " + " ".join(f"{x:.4f}" for x in values) + " ms")
