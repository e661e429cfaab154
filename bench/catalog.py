"""The implementations the benchmark can time, and what each of them supports.

jaxtile's implementations go by their own names (``"pallas_v2"``, ...); peers by
``framework.backend``. What an implementation cannot run is decided here, before any
worker starts, so that an unsupported combination is recorded with its reason instead of
failing on the GPU. ``env`` is what `bench.probe` reports about the machine.
"""

from __future__ import annotations

from bench.suites import Problem
from jaxtile.api import IMPLEMENTATIONS

# Peers, in display order, with the framework whose worker runs them.
PEERS = {
    "jax.cudnn": "jax",
    "pallas.mha": "jax",
    "jax.xla": "jax",
    "torch.flash": "torch",
    "torch.cudnn": "torch",
    "torch.efficient": "torch",
    "torch.math": "torch",
}
# torch.flash also has a CPU kernel, so it runs on a CPU when asked for by name.
_GPU_ONLY = ("jax.cudnn", "pallas.mha", "torch.cudnn", "torch.efficient")
# JAX's Pallas mha tiles: 128 forward, 32 backward (its BlockSizes.get_default()).
_MHA_BLOCKS = {"fwd": (128,), "fwdbwd": (128, 32)}
ORDER = (*IMPLEMENTATIONS, *PEERS)


def framework(name: str) -> str:
    """``"jaxtile"``, ``"jax"`` or ``"torch"``."""
    return PEERS.get(name, "jaxtile")


def order(names) -> list[str]:
    """Display order: jaxtile's implementations, then the peers."""
    return sorted(set(names), key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))


def on_gpu(env: dict) -> bool:
    return env["platform"] == "gpu"


def defaults(env: dict) -> list[str]:
    """Every jaxtile implementation whose module imports, and every peer that runs here."""
    names = [name for name, missing in env["jaxtile"].items() if missing is None]
    if on_gpu(env):
        names += ["jax.xla"]
        if env["nvidia"]:
            names += ["jax.cudnn"]
        if env["pallas_mha"] is None:
            names += ["pallas.mha"]
        if env["torch"].get("cuda"):
            names += ["torch.flash", "torch.cudnn", "torch.efficient"]
    else:
        names += ["jax.xla"]
        if env["torch"].get("version"):
            names += ["torch.math"]
    return names


def known(name: str, env: dict) -> bool:
    return name in PEERS or name in env["jaxtile"]


def unsupported(name: str, problem: Problem, mode: str, env: dict) -> str | None:
    """Why ``name`` cannot run ``problem`` in ``mode`` here, or None if it can."""
    if name in env["jaxtile"]:
        return env["jaxtile"][name] and f"module does not import: {env['jaxtile'][name]}"
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
    if name == "jax.cudnn":
        if not env["nvidia"]:
            return "needs an NVIDIA GPU"
        if problem.dtype not in ("bfloat16", "float16"):
            return f"cuDNN attention takes bfloat16/float16, not {problem.dtype}"
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
