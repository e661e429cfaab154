"""Three changes to mosaic_v3's forward step at head dim 128, each against the default in
one process beside cuDNN and tokamax (forward only, two passes, jax's caches cleared
between variants):

* ``stages3``: a ring of three 128-key stages (it fits since 1429d8a counts shared
  memory as Mosaic GPU does);
* ``split``: the step's optimisation barrier split in two as tokamax's sm90 kernel
  splits it (``(acc, P)`` apart from ``(l_i, m_i)``), the source of `v3._kernel` with
  that one line replaced;
* ``regs232``: 232 registers a consumer, as tokamax gives its own.
"""

import contextlib
import inspect
import json
import textwrap
from pathlib import Path

import jax

import jaxtile
from bench import check
from jaxtile.mosaic import _ring, v3

ROWS = ("d128_4k_full", "d128_16k_causal", "gqa_32_8_causal_8k", "window_1023_causal_16k")
ONE_BARRIER = "acc, l_i, m_new, p = lax.optimization_barrier((acc, l_i, m_new, p))"
TWO_BARRIERS = "acc, p = lax.optimization_barrier((acc, p))\n{0}l_i, m_new = lax.optimization_barrier((l_i, m_new))"


def _split_kernel():
    """`v3._kernel` with its step's barrier split in two, compiled in v3's namespace."""
    source = textwrap.dedent(inspect.getsource(v3._kernel))
    line = next(s for s in source.splitlines() if ONE_BARRIER in s)
    indent = line[: len(line) - len(line.lstrip())]
    assert source.count(ONE_BARRIER) == 1
    namespace = dict(vars(v3))
    exec(compile(source.replace(ONE_BARRIER, TWO_BARRIERS.format(indent)), v3.__file__, "exec"), namespace)
    return namespace["_kernel"]


@contextlib.contextmanager
def _patched(module, name, value):
    kept = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, kept)


def call(shape, tuning=None, patch=None):
    def attend(q, k, v, bias=None, mask=None):
        with _patched(*patch) if patch else contextlib.nullcontext():
            return jaxtile.flash_attention(
                q, k, v, causal=shape.causal, window=shape.window, implementation="mosaic_v3", tuning=tuning
            )

    return attend


def main():
    stamp = json.loads(Path("VERSION.json").read_text()) if Path("VERSION.json").exists() else {}
    print(jaxtile.__file__, stamp.get("commit"), stamp.get("dirty"), jax.__version__, jax.devices()[0].device_kind)
    split = _split_kernel()
    for shape in (s for s in check.SHAPES if s.name in ROWS):
        variants = {
            "default": call(shape),
            "stages3": call(shape, v3.Tuning(num_stages=3)),
            "split": call(shape, patch=(v3, "_kernel", split)),
            "regs232": call(shape, patch=(_ring, "CONSUMER_REGISTERS", 232)),
            "cudnn": check._cudnn(shape),
            "tokamax": check._tokamax(shape),
        }
        ms = check.timed_passes({k: f for k, f in variants.items() if f is not None}, shape, "fwd")
        for label, runs in ms.items():
            print(f"{shape.name:24s} fwd {label:8s} {','.join(f'{x:.4f}' if x else 'err' for x in runs)}", flush=True)


if __name__ == "__main__":
    main()
