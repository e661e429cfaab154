"""Numerical edge cases: huge logits, the edge of float16's range, all-equal scores, rows
that see one key, tiny scales, and how NaN and Inf in an input propagate.

Values are compared with the float64 torch reference and the tolerances of
`parity.compare`; where a case makes the gradient comparison meaningless (a one-hot
softmax, see ``Case.grads``), gradients are only required to be finite. A decode kernel
runs each case's decode-sized variant (`_decode`), whose keys split-KV decoding shares out.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtile
from jaxtile import _softmax as sm
from jaxtile._core import Shape
from jaxtile.triton import _kernel as pk
from jaxtile.triton import decode
from parity.case import Case, make_inputs
from parity.compare import finite, tolerance
from parity.run import Problem, jaxtile_result, run_case, torch_reference

B = 16
FLOAT16_MAX = float(np.finfo(np.float16).max)
# An implementation that takes fewer queries than a case (a decode kernel: its record's
# ``max_q_len``) runs the case's decode-sized variant (`_decode`): as many queries as it
# takes, at the end of a cache of DECODE_KV keys, long enough that split-KV decoding cuts
# its key tiles into shares and merges them (`test_decode_variants_split_the_keys`).
DECODE_KV = 512


def _decode(impl, case: Case, **changes) -> Case:
    return case.decode_sized(impl.max_q_len, changes.pop("kv_len", DECODE_KV), **changes)


def test_decode_variants_split_the_keys():
    """The decode-sized variants cut pallas_decode's keys into several shares here, in
    `B`-key tiles and in its default float32 ones (`num_splits`, with one head per
    query tile: the most programs, so the fewest shares)."""
    queries = decode.IMPLEMENTATION.max_q_len
    for block_k in (B, decode.DEFAULTS[4].block_k):
        dims = Shape(2, queries, DECODE_KV, 4, 2, 16, 16, 4)
        assert decode.num_splits(dims, pk.Tiles(B, block_k, 2), pk.sm_count(jax.default_backend())) > 1, block_k


def _problem(case: Case, arrays: dict) -> Problem:
    """`parity.run.Problem` for hand-made arrays (``Problem.create`` draws its own)."""
    expected = torch_reference(case, arrays)
    return Problem(case, arrays, expected, tolerance(case.dtype, expected["lse"]))


def _max_logit(case: Case, arrays: dict) -> float:
    """The largest |scaled score| of the case, visible or not."""
    q, k = (arrays[name].astype(np.float64) for name in ("q", "k"))
    group = case.num_heads // case.kv_heads
    k = np.repeat(k, group, axis=-2)
    scale = case.scale if case.scale is not None else case.head_dim**-0.5
    return float(np.abs(np.einsum("...thd,...shd->...hts", q, k) * scale).max())


def _assert_ok(errors: dict, what: str):
    bad = {name: e for name, e in errors.items() if not e.ok}
    assert not bad, f"{what}: {bad}"


# --- Large logits --------------------------------------------------------------------


def test_logits_of_1e4_in_float32(impl):
    """Scores of ±1e4 (one-hot rows): out and lse match, gradients stay finite."""
    case = Case(
        "logits_1e4",
        q_len=40,
        kv_len=56,
        num_kv_heads=2,
        head_dim=16,
        causal=True,
        segments=2,
        input_scale=100.0,
        grads=False,
        block_q=B,
        block_k=B,
    )
    case = _decode(impl, case)
    assert _max_logit(case, make_inputs(case)) > 1e4
    result = run_case(case, impl.name)
    assert result.ok, result.describe()


def test_logits_at_the_edge_of_float16_range(impl):
    """float16 q and k whose scores reach 2^15..2^16 (float16's largest finite value is
    65504): scores are accumulated in float32, so nothing overflows."""
    case = Case(
        "logits_fp16_edge",
        q_len=40,
        num_kv_heads=2,
        head_dim=16,
        dtype="float16",
        window=(9, 3),
        input_scale=100.0,
        grads=False,
        block_q=B,
        block_k=B,
    )
    case = _decode(impl, case)
    assert 2**15 < _max_logit(case, make_inputs(case)) < FLOAT16_MAX
    result = run_case(case, impl.name)
    assert result.ok, result.describe()


# --- float16 outputs and gradients near the top of the range ---------------------------


@pytest.mark.parametrize("values", ["uniform", "all_max"])
def test_float16_output_does_not_overflow(impl, values):
    """v up to ±65504 (or all exactly 65504): the output, a convex combination of rows of
    v, fits in float16 and must not overflow, whatever rounding P gets before P V."""
    case = Case(
        "fp16_v_edge", q_len=40, num_kv_heads=2, head_dim=16, dtype="float16", causal=True, block_q=B, block_k=B
    )
    case = _decode(impl, case)
    arrays = make_inputs(case)
    rng = np.random.default_rng(1)
    shape = arrays["v"].shape
    magnitude = rng.uniform(-1, 1, shape) if values == "uniform" else np.ones(shape)
    arrays["v"] = (magnitude * FLOAT16_MAX).astype(np.float16)
    got = jaxtile_result(case, arrays, impl.name)
    _assert_ok(_problem(case, arrays).errors({name: got[name] for name in ("out", "lse")}), values)


def _large_ds_arrays(case: Case) -> dict:
    """Nearly equal scores (small q, one shared key plus noise), v = ±60000 alternating by
    key and a positive output cotangent: ``dP = dO vᵀ`` is ~1e6, so ``dS = P (dP - D)``
    exceeds float16's range on rows that see few keys, while dQ = dS K and dK = dSᵀ Q
    stay small (the large terms of opposite sign cancel; Q is small)."""
    rng = np.random.default_rng(2)
    arrays = make_inputs(case)
    shape_q, shape_k = arrays["q"].shape, arrays["k"].shape
    arrays["q"] = (0.01 * rng.standard_normal(shape_q)).astype(np.float16)
    shared = rng.standard_normal((*shape_k[:-3], 1, *shape_k[-2:]))
    arrays["k"] = (shared + 0.01 * rng.standard_normal(shape_k)).astype(np.float16)
    sign = np.where(np.arange(shape_k[-3]) % 2 == 0, 1.0, -1.0)[:, None, None]
    arrays["v"] = np.broadcast_to(60000.0 * sign, arrays["v"].shape).astype(np.float16)
    arrays["dout"] = (np.abs(rng.standard_normal(arrays["dout"].shape)) + 0.5).astype(np.float16)
    return arrays


def test_float16_gradients_do_not_overflow(impl):
    """Gradients that fit in float16 must not overflow on the way, even when the
    intermediate ``dS`` does not fit (``_large_ds_arrays``; the Pallas kernels, which
    round dS to float16 for the matrix units, scale it per row). Finiteness only: the
    cancellation that keeps dQ small makes its relative error meaningless to bound. The
    decode-sized variant's rows see 4 keys each (a window), so that dS overflows there too."""
    case = Case(
        "fp16_large_ds",
        batch=(1,),
        q_len=32,
        num_heads=2,
        head_dim=16,
        dtype="float16",
        causal=True,
        block_q=B,
        block_k=B,
    )
    case = _decode(impl, case, window=(3, 0))
    arrays = _large_ds_arrays(case)
    problem = _problem(case, arrays)
    assert max(np.abs(problem.expected[name]).max() for name in ("dq", "dk", "dv")) < FLOAT16_MAX / 4
    values = jaxtile_result(case, arrays, impl.name)
    _assert_ok({name: finite(values[name]) for name in ("out", "dq", "dk", "dv")}, "float16 gradients")


