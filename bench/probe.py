"""Describes the machine for `bench.runner`: ``python -m bench.probe`` prints one JSON object.

Keys: ``platform`` (JAX's: ``"gpu"``, ``"cpu"``, ...), ``device`` (its name), ``nvidia``,
``jaxtile`` (the registered implementations' names, `jaxtile.registry`),
``pallas_mha`` (None, or why JAX's bundled Pallas ``mha`` does not import), ``tokamax``
(None, or why it does not import; `bench/gpu_session.sh` installs it on GPUs), ``torch``
(version, CUDA, device, cuDNN), ``versions`` (package versions, CUDA) and ``git`` (what
`git_state` says of the jaxtile that was imported).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
import subprocess
import sys
import warnings
from pathlib import Path

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

    from jaxtile import registry

    device = jax.devices()[0]
    version = getattr(device.client, "platform_version", "") or ""
    info.update(
        platform=device.platform,
        device=device.device_kind,
        device_count=jax.device_count(),
        nvidia="cuda" in version.lower() or device.device_kind.lower().startswith("nvidia"),
    )
    info["versions"]["jax_platform"] = version
    info["jaxtile"] = list(registry.names())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu.attention import mha  # noqa: F401
        info["pallas_mha"] = None
    except ImportError as exc:
        info["pallas_mha"] = _reason(exc)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import tokamax  # noqa: F401
        info["tokamax"] = None
    except Exception as exc:  # not installed, or its own imports fail
        info["tokamax"] = _reason(exc)


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


def _fingerprint(root: Path) -> str:
    """A hash of the Python sources of ``root/jaxtile``: what a stamp vouches for."""
    digest = hashlib.sha256()
    for path in sorted((root / "jaxtile").rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def git_state() -> dict:
    """Which jaxtile this process imported: its ``jaxtile.__file__``, the commit it came
    from and whether that tree was dirty. A ``VERSION.json`` beside ``jaxtile/`` (written
    by ``python -m bench.probe --stamp`` before a tree is sent to a GPU machine, or by
    `bench.ab` for a version it laid out) answers while the sources are the ones it was
    stamped with, whatever ``.git`` the copy carries; else git answers in a checkout of
    its own; else a stamp names the commit, and the tree is dirty if its sources changed
    since. Every results file records this, so a number always says what it measured."""
    import jaxtile

    root = Path(jaxtile.__file__).resolve().parents[1]
    state = dict(jaxtile_file=str(Path(jaxtile.__file__).resolve()))
    stamp = root / "VERSION.json"
    described = json.loads(stamp.read_text()) if stamp.exists() else None
    if described and described.get("fingerprint") == _fingerprint(root):
        return dict(state, commit=described["commit"], dirty=described["dirty"], version=described["version"])

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, check=True).stdout

    try:
        top, commit = git("rev-parse", "--show-toplevel", "HEAD").split()
    except (OSError, subprocess.CalledProcessError, ValueError):  # not in a checkout
        top = commit = None
    if top is not None and Path(top).resolve() == root:
        return dict(state, commit=commit, dirty=bool(git("status", "--porcelain").strip()))
    if described:
        dirty = "fingerprint" in described or described.get("dirty", described["commit"] is None)
        return dict(state, commit=described["commit"], dirty=dirty, version=described["version"])
    return dict(state, commit=None, dirty=None)


def probe() -> dict:
    info: dict = {"versions": _versions(), "git": git_state()}
    _jax(info)
    _torch(info)
    return info


def stamp() -> dict:
    """Writes ``VERSION.json`` (this checkout's commit, whether it is dirty, and the
    fingerprint of its sources) beside ``jaxtile/``, for copies of the tree that travel
    without their own ``.git``."""
    import jaxtile

    root = Path(jaxtile.__file__).resolve().parents[1]
    (root / "VERSION.json").unlink(missing_ok=True)
    state = git_state()
    described = dict(version="stamped", commit=state["commit"], dirty=state["dirty"], fingerprint=_fingerprint(root))
    (root / "VERSION.json").write_text(json.dumps(described) + "\n")
    return described


if __name__ == "__main__":
    if sys.argv[1:] == ["--stamp"]:
        print(stamp())
        sys.exit(0)
    out = sys.stdout
    sys.stdout = sys.stderr  # only the JSON goes to stdout
    json.dump(probe(), out)
