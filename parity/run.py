"""Runs one case through jaxtile and through the PyTorch reference, and compares."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jaxtile
from jaxtile import registry
from parity import reference
from parity.case import Case, make_inputs
from parity.compare import Error, Tolerance, compare, finite, tolerance

QUANTITIES = ("out", "lse", "dq", "dk", "dv", "dsinks", "dbias")  # the last two: only in cases with them
# The differentiated inputs of a case, in order; sinks and bias only where the case has them.
PRIMALS = ("q", "k", "v", "sinks", "bias")

# A jaxtile implementation name, or a function with ``flash_attention``'s signature that
# returns ``(out, lse)`` (it is called with ``return_lse=True``): a wrapper under test.
Implementation = str | Callable[..., tuple[jax.Array, jax.Array]]


def implementation_name(implementation: Implementation) -> str:
    return implementation if isinstance(implementation, str) else implementation.__name__


def resolve_implementation(spec: str) -> Implementation:
    """``"scan_v2"`` -> the name (checked to be registered); ``"module:function"`` -> the function."""
    if ":" in spec:
        module, _, attribute = spec.partition(":")
        return getattr(importlib.import_module(module), attribute)
    registry.get(spec)
    return spec


@dataclasses.dataclass(frozen=True)
class Result:
    """Errors of one implementation on one case against the float64 reference.

    ``second_opinion`` marks rows of PyTorch's or JAX's own attention (informative, they
    do not decide pass or fail); ``agrees`` says, per second opinion that ran on the case
    and is within tolerance of the reference, whether this implementation is within
    tolerance of it too. ``raised`` is the exception the implementation raised instead
    of returning (no errors then); a ``NotImplementedError`` makes the row
    ``unsupported`` rather than failed.
    """

    case: Case
    implementation: str
    errors: dict[str, Error]
    tolerance: Tolerance
    seconds: float
    second_opinion: bool = False
    agrees: dict[str, bool] = dataclasses.field(default_factory=dict)
    raised: str = ""
    unsupported: bool = False

    @property
    def ok(self) -> bool:
        return not self.raised and all(e.ok for e in self.errors.values())

    def describe(self) -> str:
        verdict = "not implemented" if self.unsupported else "ok" if self.ok else "FAILED"
        lines = [f"{self.case.name} [{self.implementation}, {self.case.dtype}]: {verdict}"]
        if self.raised:
            lines.append(f"  raised {self.raised}")
        tol = self.tolerance
        for name, e in self.errors.items():
            flag = "" if e.ok else "  <-- over tolerance" + (f" ({e.note})" if e.note else "")
            lines.append(
                f"  {name:4s} rel_l2={e.rel_l2:.2e} (tol {tol.rel_l2:.1e})  max={e.max_err:.2e} (tol {tol.max_err:.1e}){flag}"
            )
        for name, agrees in self.agrees.items():
            lines.append(f"  {'agrees' if agrees else 'DISAGREES'} with {name} within tolerance")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Problem:
    """A case, its inputs and the float64 reference's answer, computed once."""

    case: Case
    arrays: dict[str, np.ndarray | None]
    expected: dict[str, np.ndarray]
    tolerance: Tolerance

    @classmethod
    def create(cls, case: Case, device: str = "cpu") -> Problem:
        arrays = make_inputs(case)
        expected = torch_reference(case, arrays, device)
        return cls(case, arrays, expected, tolerance(case.dtype, expected["lse"]))

    @property
    def has_empty_rows(self) -> bool:
        """Whether some query sees no key at all (its reference lse is ``-inf``)."""
        return bool(np.isneginf(self.expected["lse"]).any())

    def errors(self, values: dict[str, np.ndarray], against: dict[str, np.ndarray] | None = None) -> dict[str, Error]:
        """Errors of ``values`` (any of `QUANTITIES`) against the reference, or ``against``.

        Gradients are only checked to be finite when the case says they cannot be compared.
        """
        expected = self.expected if against is None else against
        return {
            name: compare(values[name], expected[name], self.tolerance)
            if self.case.grads or name in ("out", "lse")
            else finite(values[name])
            for name in QUANTITIES
            if name in values and name in expected
        }

    def judge(self, implementation: str, values: dict[str, np.ndarray], seconds: float, **flags) -> Result:
        return Result(self.case, implementation, self.errors(values), self.tolerance, seconds, **flags)

    def agrees(self, values: dict[str, np.ndarray], other: dict[str, np.ndarray]) -> bool:
        """Whether ``values`` are within tolerance of ``other`` on the quantities both have."""
        return all(e.ok for e in self.errors(values, against=other).values())

    def attempt(
        self, implementation: str, function: Callable, *args, second_opinion: bool = False
    ) -> tuple[Result, dict[str, np.ndarray] | None]:
        """Runs ``function(*args)``, which returns values of `QUANTITIES`, and judges them.

        An exception becomes a row without values: failed, or unsupported for a
        ``NotImplementedError``. Seconds include compilation.
        """
        start = time.perf_counter()
        try:
            values = function(*args)
        except Exception as error:
            seconds = time.perf_counter() - start
            flags = dict(raised=f"{type(error).__name__}: {error}", unsupported=isinstance(error, NotImplementedError))
            return Result(self.case, implementation, {}, self.tolerance, seconds, second_opinion, **flags), None
        return self.judge(implementation, values, time.perf_counter() - start, second_opinion=second_opinion), values