# --- Degenerate softmax rows ----------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_all_equal_scores(impl, dtype):
    """Every key of a (batch, kv head) is the same vector, so every visible score of a
    row is equal and the softmax is uniform. The exact dQ is then 0 (``Σ_j dS_ij = 0``)
    unless the lse is differentiated too, which this case does."""
    case = Case(
        "equal_scores",
        q_len=40,
        kv_len=48,
        num_kv_heads=2,
        head_dim=16,
        dtype=dtype,
        window=(20, 5),
        lse_grad=True,
        block_q=B,
        block_k=B,
    )
    case = _decode(impl, case)
    arrays = make_inputs(case)
    arrays["k"] = np.broadcast_to(arrays["k"][..., :1, :, :], arrays["k"].shape).copy()
    problem = _problem(case, arrays)
    values = jaxtile_result(case, arrays, impl.name)
    _assert_ok(problem.errors(values), "all-equal scores")


ONE_KEY = (
    # Every row sees exactly its diagonal key.
    Case("diagonal", q_len=40, num_kv_heads=2, head_dim=16, window=(0, 0), lse_grad=True),
    # Decoding against a cache: row i sees key i + 16 only.
    Case("decode_band", q_len=24, kv_len=40, num_kv_heads=1, head_dim=16, window=(0, 0), lse_grad=True),
    # More queries than keys, causal: rows 0-19 see nothing, row 20 one key, row 21 two...
    Case("q_longer_causal", q_len=40, kv_len=20, head_dim=16, causal=True, lse_grad=True),
    Case("diagonal_bf16", q_len=40, num_kv_heads=2, head_dim=16, dtype="bfloat16", window=(0, 0), lse_grad=True),
)


