"""`jaxtile.dot_product_attention` against ``jax.nn.dot_product_attention`` itself.

Hypothesis draws problems in jax.nn's terms (q_len below, equal to or above kv_len, GQA,
``is_causal``, ``local_window_size``, query and key lengths, boolean masks, additive biases
of every broadcast shape) and every implementation that takes the problem must give jax.nn's
``"xla"`` output, residual (lse) and gradients (the bias's among them), with
the tolerances of ``parity.compare``. The one deliberate difference is checked too: a
query that sees no key gets output 0 (jax.nn's fill of large negative logits gives it
the mean of all values), so those rows are compared with 0 instead. A fixed seed per
implementation draws the same examples on every run (``JAXTILE_HYPOTHESIS_EXAMPLES``
and ``JAXTILE_HYPOTHESIS_SEED`` change them, as in ``test_properties``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, seed, settings
from hypothesis import strategies as st
from jax_settings import jax_test_config

import jaxtile
from parity.compare import TOLERANCES, compare

TOL = TOLERANCES["float32"]
# Examples per implementation, by what its record says (on CPU: 12 for the reference, 8
# for each lax implementation, 4 for each interpreted kernel; 40 in all, each compiled
# twice: CI's time, not coverage, sets these; test_properties checks every implementation
# against float64 on its own examples, and ``JAXTILE_HYPOTHESIS_EXAMPLES`` draws more).
EXAMPLES = {"interpreted": 4, "tiled": 8, "materialised": 12}


def _examples(impl) -> int:
    if jax.default_backend() not in impl.platforms:
        return EXAMPLES["interpreted"]
    return EXAMPLES["tiled" if impl.tiled else "materialised"]


@st.composite
def problems(draw, max_q_len: int | None) -> dict:
    q_len = draw(st.integers(1, min(40, max_q_len or 40)))
    kv_len = draw(st.integers(1, 40))
    batch, num_kv_heads = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    num_heads = num_kv_heads * draw(st.sampled_from((1, 2, 3)))
    head_dim = draw(st.sampled_from((8, 12, 16)))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    side = st.integers(0, 12)
    options = dict(
        is_causal=draw(st.booleans()),
        local_window_size=draw(st.one_of(st.none(), side, st.tuples(side, side))),
    )
    if draw(st.booleans()):
        options["query_seq_lengths"] = jnp.asarray(rng.integers(0, q_len + 1, batch), jnp.int32)
    if draw(st.booleans()):
        options["key_value_seq_lengths"] = jnp.asarray(rng.integers(0, kv_len + 1, batch), jnp.int32)
    mask_shape = draw(st.sampled_from((None, (batch, num_heads), (1, num_heads), (batch, 1))))
    if mask_shape is not None:
        options["mask"] = jnp.asarray(rng.random((*mask_shape, q_len, kv_len)) < 0.8)
    bias_shape = draw(
        st.sampled_from((None, (batch, num_heads, q_len, kv_len), (1, num_heads, q_len, kv_len), (batch, 1, 1, kv_len)))
    )
    arrays = dict(
        query=normal(batch, q_len, num_heads, head_dim),
        key=normal(batch, kv_len, num_kv_heads, head_dim),
        value=normal(batch, kv_len, num_kv_heads, head_dim),
        dout=normal(batch, q_len, num_heads, head_dim),
        bias=None if bias_shape is None else normal(*bias_shape),
    )
    return arrays | {"options": options}


def _visible(
    query,
    key,
    *,
    is_causal,
    local_window_size=None,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    mask=None,
) -> np.ndarray:
    """``[batch, heads, q_len, kv_len]`` bool: jax.nn's mask, rebuilt in NumPy from its
    documentation (top-left positions)."""
    batch, q_len, num_heads = query.shape[:3]
    kv_len = key.shape[1]
    i, j = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    ok = np.ones((batch, num_heads, q_len, kv_len), bool)
    if is_causal:
        ok &= j <= i
    if local_window_size is not None:
        left, right = (local_window_size,) * 2 if isinstance(local_window_size, int) else local_window_size
        ok &= (i - left <= j) & (j <= i + right)
    if query_seq_lengths is not None:
        ok &= i < np.asarray(query_seq_lengths)[:, None, None, None]
    if key_value_seq_lengths is not None:
        ok &= j < np.asarray(key_value_seq_lengths)[:, None, None, None]
    if mask is not None:
        ok &= np.asarray(mask)
    return ok


def _budget(implementation: str, examples: int):
    examples = int(os.environ.get("JAXTILE_HYPOTHESIS_EXAMPLES", examples))
    chosen = zlib.crc32(f"jax_nn/{implementation}".encode()) + int(os.environ.get("JAXTILE_HYPOTHESIS_SEED", 0))
    budget = settings(max_examples=examples, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    return lambda test: seed(chosen)(budget(test))


def _run(attention, query, key, value, bias, dout, row_weight, options):
    """``(out, lse, dq, dk, dv[, dbias])``, compiled as one program: the cotangent
    ``dout`` on the rows ``row_weight`` keeps (``[batch, q_len, heads]``)."""
    arrays = {name: x for name, x in options.items() if isinstance(x, jax.Array)}
    static = {name: x for name, x in options.items() if name not in arrays}

    @jax.jit
    def run(query, key, value, bias, dout, row_weight, arrays):
        def attend(q, k, v, *bias):
            return attention(q, k, v, *bias, return_residual=True, **static, **arrays)

        (out, lse), vjp = jax.vjp(attend, query, key, value, *([] if bias is None else [bias]))
        grads = vjp((dout * row_weight[..., None], jnp.zeros_like(lse)))
        return (out, lse, *grads)

    return run(query, key, value, bias, dout, row_weight, arrays)


def _check_random_problems(impl, examples: int | None = None, setting=contextlib.nullcontext):
    """The property test, jaxtile running under ``setting`` (jax.nn under defaults)."""
    block = 16 if impl.power_of_two_blocks else 8

    @_budget(impl.name, examples or _examples(impl))
    @given(problems(impl.max_q_len))
    def check(problem):
        options = problem.pop("options")
        assume(problem["bias"] is None or "bias" in impl.features)
        visible = _visible(problem["query"], problem["key"], **options)
        sees = visible.any(-1).transpose(0, 2, 1)  # [batch, q_len, heads]
        # A row that sees one key has an exact dS of 0 (see parity.case.Case.grads):
        # some row must see two or more for the gradients to be comparable.
        assume((visible.sum(-1) >= 2).any())
        mine = functools.partial(jaxtile.dot_product_attention, implementation=impl.name, block_q=block, block_k=block)
        theirs = functools.partial(jax.nn.dot_product_attention, implementation="xla")
        arrays = (problem[name] for name in ("query", "key", "value", "bias", "dout"))
        args = (*arrays, jnp.asarray(sees, jnp.float32))
        with setting():
            got = _run(mine, *args, options)
        with jax.default_matmul_precision("highest"):  # XLA's float32 default on GPUs is TF32
            expected = _run(theirs, *args, options)
        what = f"{impl.name} {dict((k, v.shape) for k, v in problem.items() if v is not None)} {options}"
        rows = sees[..., None]
        out = np.asarray(got[0])
        assert not np.any(np.where(rows, 0.0, out)), f"{what}: a row that sees no key is not 0"
        assert compare(np.where(rows, out, 0.0), np.where(rows, expected[0], 0.0), TOL).ok, what
        lse_ok = compare(np.asarray(got[1])[sees], np.asarray(expected[1])[sees], TOL)
        assert lse_ok.ok, f"{what}: residual {lse_ok}"
        assert len(got) == len(expected), what
        for name, x, ref in zip(("dq", "dk", "dv", "dbias"), got[2:], expected[2:]):
            error = compare(np.asarray(x), np.asarray(ref), TOL)
            assert error.ok, f"{what}: {name} {error}"

    check()


def test_random_problems_match_jax_nn(impl):
    _check_random_problems(impl)


def test_random_problems_match_jax_nn_under_jax_test_config(impl):
    # JAX's own test settings with x64 (under which jax.nn's lengths fail itself).
    _check_random_problems(impl, examples=3, setting=jax_test_config)


def _arrays(batch=(2,), q_len=24, kv_len=24, num_heads=4, num_kv_heads=2, head_dim=16, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((*batch, q_len, num_heads, head_dim), (*batch, kv_len, num_kv_heads, head_dim))
    return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in (shapes[0], shapes[1], shapes[1]))


def _close(got, expected, what: str):
    error = compare(np.asarray(got), np.asarray(expected), TOL)
    assert error.ok, f"{what}: {error}"


def test_unbatched_inputs_and_residual_as_jax_nn():
    q, k, v = (x[0] for x in _arrays(q_len=10, kv_len=20))
    options = dict(is_causal=True, local_window_size=(5, 0), return_residual=True)
    out, lse = jaxtile.dot_product_attention(q, k, v, **options)
    expected_out, expected_lse = jax.nn.dot_product_attention(q, k, v, implementation="xla", **options)
    assert out.shape == q.shape and lse.shape == q.shape[:2] and lse.dtype == q.dtype
    _close(out, expected_out, "unbatched out")
    _close(lse, expected_lse, "unbatched residual")


def test_top_left_causal_differs_from_flash_attention_as_documented():
    # jax.nn's first query sees only the first key; flash_attention's sees kv_len - q_len + 1.
    q, k, v = _arrays(q_len=4, kv_len=12)
    top_left = jaxtile.dot_product_attention(q, k, v, is_causal=True)
    _close(top_left, jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"), "top-left")
    _close(top_left[:, 0], jnp.repeat(v[:, 0], 2, axis=1), "first query sees the first key")
    bottom_right = jaxtile.flash_attention(q, k, v, causal=True)
    _close(bottom_right, jaxtile.dot_product_attention(q, k, v, local_window_size=(12, 8)), "shifted")


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        (dict(bias=jnp.ones((1, 4, 24, 23))), ValueError, r"bias of shape \(1, 4, 24, 23\) does not broadcast"),
        (dict(bias=jnp.ones((1, 4, 24, 24), jnp.int32)), TypeError, "bias.dtype=int32 is not supported"),
        (dict(implementation="cudnn"), ValueError, "unknown implementation='cudnn'"),
        (dict(return_residual=1), TypeError, "return_lse must be a Python bool"),
        (dict(sinks=jnp.zeros(3)), ValueError, r"sinks must have shape \(4,\)"),
    ],
)
def test_refuses_what_it_cannot_do(kwargs, error, text):
    q, k, v = _arrays()
    with pytest.raises(error, match=text):
        jaxtile.dot_product_attention(q, k, v, **kwargs)


# The README's mappings from other libraries' conventions, run as written there.
def _readme_conventions() -> str:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    return readme.split("<!-- conventions -->\n```python\n")[1].split("```")[0]


def test_readme_convention_mappings():
    q, k, v = _arrays(q_len=40, kv_len=40)
    rng = np.random.default_rng(1)
    ids = np.sort(rng.integers(0, 4, (2, 40)), axis=1)  # 0 = padding (MaxText)
    scope = dict(
        jaxtile=jaxtile,
        q=q,
        k=k,
        v=v,
        q_scaled=q / np.sqrt(q.shape[-1]),
        decoder_segment_ids=jnp.asarray(ids, jnp.int32),
        W=7,
        causal=True,
        window_size=(-1, 3),
        softcap=0.0,
        mask=jnp.asarray(rng.random((2, 1, 40, 40)) < 0.8),
    )
    exec(_readme_conventions(), scope)
    i, j = np.arange(40)[:, None], np.arange(40)[None, :]

    def defined(allowed, soft_cap=None):
        """Attention by definition: the dense pattern through the reference."""
        return jaxtile.flash_attention(
            q, k, v, mask=jnp.asarray(allowed), logits_soft_cap=soft_cap, implementation="reference"
        )

    same_document = ids[:, None, :, None] == ids[:, None, None, :]
    _close(scope["maxtext"], defined(same_document & (j <= i)), "MaxText")
    _close(scope["levanter"], defined((j <= i) & (j > i - 7)), "Levanter sliding_window=7")
    _close(scope["flash_attn"], defined(j <= i), "flash-attn window_size=(-1, 3), causal")
    _close(scope["jax_nn"], defined(np.asarray(scope["mask"]) & (j <= i) & (j >= i - 6)), "jax.nn")
