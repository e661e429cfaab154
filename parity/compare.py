"""How two results are compared, and the one table of tolerances per dtype.

Each quantity (out, lse, dq, dk, dv) is compared to the float64 reference by

* ``rel_l2 = ||x - ref|| / ||ref||`` over the finite reference entries, and
* ``max_err = max |x - ref| / max |ref|``, the worst element relative to the scale;

both must be within the dtype's tolerance. Non-finite values fail unless the reference
has exactly the same value there (the lse of a row that sees no key is ``-inf``).

Large logits are ill-conditioned in any float32 softmax: a logit of size ``|s|`` carries an
absolute rounding error of about ``|s| * u`` (``u = 2**-24``), which becomes a relative
error of the probabilities, and FlashAttention's backward pass recomputes them from a
float32 lse. So each tolerance grows by ``LOGIT_SLACK * u * max|lse|``: negligible for
ordinary inputs (``|lse| ~ 10``), and the attainable accuracy for logits of 1e4.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Tolerance:
    rel_l2: float
    max_err: float


# Inputs are rounded to the dtype before both frameworks see them, so these bound the
# kernels' own arithmetic: float32 accumulation, with P and dS rounded to the input dtype
# before their matrix products (as every FlashAttention kernel does). For the 16-bit
# types that is about 4 unit roundoffs in relative L2 and 16 in the worst element
# (bfloat16 u = 2**-8, float16 u = 2**-11); float32 is held to 1e-5 relative.
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(rel_l2=1e-5, max_err=1e-4),
    "float16": Tolerance(rel_l2=2e-3, max_err=8e-3),
    "bfloat16": Tolerance(rel_l2=1.6e-2, max_err=6.4e-2),
}
LOGIT_SLACK = 8.0
UNIT_ROUNDOFF_F32 = 2.0**-24


@dataclasses.dataclass(frozen=True)
class Error:
    rel_l2: float
    max_err: float
    ok: bool
    note: str = ""


def tolerance(dtype: str, lse: np.ndarray) -> Tolerance:
    """The dtype's tolerance, widened for the conditioning of logits of the size of the
    reference's largest finite ``|lse|`` (``lse``: any shape; ``-inf`` rows see no key)."""
    base = TOLERANCES[dtype]
    slack = LOGIT_SLACK * UNIT_ROUNDOFF_F32 * float(np.abs(lse[np.isfinite(lse)]).max(initial=0.0))
    return Tolerance(base.rel_l2 + slack, base.max_err + slack)


def finite(x: np.ndarray) -> Error:
    """Only checks that ``x`` holds no NaN or Inf (errors reported as NaN: not compared)."""
    ok = bool(np.isfinite(np.asarray(x, np.float64)).all())
    return Error(np.nan, np.nan, ok, "finite only" if ok else "NaN or Inf")


def compare(x: np.ndarray, ref: np.ndarray, tol: Tolerance) -> Error:
    """Errors of ``x`` against ``ref`` (float64) and whether they are within ``tol``."""
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    if x.shape != ref.shape:
        return Error(np.inf, np.inf, False, f"shape {x.shape} != {ref.shape}")
    finite = np.isfinite(ref)
    if not np.array_equal(x[~finite], ref[~finite], equal_nan=True):
        return Error(np.inf, np.inf, False, "non-finite entries differ from the reference")
    if not np.isfinite(x[finite]).all():
        return Error(np.inf, np.inf, False, "NaN or Inf where the reference is finite")
    diff = x[finite] - ref[finite]
    ref = ref[finite]
    scale = max(float(np.abs(ref).max(initial=0.0)), 1e-30)
    norm = max(float(np.linalg.norm(ref)), 1e-30)
    rel_l2 = float(np.linalg.norm(diff)) / norm
    max_err = float(np.abs(diff).max(initial=0.0)) / scale
    return Error(rel_l2, max_err, rel_l2 <= tol.rel_l2 and max_err <= tol.max_err)