@pytest.mark.parametrize("case", ONE_KEY, ids=lambda c: c.name)
def test_rows_that_see_one_key(impl, case):
    """A row with one visible key has probability exactly 1 there: out = that row of v,
    lse = its score. Its exact dS is 0, so the lse is differentiated too (``lse_grad``),
    which gives dQ and dK rows of order 1 to compare. A decode-sized variant keeps more
    queries than keys where the case has them (16 queries, 10 keys: rows 0-5 see nothing,
    row 6 one key)."""
    case = _decode(impl, case, **({"kv_len": 10} if case.kv < case.q_len else {}))
    result = run_case(case.replace(block_q=B, block_k=B), impl.name)
    assert result.ok, result.describe()


def test_scale_below_float32_range(impl):
    """A positive scale so small that it is 0 in float32 acts as a zero scale (uniform
    softmax), never NaN."""
    case = _decode(impl, Case("tiny_scale", q_len=40, head_dim=16, causal=True, scale=1e-300))
    result = run_case(case, impl.name)
    assert result.ok, result.describe()


# --- NaN and Inf propagation -----------------------------------------------------------
#
# One entry of one input is poisoned, at batch element 1, kv head 1 (query heads 2, 3)
# and head dim 3, at the middle query row or the key on its diagonal (`_poison_at`);
# causal with a left window of 12. In `NAN_CASE` that is row 20 or key 20, seen by rows
# 20..32; in its decode-sized variant (16 queries, 512 keys), row 8 or key 504, seen by
# rows 8..15. "The rows it touches":
#   q[1, row, 3, 3]: that query row (all of its output and its lse);
#   k[1, key, 1, 3]: every row of query heads 2 and 3 that sees the key (output and lse);
#   v[1, key, 1, 3]: column 3 of the output of every row that sees the key (not the lse).
# Everything else must be bitwise what the clean inputs give; the same for gradients,
# where defined (NaN, not Inf, whose inf - inf is NaN anyway).

NAN_CASE = Case("poisoned", q_len=40, num_kv_heads=2, head_dim=8, causal=True, window=(12, 0), block_q=B, block_k=B)
POISON_B, POISON_KV_HEAD, POISON_DIM = 1, 1, 3
POISON_HEADS = [2, 3]


def _poison_at(case: Case) -> tuple[int, int]:
    """The poisoned query row (the middle one) and key (on that row's diagonal)."""
    row = case.q_len // 2
    return row, row + case.kv - case.q_len


def _visible(case: Case) -> np.ndarray:
    """``[q_len, kv_len]`` visibility of `NAN_CASE` (or its variant: queries end where keys do)."""
    i, j = np.arange(case.q_len)[:, None] + case.kv - case.q_len, np.arange(case.kv)[None, :]
    return (j <= i) & (j >= i - case.window[0])


def _padding(case: Case) -> np.ndarray:
    """The last 8 keys of batch element 1 as padding (an unfilled KV cache): no query sees them."""
    padding = np.ones((2, 1, 1, case.kv), bool)
    padding[POISON_B, ..., -8:] = False
    return padding


@functools.cache
def _runner(implementation: str, case: Case, padded: bool = False):
    """Jitted ``(q, k, v, dout) -> (out, lse, dq, dk, dv)`` of ``case`` (with `_padding`
    as a mask if ``padded``), compiled once."""
    mask = jnp.asarray(_padding(case)) if padded else None

    def attend(q, k, v):
        return jaxtile.flash_attention(
            q,
            k,
            v,
            causal=case.causal,
            window=case.window,
            mask=mask,
            implementation=implementation,
            block_q=B,
            block_k=B,
            return_lse=True,
        )

    @jax.jit
    def run(q, k, v, dout):
        (out, lse), vjp = jax.vjp(attend, q, k, v)
        return (out, lse, *vjp((dout, jnp.zeros_like(lse))))

    return run


