"""The implementations jaxtile can run, each declared once, in one record.

An implementation is a `Implementation` record: its name, its forward and backward
passes, where it runs and what it supports. Everything that needs to know about an
implementation — `flash_attention`'s dispatch, ring attention, sharding, `analysis`,
the shared test base, the parity suite, the benchmark — asks its record, never its name.

Records are registered when their module is imported (`jaxtile` imports its own); a
module outside the package registers its implementation the same way, with `register`.
``JAXTILE_IMPLEMENTATIONS`` registers more when `jaxtile` is imported, so that tools
started as separate processes (the test suite, ``python -m parity``, ``python -m
bench``) see them too: a comma-separated list of ``package.module`` (imported; it
registers its own) or ``package.module:RECORD`` (the module's `Implementation` record,
registered).

With ``implementation=None``, `flash_attention` takes the fastest registered
implementation (highest `Implementation.speed`) that supports the call and runs natively
on the arrays' platform (`choose`): a family that supports part of the API is chosen
where it applies, and the others cover the rest.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable

import jax.numpy as jnp

from jaxtile import _core
from jaxtile._core import Backward, Config, Forward, Inputs, PagedForward, Shape

DTYPES = frozenset({"float32", "bfloat16", "float16"})
# Parts of the mask and logits a call can use (`features_of`).
FEATURES = frozenset({"causal", "window", "segments", "dense_mask", "lengths", "soft_cap", "gqa", "bias"})
PLATFORMS = frozenset({"cpu", "gpu", "tpu"})

# memory(shape, block_q, block_k, backward) -> (residual bytes, temporary bytes)
MemoryModel = Callable[[Shape, "int | None", "int | None", bool], tuple[int, int]]


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One implementation and what it declares it can do.

    Attributes:
      name: what ``flash_attention(..., implementation=name)`` takes.
      summary: one line for tables and errors.
      family: the package it belongs to (``"lax"``, ``"triton"``, ...), and
        ``algorithm`` the one it implements (``"FlashAttention-2"``, ...), for reports.
      forward: ``(inputs, config) -> (out, lse, stats)``; ``stats`` is what ``backward``
        needs besides the output.
      backward: ``(inputs, out, stats, dout, dlse, config) -> (dq, dk, dv, dbias)``
        (`_core.Backward`), a pass that recomputes attention from ``stats``; None to let
        JAX differentiate ``forward``.
      paged_forward: the forward pass reading K and V from a paged cache
        (`jaxtile.paged_attention`), or None to have the pages gathered for ``forward``.
      memory: the bytes it needs beyond inputs and outputs (`jaxtile.analysis`).
      platforms: where it runs natively; ``interprets``: where else it runs, slowly,
        in Pallas interpret mode.
      requires: ``requires(platform)`` says what this machine's devices of ``platform``
        lack to run it (say, a GPU generation), or None; None for no such requirement.
      dtypes, features, max_head_dim, max_q_len: the calls it supports (`supports`).
      tiled: O(N) memory, visiting only the tiles the mask allows.
      power_of_two_blocks: ``block_q``/``block_k`` must be powers of two >= 16.
      lse_backward: ``stats`` is the lse, so ``backward`` can be driven by the lse of a
        larger attention the call is part of (ring attention).
      jax_differentiable: its passes are JAX code that JAX differentiates itself once
        `MaskSpec.every_tile` gives their loops static bounds: it takes forward-mode
        autodiff and second derivatives (`jaxtile.api.compiled`); the others raise
        `Unsupported` there.
      recognises_masks: where it runs natively, a dense mask that reads as causal, or
        causal with padding (`MaskSpec.recognise`: the masks Flax builds), runs as that
        structured call, chosen at run time (on the implementation the structured call
        picks, where the caller named none). That costs a pass over the mask and two
        more compiled calls; it pays where structured masks are faster than dense ones
        (kernels that mask diagonal tiles by position, not by loading mask tiles, and
        run the heaviest rows first).
      takes_sinks: ``forward`` folds ``Inputs.sinks`` into its own softmax (their
        gradient is `_core.differentiable`'s); the others' outputs take them after, in a
        pass over the output (`_softmax.with_sinks`).
      tuning: the type of its ``tuning=`` argument, or None if it takes none.
      speed: preference for ``implementation=None`` (higher first).
    """

    name: str
    summary: str
    family: str
    algorithm: str
    forward: Forward
    backward: Backward | None
    memory: MemoryModel
    paged_forward: PagedForward | None = None
    platforms: frozenset[str] = PLATFORMS
    interprets: frozenset[str] = frozenset()
    requires: Callable[[str], str | None] | None = None
    dtypes: frozenset[str] = DTYPES
    features: frozenset[str] = FEATURES
    max_head_dim: int | None = None
    max_q_len: int | None = None
    tiled: bool = True
    power_of_two_blocks: bool = False
    lse_backward: bool = False
    jax_differentiable: bool = False
    recognises_masks: bool = False
    takes_sinks: bool = False
    tuning: type | None = None
    speed: int = 0

    def runs_on(self, platform: str) -> bool:
        """Whether it runs on ``platform`` at all (natively or interpreted)."""
        return platform in self.platforms or platform in self.interprets

    def unable(self, platform: str) -> str | None:
        """Why it cannot run on ``platform`` on this machine at all, or None if it can."""
        if not self.runs_on(platform):
            return f"{self.name} does not run on {platform}"
        lacking = None if self.requires is None else self.requires(platform)
        return None if lacking is None else f"{self.name} {lacking}"

    def supports(self, inputs: Inputs, config: Config) -> str | None:
        """Why it cannot run this call, or None if it can."""
        shape = Shape.of(inputs.q, inputs.k, inputs.v)
        return self.can_run(shape, jnp.dtype(inputs.q.dtype).name, features_of(inputs, config), config.platform)

    def can_run(self, shape: Shape, dtype: str, features: frozenset[str], platform: str) -> str | None:
        """Why it cannot run a call of this shape, dtype and `FEATURES` on ``platform``,
        or None if it can."""
        unable = self.unable(platform)
        if unable is not None:
            return unable
        if dtype not in self.dtypes:
            return f"{self.name} does not take {dtype}"
        if self.max_head_dim is not None and max(shape.head_dim, shape.head_dim_v) > self.max_head_dim:
            return (
                f"{self.name} supports head dims up to {self.max_head_dim}; "
                f"got head_dim={shape.head_dim}, head_dim_v={shape.head_dim_v}"
            )
        if self.max_q_len is not None and shape.q_len > self.max_q_len:
            return f"{self.name} supports q_len up to {self.max_q_len}; got q_len={shape.q_len}"
        missing = features - self.features
        if missing:
            return f"{self.name} does not support {', '.join(sorted(missing))}"
        return None


