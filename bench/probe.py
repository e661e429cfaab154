"""Describes the machine for `bench.runner`: ``python -m bench.probe`` prints one JSON object.

Keys: ``platform`` (JAX's: ``"gpu"``, ``"cpu"``, ...), ``device`` (its name), ``nvidia``,
``jaxtile`` (each implementation's name with None, or why its module does not import),
``pallas_mha`` (None, or why JAX's bundled Pallas ``mha`` does not import), ``torch``
(version, CUDA, device, cuDNN) and ``versions`` (package versions, CUDA).
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import sys
import warnings

_PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "torch", "triton", "numpy", "matplotlib")


def _versions() -> dict:
    versions = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _jax(info: dict) -> None:
    import jax

    from jaxtile import api

    device = jax.devices()[0]
    version = getattr(device.client, "platform_version", "") or ""
    info.update(
        platform=device.platform,
        device=device.device_kind,
        device_count=jax.device_count(),
        nvidia="cuda" in version.lower() or device.device_kind.lower().startswith("nvidia"),
    )
    info["versions"]["jax_platform"] = version
    info["jaxtile"] = {}
    for name in api.IMPLEMENTATIONS:
        try:
            api.get_implementation(name)
            info["jaxtile"][name] = None
        except Exception as exc:  # a module being written may fail in any way on import
            info["jaxtile"][name] = _reason(exc)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu.attention import mha  # noqa: F401
        info["pallas_mha"] = None
    except ImportError as exc:
        info["pallas_mha"] = _reason(exc)


def _torch(info: dict) -> None:
    try:
        import torch
    except ImportError as exc:
        info["torch"] = {"error": _reason(exc)}
        return
    cuda = torch.cuda.is_available()
    info["torch"] = {"version": torch.__version__, "cuda": cuda}
    if cuda:
        info["torch"].update(device=torch.cuda.get_device_name(0), cudnn=torch.backends.cudnn.version())
        info["versions"]["cuda (torch)"] = torch.version.cuda


def probe() -> dict:
    info: dict = {"versions": _versions()}
    _jax(info)
    _torch(info)
    return info


if __name__ == "__main__":
    out = sys.stdout
    sys.stdout = sys.stderr  # only the JSON goes to stdout
    json.dump(probe(), out)