def _run(implementation: str, case: Case, arrays: dict, padded: bool = False) -> dict[str, np.ndarray]:
    values = _runner(implementation, case, padded)(*(arrays[name] for name in ("q", "k", "v", "dout")))
    return dict(zip(("out", "lse", "dq", "dk", "dv"), (np.asarray(x) for x in values)))


def _poisoned(case: Case, name: str, value: float) -> dict:
    arrays = make_inputs(case)
    arrays[name] = arrays[name].copy()
    head = POISON_HEADS[1] if name == "q" else POISON_KV_HEAD
    arrays[name][POISON_B, _poison_at(case)[name != "q"], head, POISON_DIM] = value
    return arrays


def _assert_same_bits(got: np.ndarray, clean: np.ndarray, where: np.ndarray, what: str):
    assert np.array_equal(got[where], clean[where]), f"{what}: entries the poison does not touch changed"


def _outside_group(shape_heads: int, kv_heads: bool) -> np.ndarray:
    """Entries ``[batch, len, heads, dim]`` outside the poisoned batch element and kv head group."""
    heads = [POISON_KV_HEAD] if kv_heads else POISON_HEADS
    outside = np.ones((2, 1, shape_heads, 1), bool)
    outside[POISON_B, :, heads] = False
    return outside


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("poisoned", ["q", "k"])
def test_nan_and_inf_in_q_or_k_reach_exactly_their_rows(impl, poisoned, value):
    """Out and lse are non-finite exactly where the float64 reference is; for NaN that is
    exactly the rows it touches. Other entries are bitwise those of the clean inputs.
    (+Inf in k gives a -inf score on rows whose q is negative in that dim: the key drops
    out of those rows, which stay finite; the reference agrees.)"""
    case = _decode(impl, NAN_CASE)
    row, key = _poison_at(case)
    arrays = _poisoned(case, poisoned, value)
    got, clean = _run(impl.name, case, arrays), _run(impl.name, case, make_inputs(case))
    expected = torch_reference(case, arrays)
    rows = np.zeros((2, case.q_len, case.num_heads), bool)  # [b, t, h]
    if poisoned == "q":
        rows[POISON_B, row, POISON_HEADS[1]] = True
    else:
        rows[POISON_B, _visible(case)[:, key], POISON_HEADS[0] :] = True
    for name, touched in (("out", rows[..., None]), ("lse", rows.transpose(0, 2, 1))):
        bad = ~np.isfinite(got[name])
        bad_ref = ~np.isfinite(expected[name])
        assert np.array_equal(bad, bad_ref), f"{name}: non-finite at {np.argwhere(bad ^ bad_ref)[:5]} (vs reference)"
        if np.isnan(value):
            assert np.array_equal(bad_ref, np.broadcast_to(touched, bad.shape)), (
                "reference: NaN not in the touched rows"
            )
        _assert_same_bits(got[name], clean[name], ~np.broadcast_to(touched, bad.shape), name)


def _gradient_poison(case: Case, poisoned: str) -> dict[str, np.ndarray]:
    """Where a NaN at `_poisoned`'s entry of ``poisoned`` must be in dq, dk and dv (bool,
    their shapes): every entry that depends on it, through the rows R that it makes NaN
    (the query row; for k or v, the rows that see the key) and the keys those rows see."""
    vis, (row, key) = _visible(case), _poison_at(case)
    heads = np.zeros(case.num_heads, bool)
    heads[[POISON_HEADS[1]] if poisoned == "q" else POISON_HEADS] = True
    rows = np.arange(case.q_len) == row if poisoned == "q" else vis[:, key]
    keys = vis[rows].any(axis=0)
    dq = np.zeros((2, case.q_len, case.num_heads, case.head_dim), bool)
    dq[POISON_B] = rows[:, None, None] & heads[:, None]
    dk = np.zeros((2, case.kv, case.kv_heads, case.head_dim), bool)
    dk[POISON_B, keys, POISON_KV_HEAD] = True
    # dV = Pᵀ dO: P does not depend on v.
    return {"dq": dq, "dk": dk, "dv": dk if poisoned != "v" else np.zeros_like(dk)}


