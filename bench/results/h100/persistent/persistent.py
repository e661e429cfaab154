"""mosaic_v3's forward with one program per query tile and with persistent programs
(Tuning.persistent), beside cuDNN and tokamax, in one process."""

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import jaxtile
from bench import check, timing
from bench.probe import git_state
from jaxtile.mask import MaskSpec
from jaxtile.mosaic import _ring, v3

parser = argparse.ArgumentParser()
parser.add_argument("rows", nargs="*", help="names of bench.check.SHAPES or EXTRA (default: the first run's)")
parser.add_argument("--rounds", type=int, default=2)
parser.add_argument("--skip-exactness", action="store_true")
args = parser.parse_args()
print(jaxtile.__file__, git_state(), jax.devices()[0].device_kind, _ring.multiprocessors(), flush=True)
if not args.skip_exactness:
    rng = np.random.default_rng(0)
    for name, (b, t, s, h, kvh, d, causal, window, seg) in {
        "q_longer_window": (1, 200, 60, 2, 2, 64, True, (10, 0), False),
        "gqa_ragged_d80": (2, 300, 1000, 8, 2, 80, True, (100, 0), False),
        "segments": (2, 1024, 1024, 4, 4, 128, True, None, True),
        "two_sided_d64": (1, 777, 777, 4, 4, 64, False, (50, 70), False),
        "d256": (1, 512, 512, 4, 4, 256, True, None, False),
        "many_tiles": (4, 4096, 4096, 16, 4, 128, True, None, False),
    }.items():
        q, k, v = (
            jnp.asarray(rng.standard_normal(sh, np.float32)).astype(jnp.bfloat16)
            for sh in ((b, t, h, d), (b, s, kvh, d), (b, s, kvh, d))
        )
        ids = jnp.asarray(np.sort(rng.integers(0, 4, (b, t)), axis=1), jnp.int32) if seg else None
        kw = dict(causal=causal, window=window, segment_ids=ids)
        ref = jaxtile.flash_attention(*(x.astype(jnp.float32) for x in (q, k, v)), implementation="reference", **kw)
        base = v3.default_tuning(((d + 63) // 64) * 64, ((d + 63) // 64) * 64, 2)
        outs = {}
        for label, tuning, programs in (
            ("base", base, None),
            ("persistent", dataclasses.replace(base, persistent=True), None),
            ("persistent_3", dataclasses.replace(base, persistent=True), 3),
        ):
            multiprocessors = _ring.multiprocessors
            if programs:  # traced afresh: the program count is read when the kernel is traced
                _ring.multiprocessors = lambda programs=programs: programs
            jax.clear_caches()
            outs[label] = jaxtile.flash_attention(q, k, v, implementation="mosaic_v3", tuning=tuning, **kw)
            outs[label] = outs[label].astype(jnp.float32)
            _ring.multiprocessors = multiprocessors
            jax.clear_caches()
        err = {n: float(jnp.max(jnp.abs(x - ref))) for n, x in outs.items()}
        same = {n: bool(jnp.array_equal(outs["base"], x)) for n, x in outs.items() if n != "base"}
        print(f"{name}: max|err| {err}; bitwise equal to base {same}", flush=True)

EXTRA = {
    s.name: s
    for s in (
        check.Shape("d64_1k_causal", 16, 1024, 32, 64, causal=True),
        check.Shape("d64_1k_full", 16, 1024, 32, 64),
        check.Shape("d128_1k_causal", 16, 1024, 16, 128, causal=True),
        check.Shape("d128_1k_full", 16, 1024, 16, 128),
        check.Shape("d64_2k_causal", 8, 2048, 32, 64, causal=True),
        check.Shape("d128_2k_causal", 8, 2048, 16, 128, causal=True),
        check.Shape("d128_2k_full", 8, 2048, 16, 128),
        check.Shape("window_128_128_16k", 1, 16384, 16, 128, window=(128, 128), peer="tokamax"),
    )
}
names = args.rows or [
    "d64_4k_full",
    "d64_4k_causal",
    "d64_16k_full",
    "d64_16k_causal",
    "d128_4k_full",
    "d128_4k_causal",
    "d128_16k_full",
    "d128_16k_causal",
    "gqa_32_8_causal_8k",
    "mqa_16_1_causal_8k",
    "window_1023_causal_16k",
    "window_4095_gqa_32k",
    "window_256_256_16k",
    "documents_8x2k_causal_16k",
    "d256_causal_8k",
    "d64_1k_causal",
    "d64_1k_full",
    "d128_1k_causal",
    "window_128_128_16k",
]
shapes = [s for s in check.SHAPES if s.name in names] + [EXTRA[n] for n in names if n in EXTRA]
for shape in shapes:
    spec = MaskSpec.create(shape.seq, shape.seq, causal=shape.causal, window=shape.window)
    d = shape.head_dim
    base = dataclasses.replace(v3.default_tuning(d, d, 2, spec), persistent=False)
    variants = {"base": base, "persistent": dataclasses.replace(base, persistent=True)}
    primals, _, _ = check._inputs(shape, "fwd")
    segment_ids = check._segment_ids(shape) if shape.documents else None

    def mosaic(tuning, shape=shape, segment_ids=segment_ids):
        options = dict(causal=shape.causal, window=shape.window, segment_ids=segment_ids)
        return lambda *qkv: jaxtile.flash_attention(*qkv, implementation="mosaic_v3", tuning=tuning, **options)

    attends = {n: mosaic(t) for n, t in variants.items()}
    for peer, make in (("cudnn", check._cudnn), ("tokamax", check._tokamax)):
        try:
            attend = make(shape)
        except Exception:
            attend = None
        if attend is not None:
            attends[peer] = attend
    ms = {n: [] for n in attends}
    for _ in range(args.rounds):
        for n, f in attends.items():
            try:
                ms[n].append(timing.time_jitted(f, primals[:3], 0.5).ms)
            except Exception as e:
                ms[n].append(float("nan"))
                print(n, type(e).__name__, str(e)[:200])
    med = {n: float(np.median(v)) for n, v in ms.items()}
    flops = shape.flops("fwd")
    ratios = " ".join(
        f"{n}/{p}={med[p] / med[n]:.3f}" for n in ("base", "persistent") for p in ("cudnn", "tokamax") if p in med
    )
    print(
        shape.name,
        " ".join(f"{n}={m:.3f}ms/{flops / m / 1e9:.0f}TF" for n, m in med.items()),
        f"persistent/base={med['base'] / med['persistent']:.3f}",
        ratios,
        flush=True,
    )
