"""The mask description against brute force: spans cover every visible pair, interior
spans need no element-wise mask, and the two loop directions agree."""

from __future__ import annotations

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


@pytest.mark.parametrize("q_len,kv_len,causal,window,bq,bk", CONFIGS)
def test_spans_cover_exactly_the_visible_tiles(q_len, kv_len, causal, window, bq, bk):
    spec = MaskSpec.create(q_len, kv_len, causal=causal, window=window)
    vis = _visible(spec)
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


def test_bottom_right_alignment():
    spec = MaskSpec.create(2, 5, causal=True)
    np.testing.assert_array_equal(_visible(spec), [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    spec = MaskSpec.create(5, 2, causal=True)
    np.testing.assert_array_equal(_visible(spec)[:, 0], [0, 0, 0, 1, 1])
