"""The implementations the benchmark can time, and what each of them supports.

jaxtile's implementations go by their registered names (``"pallas_v2"``, ...) and say
what they support in their records (`jaxtile.registry`); peers go by
``framework.backend``. What an implementation cannot run is decided here, before any
worker starts, so that an unsupported combination is recorded with its reason instead of
failing on the GPU. ``env`` is what `bench.probe` reports about the machine.
"""

from __future__ import annotations

from bench.suites import Problem
from jaxtile import registry
from jaxtile._core import Shape

# Peers, in display order, with the framework whose worker runs them.
PEERS = {
    "jax.cudnn": "jax",
    "pallas.mha": "jax",
    "tokamax.mosaic": "jax",
    "jax.xla": "jax",
    "torch.flash": "torch",
    "torch.cudnn": "torch",
    "torch.efficient": "torch",
    "torch.math": "torch",
}
# torch.flash also has a CPU kernel, so it runs on a CPU when asked for by name.
_GPU_ONLY = ("jax.cudnn", "pallas.mha", "tokamax.mosaic", "torch.cudnn", "torch.efficient")
# JAX's Pallas mha tiles: 128 forward, 32 backward (its BlockSizes.get_default()).
_MHA_BLOCKS = {"fwd": (128,), "fwdbwd": (128, 32)}
# How soon the peers' workers run on a GPU, on the scale of `registry.Implementation.speed`
# (if the deadline cuts a run short, what is lost is the slowest); "torch" is their group.
_PEER_PRIORITY = {"jax.cudnn": 45, "torch": 44, "tokamax.mosaic": 42, "pallas.mha": 40, "jax.xla": 15}
_MATERIALISING_PEERS = ("jax.xla", "torch.math")


def framework(name: str) -> str:
    """``"jaxtile"``, ``"jax"`` or ``"torch"``."""
    return PEERS.get(name, "jaxtile")


def order(names) -> list[str]:
    """Display order: jaxtile's implementations (fastest first), then the peers."""
    ranks = (*registry.names(), *PEERS)
    return sorted(set(names), key=lambda n: (ranks.index(n) if n in ranks else len(ranks), n))


def priority(name: str) -> float:
    """How soon a worker group runs on a GPU (higher first): a jaxtile implementation's
    speed, a peer's place on the same scale."""
    if name in registry.names():
        return registry.get(name).speed
    return _PEER_PRIORITY.get(name, -1)


def materialising(name: str) -> bool:
    """Whether it forms ``[batch, heads, seq, seq]`` scores (O(N²) memory)."""
    if name in registry.names():
        return not registry.get(name).tiled
    return name in _MATERIALISING_PEERS


def on_gpu(env: dict) -> bool:
    return env["platform"] == "gpu"


def defaults(env: dict) -> list[str]:
    """Every registered jaxtile implementation, and every peer that runs here."""
    names = list(env["jaxtile"])
    if on_gpu(env):
        names += ["jax.xla"]
        if env["nvidia"]:
            names += ["jax.cudnn"]
        if env["pallas_mha"] is None:
            names += ["pallas.mha"]
        if env["nvidia"] and _tokamax_missing(env) is None:
            names += ["tokamax.mosaic"]
        if env["torch"].get("cuda"):
            names += ["torch.flash", "torch.cudnn", "torch.efficient"]
    else:
        names += ["jax.xla"]
        if env["torch"].get("version"):
            names += ["torch.math"]
    return names


def _tokamax_missing(env: dict) -> str | None:
    """Why ``tokamax`` does not import here (None: it does; `bench.probe`)."""
    return env.get("tokamax", "not probed")


def known(name: str, env: dict) -> bool:
    return name in PEERS or name in env["jaxtile"]


def unsupported(name: str, problem: Problem, mode: str, env: dict) -> str | None:
    """Why ``name`` cannot run ``problem`` in ``mode`` here, or None if it can."""
    if name in env["jaxtile"]:
        features = {"causal"} if problem.causal else set()
        if problem.window is not None:
            features.add("window")
        if problem.num_kv_heads != problem.num_heads:
            features.add("gqa")
        itemsize = 4 if problem.dtype == "float32" else 2
        dims = (problem.batch, problem.seq_len, problem.seq_len, problem.num_heads, problem.num_kv_heads)
        shape = Shape(*dims, problem.head_dim, problem.head_dim, itemsize)
        return registry.get(name).can_run(shape, problem.dtype, frozenset(features), env["platform"])
    gpu = on_gpu(env)
    if framework(name) == "torch":
        if not env["torch"].get("version"):
            return f"torch does not import: {env['torch'].get('error')}"
        if name in _GPU_ONLY and not env["torch"].get("cuda"):
            return "needs CUDA"
        if problem.window is not None:
            return "scaled_dot_product_attention has no sliding window"
        return None
    if name in _GPU_ONLY and not gpu:
        return "needs a GPU"
    if name in ("jax.cudnn", "tokamax.mosaic"):
        if name == "tokamax.mosaic" and _tokamax_missing(env) is not None:
            return f"does not import: {_tokamax_missing(env)}"
        if not env["nvidia"]:
            return "needs an NVIDIA GPU"
        if problem.dtype not in ("bfloat16", "float16"):
            return f"{name} takes bfloat16/float16, not {problem.dtype}"
    if name == "pallas.mha":
        if env["pallas_mha"] is not None:
            return f"does not import: {env['pallas_mha']}"
        if problem.window is not None:
            return "no sliding window"
        if problem.num_kv_heads != problem.num_heads:
            return "no grouped-query attention"
        for block in _MHA_BLOCKS[mode]:
            if problem.seq_len % min(block, problem.seq_len):
                return f"seq_len={problem.seq_len} is not a multiple of its block {block}"
    return None