def features_of(inputs: Inputs, config: Config) -> frozenset[str]:
    """The `FEATURES` a call uses."""
    spec = config.mask
    used = {
        "causal": spec.right is not None and spec.left is None,
        "window": spec.left is not None or (spec.right is not None and spec.right > 0),
        "segments": spec.has_segments,
        "dense_mask": spec.has_dense_mask,
        "lengths": spec.has_lengths,
        "soft_cap": config.logits.soft_cap is not None,
        "gqa": inputs.q.shape[2] != inputs.k.shape[2],
        "bias": inputs.bias is not None,
    }
    return frozenset(name for name, on in used.items() if on)


Unsupported = _core.Unsupported
# A requirement on the implementation: (predicate, what to say when none meets it).
Requirement = tuple[Callable[[Implementation], bool], str]


_REGISTRY: dict[str, Implementation] = {}


def register(implementation: Implementation) -> Implementation:
    """Adds ``implementation`` (replacing one of the same name); returns it."""
    _REGISTRY[implementation.name] = implementation
    return implementation


def unregister(name: str) -> None:
    """Removes ``name`` (if registered)."""
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    """Registered names, fastest first."""
    return tuple(i.name for i in implementations())


def implementations() -> tuple[Implementation, ...]:
    """Registered records, fastest first."""
    return tuple(sorted(_REGISTRY.values(), key=lambda i: -i.speed))


def get(name: str) -> Implementation:
    """The record of ``name``; a ValueError naming the registered ones otherwise."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown implementation={name!r}; choose one of {names()} or None")
    return _REGISTRY[name]


def supporting(inputs: Inputs, config: Config) -> tuple[str, ...]:
    """The names of every registered implementation that can run this call."""
    return tuple(i.name for i in implementations() if i.supports(inputs, config) is None)


def choose(inputs: Inputs, config: Config, require: Requirement | None = None) -> Implementation:
    """The fastest implementation that supports the call (and meets ``require``) and runs
    natively on its platform (interpreting only if none does)."""
    able = [i for i in implementations() if (require is None or require[0](i)) and i.supports(inputs, config) is None]
    native = [i for i in able if config.platform in i.platforms]
    if not (native or able):
        if require is not None:
            raise Unsupported(f"{require[1]}, and none supports this call")
        raise Unsupported(f"no registered implementation supports this call ({names()})")
    return (native or able)[0]


def check(implementation: Implementation, inputs: Inputs, config: Config) -> None:
    """`Unsupported` (a NotImplementedError) naming the implementations that do support
    the call, if ``implementation`` does not."""
    reason = implementation.supports(inputs, config)
    if reason is not None:
        others = [name for name in supporting(inputs, config) if name != implementation.name]
        raise Unsupported(f"{reason}. Implementations that support this call: {others}")


def _import_listed() -> None:
    """Registers what ``JAXTILE_IMPLEMENTATIONS`` lists (see the module's doc)."""
    for entry in filter(None, (e.strip() for e in os.environ.get("JAXTILE_IMPLEMENTATIONS", "").split(","))):
        module, _, record = entry.partition(":")
        imported = importlib.import_module(module)
        if record:
            register(getattr(imported, record))