@pytest.mark.parametrize("poisoned", ["q", "k", "v"])
def test_nan_reaches_exactly_the_gradients_that_depend_on_it(impl, poisoned):
    """NaN in one input entry: the gradient entries that depend on it (`_gradient_poison`)
    are NaN, and every other entry is bitwise that of the clean inputs. The tiled
    implementations hold this exactly; the reference's autodiff of its materialised
    ``P V`` spreads the NaN further inside the poisoned batch element and kv head group
    (``0 · NaN`` in the transposed products), so for it only the outside is checked."""
    case = _decode(impl, NAN_CASE)
    got, clean = _run(impl.name, case, _poisoned(case, poisoned, np.nan)), _run(impl.name, case, make_inputs(case))
    for name, must in _gradient_poison(case, poisoned).items():
        assert np.isnan(got[name][must]).all(), f"{name}: NaN hidden from entries that depend on it"
        untouched = ~must
        if not impl.tiled:
            untouched = np.broadcast_to(_outside_group(got[name].shape[2], kv_heads=name != "dq"), must.shape)
        _assert_same_bits(got[name], clean[name], untouched, name)


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
def test_nan_and_inf_in_v_reach_the_rows_that_see_the_key(impl, value):
    """Column 3 of every row that sees the key is non-finite; other columns, the lse, and
    everything outside the batch element and kv head group are bitwise unchanged."""
    case = _decode(impl, NAN_CASE)
    got, clean = _run(impl.name, case, _poisoned(case, "v", value)), _run(impl.name, case, make_inputs(case))
    seen_by = _visible(case)[:, _poison_at(case)[1]]
    column = got["out"][POISON_B][seen_by][:, POISON_HEADS, POISON_DIM]
    assert not np.isfinite(column).any(), "hidden from a row that sees the key"
    _assert_same_bits(got["lse"], clean["lse"], np.ones(got["lse"].shape, bool), "lse")
    other_columns = np.ones(got["out"].shape, bool)
    other_columns[..., POISON_DIM] = False
    _assert_same_bits(got["out"], clean["out"], other_columns, "out, other columns")
    outside = np.broadcast_to(_outside_group(case.num_heads, kv_heads=False), got["out"].shape)
    _assert_same_bits(got["out"], clean["out"], outside, "out outside the group")


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
def test_nan_and_inf_in_v_spare_rows_that_do_not_see_the_key(impl, value):
    """Rows that do not see the key (rows 0..19 and 33..39 in `NAN_CASE`) keep their
    clean output."""
    case = _decode(impl, NAN_CASE)
    got, clean = _run(impl.name, case, _poisoned(case, "v", value)), _run(impl.name, case, make_inputs(case))
    spared = np.ones(got["out"].shape, bool)
    spared[POISON_B, _visible(case)[:, _poison_at(case)[1]]] = False
    _assert_same_bits(got["out"], clean["out"], spared, "rows that do not see the key")


def test_masked_dot_follows_ieee_on_visible_entries_only():
    """`masked_dot` (every implementation's ``P V`` in masked tiles): a row sums exactly
    the values it sees, IEEE rules included (NaN, inf + -inf = NaN, one-signed infinities),
    as if its masked entries were absent; a masked ``0 · NaN`` reaches nobody."""
    v = jnp.array([[1.0, jnp.inf], [jnp.nan, -jnp.inf], [2.0, 3.0], [jnp.inf, jnp.nan]])
    visible = jnp.array([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 1, 0], [0, 0, 0, 0]], bool)
    p = jnp.where(visible, jnp.array([[0.5, 0.5, 0.0, 0.0], [0.25, 0.0, 0.75, 0.0], [0, 0, 1, 0], [0, 0, 0, 0]]), 0)
    got = np.asarray(sm.masked_dot(jnp.dot, p, v, visible))
    expected = np.array([[np.nan, np.nan], [1.75, np.inf], [2.0, 3.0], [0.0, 0.0]])
    np.testing.assert_array_equal(got, expected)
    assert np.isnan(np.asarray(jnp.dot(p, v))[2:]).any(), "the plain product spreads NaN (what this guards)"


@pytest.mark.parametrize("poisoned", ["k", "v"])
def test_nan_in_keys_no_query_sees_changes_nothing(impl, poisoned):
    """NaN in every padded key (`_padding`, e.g. an unfilled KV cache): outputs and
    gradients are bitwise those of clean padding."""
    case = _decode(impl, NAN_CASE)
    arrays = make_inputs(case)
    clean = _run(impl.name, case, arrays, padded=True)
    arrays[poisoned] = arrays[poisoned].copy()
    arrays[poisoned][POISON_B, -8:] = np.nan
    got = _run(impl.name, case, arrays, padded=True)
    for name in ("out", "lse", "dq", "dk", "dv"):
        _assert_same_bits(got[name], clean[name], np.ones(got[name].shape, bool), name)