def torch_reference(case: Case, arrays: dict, device: str = "cpu") -> dict[str, np.ndarray]:
    """Output, lse and gradients from the float64 torch reference."""

    def tensor(name, grad=False):
        x = arrays[name]
        if x is None:
            return None
        if x.dtype.kind == "f" or x.dtype.name == "bfloat16":
            x = x.astype(np.float64)
        return torch.tensor(x, device=device, requires_grad=grad)

    q, k, v, sinks, bias = (tensor(name, True) for name in PRIMALS)
    out, lse = reference.attention(
        q,
        k,
        v,
        q_segment_ids=tensor("q_segment_ids"),
        kv_segment_ids=tensor("kv_segment_ids"),
        mask=tensor("mask"),
        q_lengths=tensor("q_lengths"),
        kv_lengths=tensor("kv_lengths"),
        bias=bias,
        sinks=sinks,
        **case.options(),
    )
    loss = (out * tensor("dout")).sum()
    if arrays["dlse"] is not None:
        dlse = tensor("dlse")
        loss = loss + torch.where(torch.isinf(lse), 0.0, lse * dlse).sum()
    loss.backward()
    result = {"out": out, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if sinks is not None:
        result["dsinks"] = sinks.grad
    if bias is not None:
        result["dbias"] = bias.grad
    return {name: x.detach().cpu().numpy() for name, x in result.items()}


def _paged_attend(case: Case, arrays: dict, implementation: Implementation, lengths: dict):
    """``attend(q, k, v)`` of a paged case: k and v written into their slots of the
    case's page pools (so that the gradients flow back to them through
    ``paged_attention``'s), then `jaxtile.paged_attention` with the case's page table."""
    if not isinstance(implementation, str):
        raise NotImplementedError("a paged case runs jaxtile.paged_attention, which takes a registered name")
    table = arrays["page_table"]
    position = np.arange(case.kv)
    page, offset = table[:, position // case.page_size], position % case.page_size
    k_pool, v_pool = jnp.asarray(arrays["k_pages"]), jnp.asarray(arrays["v_pages"])
    kv_lengths = lengths["kv_lengths"]
    if kv_lengths is None:
        kv_lengths = jnp.full(case.batch, case.kv, jnp.int32)

    def attend(q, k, v, *extras):
        return jaxtile.paged_attention(
            q,
            k_pool.at[:, page, offset].set(k.transpose(2, 0, 1, 3)),
            v_pool.at[:, page, offset].set(v.transpose(2, 0, 1, 3)),
            jnp.asarray(table),
            kv_lengths,
            q_lengths=lengths["q_lengths"],
            implementation=implementation,
            return_lse=True,
            **_extras(arrays, extras),
            **case.options(),
        )

    return attend


def _extras(arrays: dict, extras: tuple) -> dict:
    """The ``sinks=`` and ``bias=`` keywords of an attention call, from ``attend``'s
    differentiated arguments after q, k, v (those of `PRIMALS` the case has)."""
    return dict(zip([name for name in PRIMALS[3:] if arrays[name] is not None], extras))


def _differentiated(arrays: dict) -> list[str]:
    """The names of `PRIMALS` the case has, in order."""
    return [name for name in PRIMALS if arrays[name] is not None]


def jaxtile_function(case: Case, arrays: dict, implementation: Implementation):
    """A freshly jitted ``run`` and its arguments: ``run(*args)`` gives jaxtile's
    ``(out, lse, dq, dk, dv)`` (and ``dsinks``, ``dbias`` for a case with them) on the case's
    arrays, in their dtypes (a paged case through `jaxtile.paged_attention`, gradients
    with respect to the contiguous k, v)."""
    segment_ids = None
    if arrays["q_segment_ids"] is not None:
        segment_ids = (jnp.asarray(arrays["q_segment_ids"]), jnp.asarray(arrays["kv_segment_ids"]))
    mask = None if arrays["mask"] is None else jnp.asarray(arrays["mask"])
    lengths = {
        name: None if arrays[name] is None else jnp.asarray(arrays[name]) for name in ("q_lengths", "kv_lengths")
    }
    if case.page_size is not None:
        attend = _paged_attend(case, arrays, implementation, lengths)
    else:
        if isinstance(implementation, str):
            implementation = functools.partial(jaxtile.flash_attention, implementation=implementation)

        def attend(q, k, v, *extras):
            return implementation(
                q,
                k,
                v,
                segment_ids=segment_ids,
                mask=mask,
                **lengths,
                block_q=case.block_q,
                block_k=case.block_k,
                return_lse=True,
                **_extras(arrays, extras),
                **case.options(),
            )

    @jax.jit
    def run(dout, dlse, *primals):
        (out, lse), vjp = jax.vjp(attend, *primals)
        return (out, lse, *vjp((dout, dlse)))

    primals = [jnp.asarray(arrays[name]) for name in _differentiated(arrays)]
    dlse = jnp.zeros((*case.batch, case.num_heads, case.q_len), jnp.float32)
    if arrays["dlse"] is not None:
        dlse = jnp.asarray(arrays["dlse"])
    return run, (jnp.asarray(arrays["dout"]), dlse, *primals)


def jaxtile_result(case: Case, arrays: dict, implementation: Implementation) -> dict[str, np.ndarray]:
    """Output, lse and gradients from jaxtile, compiled once with ``jit``."""
    run, args = jaxtile_function(case, arrays, implementation)
    values = jax.block_until_ready(run(*args))
    names = ("out", "lse", *(f"d{name}" for name in _differentiated(arrays)))
    return {name: np.asarray(x.astype(jnp.float32)) for name, x in zip(names, values)}


def run_case(case: Case, implementation: Implementation, device: str = "cpu") -> Result:
    """Compares jaxtile's ``implementation`` with the torch reference on ``case``
    (exceptions propagate; the suite records them as rows instead)."""
    problem = Problem.create(case, device)
    start = time.perf_counter()
    values = jaxtile_result(case, problem.arrays, implementation)
    return problem.judge(implementation_name(implementation), values, time.perf_counter() - start)
