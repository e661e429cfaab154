"""``jaxtile.paged_attention``: against ``flash_attention`` on the gathered contiguous
cache (the definition, up to the order of summation) and against the float64 parity
reference (`parity.reference`), with pages in random order, shared pages, uneven fills,
every dtype, for every implementation whose record reads the pages in place
(``paged_forward``) and the default; a user's pallas_decode tuning; gradients; ``jit``;
bad input."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax_settings import jax_test_config

import jaxtile
from jaxtile import registry
from jaxtile._core import Config, Inputs
from jaxtile._softmax import Logits
from jaxtile.mask import MaskSpec
from jaxtile.triton import decode
from jaxtile.triton.tuning import KernelTuning
from parity import reference
from parity.compare import compare, tolerance

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# The default (None: on the CPU, an implementation that gathers the pages) and every
# implementation whose record reads the pages in place; a call one cannot run is skipped
# (`registry.Unsupported`, through conftest).
PAGED = (None, *(i for i in registry.implementations() if i.paged_forward is not None))
over_paged = pytest.mark.parametrize("impl", PAGED, ids=lambda i: "default" if i is None else i.name)


def _name(impl: registry.Implementation | None) -> str | None:
    return None if impl is None else impl.name


@dataclasses.dataclass(frozen=True)
class Paged:
    """A paged problem: ``kv_lengths`` (and ``q_lengths``) per sequence; ``layout`` is
    ``"shuffled"`` (distinct pages, a random permutation of the pool) or ``"shared"``
    (sequence 1 uses sequence 0's pages, sequence 2 shares its first two)."""

    name: str
    kv_lengths: tuple[int, ...]
    q_lengths: tuple[int, ...] | None = None
    q_len: int = 1
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 16
    page_size: int = 4
    pages_per_sequence: int = 6
    spare_pages: int = 5
    layout: str = "shuffled"
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    logits_soft_cap: float | None = None
    input_scale: float = 1.0
    dtype: str = "float32"
    seed: int = 0

    @property
    def batch(self) -> int:
        return len(self.kv_lengths)

    def options(self) -> dict:
        return dict(causal=self.causal, window=self.window, logits_soft_cap=self.logits_soft_cap)


CASES = [
    # Every fill: a full cache (24 = 6 pages x 4), partial pages, an empty cache.
    Paged("decode_gqa_ps4", kv_lengths=(24, 5, 0, 13)),
    Paged("decode_gqa_ps4_bf16", kv_lengths=(24, 5, 0, 13), dtype="bfloat16"),
    Paged("decode_shared_pages", kv_lengths=(24, 17, 8, 0), layout="shared"),
    Paged(
        "decode3_mqa_causal_ps16",
        q_len=3,
        num_heads=4,
        num_kv_heads=1,
        page_size=16,
        pages_per_sequence=3,
        kv_lengths=(48, 17, 2, 0),
        causal=True,
    ),
    Paged(
        "decode3_mqa_soft_cap_ps16_shared",
        q_len=3,
        num_heads=4,
        num_kv_heads=1,
        page_size=16,
        pages_per_sequence=3,
        kv_lengths=(40, 48, 33),
        layout="shared",
        logits_soft_cap=5.0,
        input_scale=3.0,
    ),
    Paged(
        "prefill16_window_ragged",
        q_len=16,
        head_dim=32,
        pages_per_sequence=8,
        kv_lengths=(32, 20, 9, 16),
        q_lengths=(16, 7, 0, 16),
        causal=True,
        window=(6, 0),
    ),
    Paged(
        "prefill16_causal_ps16_bf16",
        q_len=16,
        page_size=16,
        pages_per_sequence=2,
        kv_lengths=(32, 16, 0),
        q_lengths=(16, 5, 0),
        causal=True,
        layout="shared",
        dtype="bfloat16",
    ),
    Paged(
        "decode3_gqa_causal_ps8_shared_fp16",
        q_len=3,
        page_size=8,
        pages_per_sequence=3,
        kv_lengths=(24, 19, 3, 0),
        causal=True,
        layout="shared",
        dtype="float16",
    ),
]


def _inputs(case: Paged) -> dict[str, np.ndarray]:
    """Standard-normal query and page pool (unused pages and slots hold values too) in
    the case's dtype, a page table of the case's layout, lengths int32."""
    rng = np.random.default_rng(case.seed)
    dtype = DTYPES[case.dtype]
    b, p = case.batch, case.pages_per_sequence
    num_pages = b * p + case.spare_pages

    def normal(*shape, scale=1.0):
        return np.asarray(jnp.asarray(rng.standard_normal(shape) * scale, dtype))

    pool = (case.num_kv_heads, num_pages, case.page_size, case.head_dim)
    table = rng.permutation(num_pages)[: b * p].reshape(b, p).astype(np.int32)
    if case.layout == "shared":
        table[1] = table[0]
        table[2, :2] = table[0, :2]
    q_lengths = None if case.q_lengths is None else np.asarray(case.q_lengths, np.int32)
    return dict(
        query=normal(b, case.q_len, case.num_heads, case.head_dim, scale=case.input_scale),
        k_pages=normal(*pool, scale=case.input_scale),
        v_pages=normal(*pool),
        page_table=table,
        kv_lengths=np.asarray(case.kv_lengths, np.int32),
        q_lengths=q_lengths,
    )


def _contiguous(pages, table: np.ndarray):
    """``[batch, pages_per_sequence * page_size, num_kv_heads, dim]`` (NumPy or torch):
    each sequence's pages laid end to end, page by page (independent of
    ``jaxtile._core.gather_pages``)."""
    heads, _, _, dim = pages.shape
    rows = pages[:, table.astype(np.int64)]  # [heads, batch, pages_per_sequence, page_size, dim]
    return rows.reshape(heads, len(table), -1, dim).swapaxes(0, 1).swapaxes(1, 2)


def _reference(case: Paged, arrays: dict, query, k_pages, v_pages):
    """The float64 parity reference on torch tensors (differentiable), on the contiguous
    caches: ``(out, lse)``, 0 and ``-inf`` for a row that sees no key."""
    table = arrays["page_table"]
    lengths = {n: None if arrays[n] is None else torch.from_numpy(arrays[n]) for n in ("q_lengths", "kv_lengths")}
    keys, values = _contiguous(k_pages, table), _contiguous(v_pages, table)
    return reference.attention(query, keys, values, **lengths, **case.options())


def _expected(case: Paged, arrays: dict) -> tuple[np.ndarray, np.ndarray]:
    """The float64 reference, in NumPy."""
    f64 = (torch.from_numpy(np.asarray(arrays[name], np.float64)) for name in ("query", "k_pages", "v_pages"))
    return tuple(x.numpy() for x in _reference(case, arrays, *f64))


def _paged(arrays: dict, **options):
    return jaxtile.paged_attention(
        *(jnp.asarray(arrays[name]) for name in ("query", "k_pages", "v_pages", "page_table", "kv_lengths")),
        q_lengths=None if arrays["q_lengths"] is None else jnp.asarray(arrays["q_lengths"]),
        return_lse=True,
        **options,
    )


def _check(case: Paged, arrays: dict, out, lse) -> None:
    """``out``, ``lse`` against the float64 reference within the dtype's tolerance; rows
    that see no key exactly 0 and ``-inf``."""
    expected_out, expected_lse = _expected(case, arrays)
    tol = tolerance(case.dtype, expected_lse)
    assert lse.dtype == jnp.float32
    out, lse = np.asarray(out, np.float64), np.asarray(lse)
    for name, got, want in (("out", out, expected_out), ("lse", lse, expected_lse)):
        error = compare(got, want, tol)
        assert error.ok, f"{case.name}: {name} {error} (tolerance {tol})"
    empty = np.isneginf(expected_lse)  # [batch, heads, q_len]
    assert np.array_equal(np.isneginf(lse), empty)
    assert (out.transpose(0, 2, 1, 3)[empty] == 0).all()
    assert np.isfinite(out).all()


@over_paged
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_flash_attention_and_float64_reference(case, impl):
    arrays = _inputs(case)
    out, lse = _paged(arrays, implementation=_name(impl), **case.options())
    assert out.shape == (case.batch, case.q_len, case.num_heads, case.head_dim)
    assert out.dtype == DTYPES[case.dtype]
    assert lse.shape == (case.batch, case.num_heads, case.q_len)
    table = arrays["page_table"]
    direct_out, direct_lse = jaxtile.flash_attention(
        jnp.asarray(arrays["query"]),
        jnp.asarray(_contiguous(arrays["k_pages"], table)),
        jnp.asarray(_contiguous(arrays["v_pages"], table)),
        kv_lengths=jnp.asarray(arrays["kv_lengths"]),
        q_lengths=None if arrays["q_lengths"] is None else jnp.asarray(arrays["q_lengths"]),
        return_lse=True,
        implementation=_name(impl),
        **case.options(),
    )
    _same_up_to_order(out, direct_out, DTYPES[case.dtype])
    _same_up_to_order(lse, direct_lse, jnp.float32)
    _check(case, arrays, out, lse)


def _same_up_to_order(got, want, dtype) -> None:
    """Equal up to the order of summation: a kernel that reads the pages stops its key
    tiles at page boundaries, which a call on the contiguous cache need not (on a GPU,
    the last bits differ; interpreted, they agree). Within 8 units in the last place of
    ``dtype`` (of the largest magnitude); infinities exactly."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), finite) and np.array_equal(got[~finite], want[~finite])
    eps = float(jnp.finfo(dtype).eps)
    scale = np.abs(want[finite]).max(initial=0.0)
    np.testing.assert_allclose(got[finite], want[finite], rtol=8 * eps, atol=8 * eps * scale)


@over_paged
@pytest.mark.parametrize("seed", range(6))
def test_random_configurations(seed, impl):
    """Random shapes, fills and page tables (pages drawn with repetition: shared pages and
    unused ones), against the float64 reference."""
    rng = np.random.default_rng(1000 + seed)
    batch, page_size = int(rng.integers(1, 5)), int(rng.choice([4, 8, 16]))
    pages_per_sequence = int(rng.integers(1, 6))
    capacity = pages_per_sequence * page_size
    q_len = int(rng.choice([1, 2, 5]))
    num_kv_heads = int(rng.choice([1, 2]))
    case = Paged(
        f"random_{seed}",
        kv_lengths=tuple(int(n) for n in rng.integers(0, capacity + 1, batch)),
        q_lengths=tuple(int(n) for n in rng.integers(0, q_len + 1, batch)) if rng.random() < 0.5 else None,
        q_len=q_len,
        num_heads=num_kv_heads * int(rng.choice([1, 2, 4])),
        num_kv_heads=num_kv_heads,
        page_size=page_size,
        pages_per_sequence=pages_per_sequence,
        causal=bool(rng.random() < 0.5),
        window=[None, (3, 0), (None, 2), (5, 5)][int(rng.integers(4))],
        seed=seed,
    )
    arrays = _inputs(case)
    num_pages = arrays["k_pages"].shape[1]
    arrays["page_table"] = rng.integers(0, num_pages, (batch, pages_per_sequence)).astype(np.int32)
    _check(case, arrays, *_paged(arrays, implementation=_name(impl), **case.options()))


@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_decode_in_any_number_of_shares(num_splits):
    """pallas_decode with the user's ``num_splits`` (`jaxtile.triton.decode.Tuning`) on
    the contiguous cache: one share, a few, and more shares than key tiles (the extra
    ones empty), each the float64 reference's output and lse."""
    case = Paged("shares", kv_lengths=(48, 5, 0, 29), q_len=3, head_dim=24, pages_per_sequence=12)
    arrays = _inputs(case)
    table = arrays["page_table"]
    t = KernelTuning(16, 16, 4, 2)
    out, lse = jaxtile.flash_attention(
        jnp.asarray(arrays["query"]),
        jnp.asarray(_contiguous(arrays["k_pages"], table)),
        jnp.asarray(_contiguous(arrays["v_pages"], table)),
        kv_lengths=jnp.asarray(arrays["kv_lengths"]),
        implementation="pallas_decode",
        tuning=decode.Tuning(t, t, t, num_splits=num_splits),
        return_lse=True,
    )
    _check(case, arrays, out, lse)


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("page_size", [64, 16, 6])
def test_decode_reads_tiles_within_a_page_and_across_pages(page_size, q_len):
    """pallas_decode's 32-key tiles read pages of 64 keys as slices of one page and
    gather the rows of pages of 16 (tiles of whole pages) and of 6 (tiles that cross page
    boundaries anywhere), in two shares, with shared pages, uneven fills and a padded head
    dim, looking each tile's page ids up at its own step (one query) or a step ahead
    (three): each the float64 reference's output and lse (`jaxtile.triton._kernel.Pages`)."""
    case = Paged(
        f"pages_of_{page_size}",
        kv_lengths=(128, 77, 0, 5),
        q_len=q_len,
        head_dim=24,
        page_size=page_size,
        pages_per_sequence=-(-128 // page_size),
        layout="shared",
    )
    t = KernelTuning(16, 32, 4, 2)
    tuning = decode.Tuning(t, t, t, num_splits=2)
    _check(case, _inputs(case), *_paged(_inputs(case), implementation="pallas_decode", tuning=tuning))


@pytest.mark.parametrize("num_splits", [0, -2, 2.0])
def test_decode_share_count_must_be_a_positive_int(num_splits):
    t = KernelTuning(16, 16, 4, 2)
    with pytest.raises(ValueError, match=f"num_splits={num_splits!r}"):
        decode.Tuning(t, t, t, num_splits=num_splits)


def test_a_split_kv_forward_refuses_sinks():
    """Shares of the keys merge by their lse: sinks taken in each would count once per
    share, so the kernel refuses them (pallas_decode's record does not take them)."""
    q, k = (jax.ShapeDtypeStruct((1, n, 4, 32), jnp.bfloat16) for n in (2, 256))
    inputs = Inputs(q, k, k, sinks=jax.ShapeDtypeStruct((4,), jnp.float32))
    config = Config(MaskSpec.create(2, 256), Logits(32**-0.5), platform="cpu")
    with pytest.raises(ValueError, match="got shares=2"):
        decode.v2.forward_pass(inputs, config, KernelTuning(16, 32, 4, 2), splits=lambda dims, tiles: 2)
    assert not registry.get("pallas_decode").takes_sinks


@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_reads_pages_with_the_users_tuning(monkeypatch, num_splits):
    """``paged_attention(tuning=decode.Tuning(...))``: pallas_decode reads the pages in
    the user's 64-key tiles and ``num_splits`` shares, not its defaults for pages (here
    32-key float32 tiles in 2 shares), and gives the float64 reference's output and lse."""
    case = Paged("user_tuning", kv_lengths=(512, 301), q_len=3, page_size=16, pages_per_sequence=32)
    arrays = _inputs(case)
    seen = []
    forward_pass = decode.v2.forward_pass

    def spy(inputs, config, tuning, **options):
        out, lse = forward_pass(inputs, config, tuning, **options)
        seen.append((tuning.block_k, out.shape[0], options["paged"] is not None))
        return out, lse

    monkeypatch.setattr(decode.v2, "forward_pass", spy)
    t = KernelTuning(16, 64, 4, 2)
    tuning = decode.Tuning(t, t, t, num_splits=num_splits)
    _check(case, arrays, *_paged(arrays, implementation="pallas_decode", tuning=tuning))
    assert seen == [(64, num_splits, True)]


def test_paged_decode_autotunes_on_the_pages(monkeypatch):
    """``tuning="autotune"`` (forced here on CPU, where pallas_decode takes its defaults):
    each candidate is timed reading the pages, chosen apart from the contiguous cache
    of the same shape, and the result is the float64 reference's."""
    case = Paged("autotune", kv_lengths=(24, 5), q_len=3)
    arrays = _inputs(case)
    timed = []
    median_seconds = decode.tn.median_seconds

    def counting(run, repeats=5):
        seconds = median_seconds(run, repeats)
        timed.append(seconds)
        return seconds

    monkeypatch.setattr(decode.tn, "median_seconds", counting)
    monkeypatch.setattr(decode.tn, "_AUTOTUNED", {})
    monkeypatch.setattr(decode, "_tuning", lambda inputs, config, paged=None: decode._autotuned(inputs, config, paged))
    _check(case, arrays, *_paged(arrays, implementation="pallas_decode", tuning="autotune"))
    assert len(timed) == len(decode.CANDIDATES), "every candidate runs on the pages"
    assert [key[-1] for key in decode.tn._AUTOTUNED] == [case.page_size]


@over_paged
def test_gradients_match_float64_reference(impl):
    """dq, dk_pages, dv_pages (shared pages accumulate, unused pages get 0) under a random
    output and lse cotangent, against torch autograd of the float64 reference."""
    case = Paged(
        "grads", q_len=3, kv_lengths=(24, 17, 9, 0), q_lengths=(3, 2, 3, 1), layout="shared", causal=True, window=(6, 0)
    )
    arrays = _inputs(case)
    rng = np.random.default_rng(7)
    dout = rng.standard_normal((case.batch, case.q_len, case.num_heads, case.head_dim))
    dlse = rng.standard_normal((case.batch, case.num_heads, case.q_len))
    table, kv_lengths, q_lengths = arrays["page_table"], arrays["kv_lengths"], arrays["q_lengths"]

    def loss(query, k_pages, v_pages):
        options = dict(q_lengths=q_lengths, return_lse=True, implementation=_name(impl), **case.options())
        out, lse = jaxtile.paged_attention(query, k_pages, v_pages, table, kv_lengths, **options)
        return (out * dout).sum() + jnp.where(jnp.isinf(lse), 0.0, lse * dlse).sum()

    names = ("query", "k_pages", "v_pages")
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*(jnp.asarray(arrays[name]) for name in names))
    primals = [torch.tensor(np.asarray(arrays[name], np.float64), requires_grad=True) for name in names]
    out, lse = _reference(case, arrays, *primals)
    torch_loss = (out * torch.from_numpy(dout)).sum() + torch.where(
        lse.isinf(), 0.0, lse * torch.from_numpy(dlse)
    ).sum()
    torch_loss.backward()
    tol = tolerance(case.dtype, lse.detach().numpy())
    for name, g, w in zip(("dq", "dk_pages", "dv_pages"), got, primals):
        error = compare(np.asarray(g), w.grad.numpy(), tol)
        assert error.ok, f"{name}: {error} (tolerance {tol})"
    unused = np.setdiff1d(np.arange(arrays["k_pages"].shape[1]), table)
    assert unused.size and not np.asarray(got[1])[:, unused].any() and not np.asarray(got[2])[:, unused].any()


def test_under_jit_with_traced_table_and_lengths():
    """One compilation serves every page table and fill; traced page indices are clipped."""
    case = CASES[5]  # prefill16_window_ragged
    arrays = _inputs(case)
    query, k_pages, v_pages = (jnp.asarray(arrays[name]) for name in ("query", "k_pages", "v_pages"))

    @jax.jit
    def step(page_table, kv_lengths, q_lengths):
        return jaxtile.paged_attention(
            query, k_pages, v_pages, page_table, kv_lengths, q_lengths=q_lengths, return_lse=True, **case.options()
        )

    table, kv_lengths, q_lengths = arrays["page_table"], arrays["kv_lengths"], arrays["q_lengths"]
    _check(case, arrays, *step(table, kv_lengths, q_lengths))
    rolled = dict(arrays, page_table=np.roll(table, 1, axis=0), kv_lengths=np.roll(kv_lengths, 1))
    _check(case, rolled, *step(rolled["page_table"], rolled["kv_lengths"], q_lengths))
    assert step._cache_size() == 1
    num_pages = k_pages.shape[1]
    outside = table.copy()
    outside[0, 0], outside[1, 1] = num_pages + 3, -2
    clipped = np.clip(outside, 0, num_pages - 1)
    for got, want in zip(step(outside, kv_lengths, q_lengths), step(clipped, kv_lengths, q_lengths)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_every_implementation_under_jax_test_config(impl):
    case = CASES[3]  # decode3_mqa_causal_ps16
    arrays = _inputs(case)
    with jax_test_config():
        got = _paged(arrays, implementation=impl.name, **case.options())
    _check(case, arrays, *got)


# Valid arguments: batch 3, q_len 2, 4 heads, 2 kv heads, head_dim 8, 10 pages of 4, 3 pages per sequence.
_Q = jnp.zeros((3, 2, 4, 8))
_PAGES = jnp.zeros((2, 10, 4, 8))
_TABLE = jnp.arange(9, dtype=jnp.int32).reshape(3, 3)
_LENGTHS = jnp.array([12, 5, 0])
VALID = dict(query=_Q, k_pages=_PAGES, v_pages=_PAGES, page_table=_TABLE, kv_lengths=_LENGTHS)

# (description, arguments replaced, exception, text the message must contain)
BAD_INPUTS = [
    ("page index too large", dict(page_table=_TABLE.at[1, 2].set(10)), ValueError, "[0, 10) (num_pages=10); got [10]"),
    (
        "negative page index",
        dict(page_table=_TABLE.at[2, 0].set(-1)),
        ValueError,
        "got [-1] at (sequence, page) [(2, 0)]",
    ),
    (
        "kv_lengths past the page table",
        dict(kv_lengths=jnp.array([13, 5, 0])),
        ValueError,
        "kv_lengths must lie in [0, 12] (pages_per_sequence=3 * page_size=4); got [13]",
    ),
    ("negative kv_lengths", dict(kv_lengths=jnp.array([1, -1, 0])), ValueError, "got [-1]"),
    ("kv_lengths shape", dict(kv_lengths=jnp.array([1, 2])), ValueError, "kv_lengths must have shape (3,)"),
    ("q_lengths too long", dict(q_lengths=jnp.array([3, 0, 0])), ValueError, "q_lengths must lie in [0, 2] (q_len=2)"),
    (
        "page_table batch",
        dict(page_table=_TABLE[:2]),
        ValueError,
        "page_table must have shape (3, pages_per_sequence); got page_table.shape=(2, 3)",
    ),
    ("page_table rank", dict(page_table=_TABLE.reshape(-1)), ValueError, "page_table.shape=(9,)"),
    ("float page_table", dict(page_table=_TABLE.astype(jnp.float32)), TypeError, "integer dtype; got float32"),
    (
        "pages disagree",
        dict(v_pages=jnp.zeros((2, 10, 8, 8))),
        ValueError,
        "k_pages and v_pages must agree on [num_kv_heads, num_pages, page_size]",
    ),
    ("pages rank", dict(k_pages=_PAGES[0]), ValueError, "k_pages.shape=(10, 4, 8)"),
    ("query rank", dict(query=_Q[0]), ValueError, "query.shape=(2, 4, 8)"),
    ("head_dim", dict(query=jnp.zeros((3, 2, 4, 16))), ValueError, "head_dim of query and k_pages differ"),
    (
        "heads not a multiple",
        dict(k_pages=jnp.zeros((3, 10, 4, 8)), v_pages=jnp.zeros((3, 10, 4, 8))),
        ValueError,
        "num_heads=4 is not a multiple of num_kv_heads=3",
    ),
    ("dtypes differ", dict(query=_Q.astype(jnp.bfloat16)), TypeError, "query.dtype=dtype(bfloat16)"),
    ("int query", dict(query=_Q.astype(jnp.int32)), TypeError, "query.dtype=int32 is not supported"),
]


@pytest.mark.parametrize(("what", "changes", "error", "text"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input(what, changes, error, text):
    arguments = {**VALID, **changes}
    with pytest.raises(error) as raised:
        jaxtile.paged_attention(**arguments)
    assert text in str(raised.value)


@pytest.mark.parametrize("tuning", ["fast", KernelTuning(16, 64, 4, 2)], ids=["string", "kernel_tuning"])
def test_bad_tuning_raises_as_flash_attention_does(tuning):
    with pytest.raises(TypeError) as paged:
        jaxtile.paged_attention(**VALID, tuning=tuning)
    cache = jnp.zeros((3, 12, 2, 8))
    with pytest.raises(TypeError) as direct:
        jaxtile.flash_attention(_Q, cache, cache, kv_lengths=_LENGTHS, tuning=tuning)
    assert str(paged.value) == str(direct.value) and f"got {tuning!r}" in str(paged.value)


def test_shape_errors_raise_under_jit():
    with pytest.raises(ValueError, match="page_table must have shape"):
        jax.jit(lambda table: jaxtile.paged_attention(_Q, _PAGES, _PAGES, table, _LENGTHS))(_TABLE[:, None])
