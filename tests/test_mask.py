"""The mask description against brute force: spans cover every visible pair, interior
spans need no element-wise mask, and the two loop directions agree."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from jaxtile.mask import MaskSpec

WINDOWS = (None, (3, 0), (0, 3), (5, 9), (0, 0), (None, 4), (17, None), (200, 200))


def _visible(spec: MaskSpec) -> np.ndarray:
    """Brute-force ``[q_len, kv_len]`` visibility of a structured spec."""
    return np.asarray(spec.visible(np.arange(spec.q_len)[:, None], np.arange(spec.kv_len)[None, :]))


def _pairs(spans_of, n_outer: int, n_inner: int, block_outer: int, block_inner: int):
    """``{(outer, inner): masked}`` over every span of every outer tile."""
    pairs = {}
    for outer in range(n_outer):
        for span in spans_of(outer):
            assert int(span.start) <= int(span.stop)
            for inner in range(int(span.start), int(span.stop)):
                assert (outer, inner) not in pairs, "tile visited twice"
                pairs[(outer, inner)] = span.masked
    return pairs


CONFIGS = [
    (q_len, kv_len, causal, window, bq, bk)
    for (q_len, kv_len), causal, window, (bq, bk) in itertools.product(
        [(1, 1), (17, 17), (64, 64), (40, 72), (72, 40), (1, 50), (100, 7)],
        [False, True],
        WINDOWS,
        [(16, 16), (16, 32), (32, 16)],
    )
]


# Top-left positions (jax.nn's) on a third of the configurations.
ALIGNED = [(*c, False) for c in CONFIGS] + [(*c, True) for c in CONFIGS[::3]]


def _positions(spec: MaskSpec, q_length, kv_length) -> np.ndarray:
    """Query positions by definition: ``i``, or bottom-right ``i + kv_length - q_length``."""
    rows = np.arange(spec.q_len)[:, None]
    return rows if spec.top_left else rows + kv_length - q_length


def _in_window(pos, keys, causal: bool, window) -> np.ndarray:
    """By definition (``shared/API.md``), from the call's own ``causal`` and ``window``:
    ``causal`` hides keys past the query's position; ``window`` ``w`` is ``(w, w)``, a
    side of None unbounded."""
    left, right = (window, window) if isinstance(window, int) else window or (None, None)
    visible = (keys <= pos) | (not causal)
    visible &= True if left is None else keys >= pos - left
    return visible & (True if right is None else keys <= pos + right)


@pytest.mark.parametrize("q_len,kv_len,causal,window,bq,bk,top_left", ALIGNED)
def test_spans_cover_exactly_the_visible_tiles(q_len, kv_len, causal, window, bq, bk, top_left):
    spec = MaskSpec.create(q_len, kv_len, causal=causal, window=window, top_left=top_left)
    vis = _visible(spec)
    pos, keys = _positions(spec, q_len, kv_len), np.arange(kv_len)[None, :]
    np.testing.assert_array_equal(vis, _in_window(pos, keys, causal, window))
    n_q, n_kv = -(-q_len // bq), -(-kv_len // bk)
    forward = _pairs(lambda t: spec.kv_spans(t, bq, bk), n_q, n_kv, bq, bk)
    backward = _pairs(lambda u: spec.q_spans(u, bq, bk), n_kv, n_q, bk, bq)
    backward = {(t, u): masked for (u, t), masked in backward.items()}
    for t, u in itertools.product(range(n_q), range(n_kv)):
        tile = vis[t * bq : (t + 1) * bq, u * bk : (u + 1) * bk]
        # Interior means: every row in bounds sees every key slot, and all slots are keys.
        interior = tile.all() and (u + 1) * bk <= kv_len
        for pairs in (forward, backward):
            if tile.any():
                assert (t, u) in pairs, f"visible tile ({t}, {u}) skipped"
            if (t, u) in pairs and not pairs[(t, u)]:
                assert interior, f"tile ({t}, {u}) marked interior but needs the mask"
        assert forward.get((t, u)) == backward.get((t, u)), "loop directions disagree"


def test_causal_visits_about_half_the_tiles():
    spec = MaskSpec.create(4096, 4096, causal=True)
    visits = sum(int(s.stop) - int(s.start) for t in range(32) for s in spec.kv_spans(t, 128, 128))
    assert visits == 32 * 33 // 2


@pytest.mark.parametrize("window", [(256, 256), (250, 0), (100, 37)])
def test_window_visits_about_w_over_tile_plus_two(window):
    tile, n = 64, 4096
    spec = MaskSpec.create(n, n, window=window)
    per_q_tile = [sum(int(s.stop) - int(s.start) for s in spec.kv_spans(t, tile, tile)) for t in range(n // tile)]
    width = window[0] + window[1]
    assert max(per_q_tile) <= width // tile + 2
    middle = per_q_tile[len(per_q_tile) // 4 : -len(per_q_tile) // 4]
    assert min(middle) >= width // tile


def test_segments_and_dense_masks_mask_every_tile():
    spec = MaskSpec.create(64, 64, causal=True, has_segments=True)
    spans = spec.kv_spans(3, 16, 16)
    assert [s.masked for s in spans] == [True]
    assert (int(spans[0].start), int(spans[0].stop)) == (0, 4)


def test_only_segment_ids_and_dense_masks_mask_single_elements():
    """`MaskSpec.masks_elements` (which sets the Mosaic kernels' tiles) is true where a
    runtime array decides single pairs, not for lengths, positions or windows."""
    for runtime, expected in (
        (dict(), False),
        (dict(has_lengths=True), False),
        (dict(has_segments=True), True),
        (dict(has_dense_mask=True), True),
        (dict(has_segments=True, has_lengths=True), True),
    ):
        spec = MaskSpec.create(256, 512, causal=True, window=(100, 0), **runtime)
        assert spec.masks_elements == expected, runtime


def _one_sided(q_len, kv_len, causal, window, *_alignment) -> bool:
    """Whether the mask bounds keys on one side at most (the rows' key counts are then
    monotone)."""
    spec = MaskSpec.create(q_len, kv_len, causal=causal, window=window)
    return spec.left is None or spec.right is None


# The masks of `ALIGNED` (each once: the tiles do not change what a row sees).
MASKS = list(
    dict.fromkeys((q_len, kv_len, causal, window, top_left) for q_len, kv_len, causal, window, *_, top_left in ALIGNED)
)
ONE_SIDED = [m for m in MASKS if _one_sided(*m)]


@pytest.mark.parametrize("q_len,kv_len,causal,window,top_left", ONE_SIDED)
def test_heaviest_last_launches_the_short_query_rows_last(q_len, kv_len, causal, window, top_left):
    """Kernels launch query tiles last to first where `MaskSpec.heaviest_last`: in launch
    order, each row sees at most as many keys as the rows launched before it (counted
    by definition)."""
    spec = MaskSpec.create(q_len, kv_len, causal=causal, window=window, top_left=top_left)
    keys = np.arange(kv_len)[None, :]
    seen = _in_window(_positions(spec, q_len, kv_len), keys, causal, window).sum(axis=1)
    launched = seen[::-1] if spec.heaviest_last else seen
    assert (np.diff(launched) <= 0).all(), seen


def test_sees_every_key_where_nothing_bounds_the_keys():
    """`MaskSpec.sees_every_key` (which gives long calls the Mosaic forward's widest key
    tiles) holds with no causal mask, window or runtime part, and every row then sees
    every key (counted by definition)."""
    for q_len, kv_len, causal, window, top_left in MASKS:
        spec = MaskSpec.create(q_len, kv_len, causal=causal, window=window, top_left=top_left)
        assert spec.sees_every_key == (window is None and not causal), spec
        seen = _in_window(_positions(spec, q_len, kv_len), np.arange(kv_len)[None, :], causal, window)
        assert seen.all() or not spec.sees_every_key, spec
        for runtime in ("has_lengths", "has_segments", "has_dense_mask"):
            assert not dataclasses.replace(spec, **{runtime: True}).sees_every_key, runtime


def test_bottom_right_alignment():
    spec = MaskSpec.create(2, 5, causal=True)
    np.testing.assert_array_equal(_visible(spec), [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    spec = MaskSpec.create(5, 2, causal=True)
    np.testing.assert_array_equal(_visible(spec)[:, 0], [0, 0, 0, 1, 1])


def _runtime_visible(spec: MaskSpec, q_ids, kv_ids, dense) -> np.ndarray:
    """Brute-force ``[batch, heads, q_len, kv_len]`` visibility with the runtime parts."""
    return np.asarray(
        spec.visible(
            np.arange(spec.q_len)[:, None],
            np.arange(spec.kv_len)[None, :],
            q_segment=None if q_ids is None else q_ids[:, None, :, None],
            kv_segment=None if kv_ids is None else kv_ids[:, None, None, :],
            dense=dense,
        )
    )


def _check_runtime_spans(spec: MaskSpec, vis: np.ndarray, bq: int, bk: int, runtime: dict) -> int:
    """Both loop directions, with `MaskSpec.tile_bounds`, against brute force: every tile
    holding a visible pair is visited (once), and a tile visited unmasked has every pair
    visible and in bounds. Returns the number of tiles the forward loops visit."""
    n_q, n_kv = -(-spec.q_len // bq), -(-spec.kv_len // bk)
    kv_bounds = np.asarray(spec.tile_bounds(bq, bk, **runtime))
    q_bounds = np.asarray(spec.tile_bounds(bq, bk, transposed=True, **runtime))
    visited = 0
    batch, heads = vis.shape[:2]
    for b, h in itertools.product(range(batch), range(heads)):
        kv_b = kv_bounds[min(b, kv_bounds.shape[0] - 1), min(h, kv_bounds.shape[1] - 1)]
        q_b = q_bounds[min(b, q_bounds.shape[0] - 1), min(h, q_bounds.shape[1] - 1)]
        forward = _pairs(lambda t: spec.kv_spans(t, bq, bk, kv_b[t]), n_q, n_kv, bq, bk)  # noqa: B023
        backward = _pairs(lambda u: spec.q_spans(u, bq, bk, q_b[u]), n_kv, n_q, bk, bq)  # noqa: B023
        backward = {(t, u): masked for (u, t), masked in backward.items()}
        visited += len(forward)
        for t, u in itertools.product(range(n_q), range(n_kv)):
            tile = vis[b, h, t * bq : (t + 1) * bq, u * bk : (u + 1) * bk]
            interior = tile.all() and (u + 1) * bk <= spec.kv_len
            for pairs in (forward, backward):
                if tile.any():
                    assert (t, u) in pairs, f"visible tile ({t}, {u}) of batch {b}, head {h} skipped"
                if (t, u) in pairs and not pairs[(t, u)]:
                    assert interior, f"tile ({t}, {u}) of batch {b}, head {h} marked interior but needs the mask"
    return visited


def _packed_ids(rng, batch: int, length: int, docs: int, *, shuffled: bool) -> np.ndarray:
    ids = np.sort(rng.integers(0, docs, size=(batch, length)), axis=1).astype(np.int32)
    return rng.permuted(ids, axis=1) if shuffled else ids


@pytest.mark.parametrize("shuffled", [False, True], ids=["sorted", "unsorted"])
@pytest.mark.parametrize("q_len,kv_len,causal,window,bq,bk", CONFIGS[::7])
def test_segment_spans_cover_exactly_the_visible_tiles(q_len, kv_len, causal, window, bq, bk, shuffled):
    rng = np.random.default_rng(q_len * 1000 + kv_len)
    spec = MaskSpec.create(q_len, kv_len, causal=causal, window=window, has_segments=True)
    q_ids = _packed_ids(rng, 3, q_len, 4, shuffled=shuffled)
    kv_ids = q_ids if q_len == kv_len else _packed_ids(rng, 3, kv_len, 4, shuffled=shuffled)
    vis = _runtime_visible(spec, q_ids, kv_ids, None)
    _check_runtime_spans(spec, vis, bq, bk, dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids))


@pytest.mark.parametrize("shape", [(2, 3, 1, 1), (2, 1, 1, 0), (1, 3, 0, 0), (2, 1, 0, 1)], ids=str)
@pytest.mark.parametrize("q_len,kv_len,causal,window,bq,bk", CONFIGS[3::11])
def test_dense_mask_spans_cover_exactly_the_visible_tiles(q_len, kv_len, causal, window, bq, bk, shape):
    """``shape``: batch, heads, and whether q and kv are broadcast (1) or full (0)."""
    rng = np.random.default_rng(q_len * 1000 + kv_len + 1)
    batch, heads, one_q, one_kv = shape
    spec = MaskSpec.create(q_len, kv_len, causal=causal, window=window, has_segments=True, has_dense_mask=True)
    dims = (batch, heads, 1 if one_q else q_len, 1 if one_kv else kv_len)
    # Blocks of True and False (padding-like), so that some tiles are whole and some empty.
    dense = np.repeat(np.repeat(rng.random((*dims[:2], -(-dims[2] // 8), -(-dims[3] // 8))) < 0.6, 8, 2), 8, 3)
    dense = dense[..., : dims[2], : dims[3]]
    q_ids = _packed_ids(rng, batch, q_len, 2, shuffled=False)
    kv_ids = q_ids if q_len == kv_len else _packed_ids(rng, batch, kv_len, 2, shuffled=False)
    vis = np.broadcast_to(_runtime_visible(spec, q_ids, kv_ids, dense), (batch, heads, q_len, kv_len))
    _check_runtime_spans(spec, vis, bq, bk, dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids, dense=dense))


def test_packed_documents_visit_only_their_own_tiles():
    """Eight causal documents of 256 tokens packed in 2048 visit what eight separate
    sequences do: the diagonal blocks' tiles, nothing between documents."""
    n, docs, tile = 2048, 8, 64
    ids = np.repeat(np.arange(docs, dtype=np.int32), n // docs)[None]
    spec = MaskSpec.create(n, n, causal=True, has_segments=True)
    vis = _runtime_visible(spec, ids, ids, None)
    visited = _check_runtime_spans(spec, vis, tile, tile, dict(q_segment_ids=ids, kv_segment_ids=ids))
    per_doc = n // docs // tile
    assert visited == docs * per_doc * (per_doc + 1) // 2


def _lengths_visible(spec: MaskSpec, lengths: np.ndarray, causal: bool, window) -> np.ndarray:
    """By definition: ``[batch, q_len, kv_len]`` visibility of ``spec``'s positions and
    the call's ``causal`` and ``window`` with per-sequence ``lengths [batch, 2]`` (no
    other runtime part)."""
    q_lengths, kv_lengths = lengths[:, :1, None], lengths[:, 1:, None]
    pos, keys = _positions(spec, q_lengths, kv_lengths), np.arange(spec.kv_len)[None, :]
    vis = (np.arange(spec.q_len)[:, None] < q_lengths) & (keys < kv_lengths)
    return vis & _in_window(pos, keys, causal, window)


def _random_lengths(rng, q_len: int, kv_len: int) -> np.ndarray:
    """``[5, 2]``: one sequence full, one with no keys, three random."""
    q_lengths = np.concatenate([[q_len, q_len], rng.integers(0, q_len + 1, size=3)])
    kv_lengths = np.concatenate([[kv_len, 0], rng.integers(0, kv_len + 1, size=3)])
    return np.stack([q_lengths, kv_lengths], axis=-1).astype(np.int32)


@pytest.mark.parametrize("q_len,kv_len,causal,window,bq,bk,top_left", ALIGNED[1::9])
def test_length_spans_cover_exactly_the_visible_tiles(q_len, kv_len, causal, window, bq, bk, top_left):
    """Per-sequence lengths with positions aligned to them (or top-left): `visible` by
    definition, and both loop directions against brute force."""
    rng = np.random.default_rng(q_len * 1000 + kv_len + 2)
    spec = MaskSpec.create(q_len, kv_len, causal=causal, window=window, has_lengths=True, top_left=top_left)
    lengths = _random_lengths(rng, q_len, kv_len)
    vis = np.asarray(
        spec.visible(
            np.arange(q_len)[None, :, None],
            np.arange(kv_len)[None, None, :],
            lengths=(lengths[:, 0, None, None], lengths[:, 1, None, None]),
        )
    )
    np.testing.assert_array_equal(vis, _lengths_visible(spec, lengths, causal, window))
    _check_runtime_spans(spec, vis[:, None], bq, bk, dict(lengths=lengths))


@pytest.mark.parametrize("q_len,kv_len,causal,window,bq,bk,top_left", ALIGNED[2::13])
def test_segment_and_length_spans_cover_the_visible_tiles(q_len, kv_len, causal, window, bq, bk, top_left):
    """Packed documents in sequences of their own lengths (the tile classes of lengths,
    derived from `MaskSpec.length_bounds`, with those of the segment ids): both loop
    directions against brute force."""
    rng = np.random.default_rng(q_len * 1000 + kv_len + 3)
    spec = MaskSpec.create(
        q_len, kv_len, causal=causal, window=window, has_segments=True, has_lengths=True, top_left=top_left
    )
    lengths = _random_lengths(rng, q_len, kv_len)
    q_ids = _packed_ids(rng, len(lengths), q_len, 3, shuffled=False)
    kv_ids = q_ids if q_len == kv_len else _packed_ids(rng, len(lengths), kv_len, 3, shuffled=False)
    vis = _lengths_visible(spec, lengths, causal, window) & (q_ids[:, :, None] == kv_ids[:, None, :])
    runtime = dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids, lengths=lengths)
    _check_runtime_spans(spec, vis[:, None], bq, bk, runtime)


def _runs(seen: np.ndarray, whole: np.ndarray) -> np.ndarray:
    """``(lo, full_lo, full_hi, hi) [..., 4]`` of tiles ``seen`` and ``whole [..., n]``,
    each asserted to be one run (``(lo, lo)`` where none is)."""
    idx = np.arange(seen.shape[-1])

    def run(x, default):
        lo = np.where(x.any(-1), x.argmax(-1), default)
        hi = np.where(x.any(-1), len(idx) - x[..., ::-1].argmax(-1), lo)
        np.testing.assert_array_equal(x, (idx >= lo[..., None]) & (idx < hi[..., None]))
        return lo, hi

    lo, hi = run(seen, 0)
    full_lo, full_hi = run(whole, lo)
    return np.stack([lo, full_lo, full_hi, hi], axis=-1)


@pytest.mark.parametrize("q_len,kv_len,causal,window,bq,bk,top_left", ALIGNED[::6])
def test_length_bounds_are_exactly_the_visible_tiles(q_len, kv_len, causal, window, bq, bk, top_left):
    """`MaskSpec.length_bounds` (through `tile_bounds`, both loop directions) against
    brute force for every pair of lengths up to the sequences' (400 random pairs where
    they are long): a tile is visited iff one of its pairs is visible, and unmasked iff
    every pair is (rows up to ``q_len``; keys up to the tile's end). The tiles each
    direction visits, and those it visits whole, are one run, as the kernels' loops
    and `MaskSpec._tile_classes` (derived from these bounds) assume."""
    spec = MaskSpec.create(q_len, kv_len, causal=causal, window=window, has_lengths=True, top_left=top_left)
    assert spec.bounds_from_lengths
    rng = np.random.default_rng(q_len * 1000 + kv_len + bq)
    pairs = itertools.product(range(q_len + 1), range(kv_len + 1))
    lengths = np.array(
        list(pairs) if (q_len + 1) * (kv_len + 1) <= 400 else rng.integers(0, [q_len + 1, kv_len + 1], (400, 2))
    )
    lengths = np.concatenate([lengths, [[q_len, kv_len], [0, 0]]]).astype(np.int32)
    vis = _lengths_visible(spec, lengths, causal, window)
    n_q, n_kv = -(-q_len // bq), -(-kv_len // bk)
    # Rows past q_len count as visible for `all` (never stored), keys past kv_len as hidden.
    padded = np.pad(vis, ((0, 0), (0, n_q * bq - q_len), (0, 0)), constant_values=True)
    padded = np.pad(padded, ((0, 0), (0, 0), (0, n_kv * bk - kv_len)), constant_values=False)
    tiles = padded.reshape(len(lengths), n_q, bq, n_kv, bk).transpose(0, 1, 3, 2, 4)
    real_row = np.arange(n_q * bq).reshape(n_q, 1, bq, 1) < q_len
    seen, whole = (tiles & real_row).any(axis=(-2, -1)), tiles.all(axis=(-2, -1))
    for transposed in (False, True):
        got = np.asarray(spec.tile_bounds(bq, bk, transposed=transposed, lengths=lengths))[:, 0]
        flip = (lambda x: np.swapaxes(x, -1, -2)) if transposed else (lambda x: x)
        np.testing.assert_array_equal(got, _runs(flip(seen), flip(whole)), err_msg=f"{transposed=}")


def test_decode_over_a_partly_filled_cache_visits_only_its_tiles():
    """One query per sequence over caches filled to 100 and 1000 of 4096 keys visits
    ceil(length / block) key tiles each, not 4096 / block, and only the last one masked
    (the padding rows of a 16-row tile of one query are never stored)."""
    spec = MaskSpec.create(1, 4096, causal=True, has_lengths=True)
    lengths = np.array([[1, 100], [1, 1000]], np.int32)
    bounds = np.asarray(spec.tile_bounds(16, 64, lengths=lengths))
    for b, kv_length in enumerate((100, 1000)):
        spans = spec.kv_spans(0, 16, 64, bounds[b, 0, 0])
        assert sum(int(s.stop) - int(s.start) for s in spans) == -(-kv_length // 64)
        assert sum(int(s.stop) - int(s.start) for s in spans if not s.masked) == kv_length // 64


def _causal_within(spec: MaskSpec, q_length: int, kv_length: int) -> np.ndarray:
    """By definition: the pairs `MaskSpec.recognised` shows with these lengths (causal,
    the spec's left window, positions aligned to the lengths unless top-left)."""
    rows, keys = np.arange(spec.q_len)[:, None], np.arange(spec.kv_len)[None, :]
    pos = _positions(spec, q_length, kv_length)
    shown = (rows < q_length) & (keys < kv_length) & (keys <= pos)
    return shown & (True if spec.left is None else keys >= pos - spec.left)


def _shown(spec: MaskSpec, dense: np.ndarray) -> np.ndarray:
    """By definition: the pairs ``spec`` (no lengths) shows with ``dense [q_len, kv_len]``."""
    pos, keys = _positions(spec, spec.q_len, spec.kv_len), np.arange(spec.kv_len)[None, :]
    shown = dense & (True if spec.left is None else keys >= pos - spec.left)
    return shown & (True if spec.right is None else keys <= pos + spec.right)


RECOGNISE = sorted({(q, kv, c, w, t) for q, kv, c, w, _, _, t in ALIGNED if max(q, kv) <= 72}, key=str)[::4]


@pytest.mark.parametrize("q_len,kv_len,causal,window,top_left", RECOGNISE)
def test_recognise_reads_causal_masks_with_padding_and_nothing_else(q_len, kv_len, causal, window, top_left):
    """Flax's causal-with-padding masks (random lengths, one sequence empty) are read as
    `MaskSpec.recognised` with lengths that show the same pairs; the same masks with one
    pair flipped, and random masks, are read so only if some lengths show their pairs
    (found by trying them all)."""
    rng = np.random.default_rng(q_len * 100 + kv_len)
    spec = MaskSpec.create(q_len, kv_len, causal=causal, window=window, has_dense_mask=True, top_left=top_left)
    fills = [(q_len, kv_len), (0, 0)] + [tuple(rng.integers(1, n + 1) for n in (q_len, kv_len)) for _ in range(2)]
    flax = np.stack([_causal_within(spec, *fill) for fill in fills])
    flipped = flax.copy()
    flipped[2, rng.integers(q_len), rng.integers(kv_len)] ^= True
    random = rng.random((len(fills), q_len, kv_len)) < 0.7
    for name, masks in (("flax", flax), ("flipped", flipped), ("random", random)):
        lengths, same = spec.recognise(masks[:, None])
        shown = [_shown(spec, m) for m in masks]
        by_lengths = [_causal_within(spec, *map(int, pair)) for pair in np.asarray(lengths)]
        assert bool(same) == all(np.array_equal(s, r) for s, r in zip(shown, by_lengths)), name
        if name == "flax":
            assert bool(same)
        elif not same:
            readable = [
                any(np.array_equal(s, _causal_within(spec, a, b)) for a in range(q_len + 1) for b in range(kv_len + 1))
                for s in shown
            ]
            assert not all(readable), f"{name}: lengths exist that show the same pairs"
