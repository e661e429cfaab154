"""Runs one case through jaxtile and through the PyTorch reference, and compares."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jaxtile
from parity import reference
from parity.case import Case, make_inputs
from parity.compare import Error, Tolerance, compare, finite, tolerance

QUANTITIES = ("out", "lse", "dq", "dk", "dv")


@dataclasses.dataclass(frozen=True)
class Result:
    case: Case
    implementation: str
    errors: dict[str, Error]
    tolerance: Tolerance
    seconds: float

    @property
    def ok(self) -> bool:
        return all(e.ok for e in self.errors.values())

    def describe(self) -> str:
        lines = [f"{self.case.name} [{self.implementation}, {self.case.dtype}]: {'ok' if self.ok else 'FAILED'}"]
        tol = self.tolerance
        for name, e in self.errors.items():
            flag = "" if e.ok else "  <-- over tolerance" + (f" ({e.note})" if e.note else "")
            lines.append(
                f"  {name:4s} rel_l2={e.rel_l2:.2e} (tol {tol.rel_l2:.1e})  max={e.max_err:.2e} (tol {tol.max_err:.1e}){flag}"
            )
        return "\n".join(lines)


def torch_reference(case: Case, arrays: dict, device: str = "cpu") -> dict[str, np.ndarray]:
    """Output, lse and gradients from the float64 torch reference."""

    def tensor(name, grad=False):
        x = arrays[name]
        if x is None:
            return None
        if x.dtype.kind == "f" or x.dtype.name == "bfloat16":
            x = x.astype(np.float64)
        return torch.tensor(x, device=device, requires_grad=grad)

    q, k, v = tensor("q", True), tensor("k", True), tensor("v", True)
    out, lse = reference.attention(
        q,
        k,
        v,
        q_segment_ids=tensor("q_segment_ids"),
        kv_segment_ids=tensor("kv_segment_ids"),
        mask=tensor("mask"),
        **case.options(),
    )
    loss = (out * tensor("dout")).sum()
    if arrays["dlse"] is not None:
        dlse = tensor("dlse")
        loss = loss + torch.where(torch.isinf(lse), 0.0, lse * dlse).sum()
    loss.backward()
    result = {"out": out, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return {name: x.detach().cpu().numpy() for name, x in result.items()}


def jaxtile_result(case: Case, arrays: dict, implementation: str) -> dict[str, np.ndarray]:
    """Output, lse and gradients from jaxtile, compiled once with ``jit``."""
    segment_ids = None
    if arrays["q_segment_ids"] is not None:
        segment_ids = (jnp.asarray(arrays["q_segment_ids"]), jnp.asarray(arrays["kv_segment_ids"]))
    mask = None if arrays["mask"] is None else jnp.asarray(arrays["mask"])

    def attend(q, k, v):
        return jaxtile.flash_attention(
            q,
            k,
            v,
            segment_ids=segment_ids,
            mask=mask,
            implementation=implementation,
            block_q=case.block_q,
            block_k=case.block_k,
            return_lse=True,
            **case.options(),
        )

    @jax.jit
    def run(q, k, v, dout, dlse):
        (out, lse), vjp = jax.vjp(attend, q, k, v)
        return (out, lse, *vjp((dout, dlse)))

    q, k, v, dout = (jnp.asarray(arrays[name]) for name in ("q", "k", "v", "dout"))
    dlse = jnp.zeros((*case.batch, case.num_heads, case.q_len), jnp.float32)
    if arrays["dlse"] is not None:
        dlse = jnp.asarray(arrays["dlse"])
    values = jax.block_until_ready(run(q, k, v, dout, dlse))
    return {name: np.asarray(x.astype(jnp.float32)) for name, x in zip(QUANTITIES, values)}


def run_case(case: Case, implementation: str, device: str = "cpu") -> Result:
    """Compares jaxtile's ``implementation`` with the torch reference on ``case``."""
    arrays = make_inputs(case)
    expected = torch_reference(case, arrays, device)
    start = time.perf_counter()
    actual = jaxtile_result(case, arrays, implementation)
    seconds = time.perf_counter() - start
    lse = expected["lse"]
    tol = tolerance(case.dtype, float(np.abs(lse[np.isfinite(lse)]).max(initial=0.0)))
    errors = {
        name: compare(actual[name], expected[name], tol)
        if case.grads or name in ("out", "lse")
        else finite(actual[name])
        for name in QUANTITIES
    }
    return Result(case, implementation, errors, tol, seconds)
