"""flashlib.ladder.masks: the bottom-right causal mask, and block_hidden agreeing with it tile by tile."""
import numpy as np
import pytest

from flashlib.ladder.masks import block_hidden, causal_mask


def test_causal_mask_is_bottom_right_aligned():
    assert causal_mask(0, 3, 0, 5, 3, 5).astype(int).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0],
                                                                  [1, 1, 1, 1, 1]]
    tall = causal_mask(0, 5, 0, 3, 5, 3)                     # Nq > Nk: two queries see nothing
    assert not tall[:2].any() and tall[2:].astype(int).tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert np.array_equal(causal_mask(2, 4, 1, 5, 6, 6), causal_mask(0, 6, 0, 6, 6, 6)[2:4, 1:5])


@pytest.mark.parametrize("nq,nk", [(7, 7), (5, 11), (11, 5), (1, 9)])
@pytest.mark.parametrize("br,bc", [(1, 1), (2, 3), (4, 4)])
def test_block_hidden_exactly_when_the_mask_hides_the_whole_tile(nq, nk, br, bc):
    for q0 in range(0, nq, br):
        q1 = min(q0 + br, nq)
        for k0 in range(0, nk, bc):
            tile = causal_mask(q0, q1, k0, min(k0 + bc, nk), nq, nk)
            assert block_hidden(q0, q1, k0, nq, nk) == (not tile.any()), (q0, q1, k0)


# ---- the band: causal and the sliding window; tile classes (notebooks/09_real_models) ----
from flashlib.ladder.masks import band_mask, key_range, tile_class  # noqa: E402

WINDOWS = [(-1, -1), (0, 0), (2, 1), (3, -1), (-1, 2), (0, 5), (20, 20), (40, -1)]


def _by_definition(nq, nk, causal, window):
    """The (Nq, Nk) mask from the definition, element by element (off = Nk - Nq)."""
    left, right = window
    seen = np.zeros((nq, nk), dtype=bool)
    for i in range(nq):
        for j in range(nk):
            d = i + nk - nq
            seen[i, j] = ((not causal or j <= d) and (right < 0 or j <= d + right)
                          and (left < 0 or j >= d - left))
    return seen


@pytest.mark.parametrize("nq,nk", [(7, 7), (5, 11), (11, 5), (1, 9), (9, 1), (1, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
def test_band_mask_and_key_range_follow_the_definition(nq, nk, causal, window):
    full = _by_definition(nq, nk, causal, window)
    assert np.array_equal(band_mask(0, nq, 0, nk, nq, nk, causal, window), full)
    assert np.array_equal(band_mask(1, nq, min(2, nk), nk, nq, nk, causal, window),
                          full[1:, min(2, nk):])
    first, last = key_range(np.arange(nq), nq, nk, causal, window)
    for i in range(nq):
        assert full[i].tolist() == [first[i] <= j <= last[i] for j in range(nk)]
    if causal and window == (-1, -1):
        assert np.array_equal(causal_mask(0, nq, 0, nk, nq, nk), full)


@pytest.mark.parametrize("nq,nk", [(7, 7), (5, 11), (11, 5), (1, 9), (13, 2)])
@pytest.mark.parametrize("br,bc", [(1, 1), (2, 3), (4, 4), (5, 2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
def test_tile_class_is_empty_full_or_partial_exactly_as_the_mask(nq, nk, br, bc, causal, window):
    full = _by_definition(nq, nk, causal, window)
    for q0 in range(0, nq, br):
        for k0 in range(0, nk, bc):
            q1, k1 = min(q0 + br, nq), min(k0 + bc, nk)
            tile = full[q0:q1, k0:k1]
            want = "full" if tile.all() else "empty" if not tile.any() else "partial"
            assert tile_class(q0, q1, k0, k1, nq, nk, causal, window) == want, (q0, k0)
            if causal and window == (-1, -1):
                assert block_hidden(q0, q1, k0, nq, nk) == (want == "empty")


def test_tile_class_of_a_tile_without_rows_or_keys_is_empty():
    assert tile_class(2, 2, 0, 4, 5, 5) == "empty"
    assert tile_class(0, 3, 4, 4, 5, 5) == "empty"


def test_windows_past_the_sequence():
    # a window that ends before the first key (right = 0, Nq > Nk): the first rows see nothing
    m = band_mask(0, 6, 0, 3, 6, 3, False, (1, 0))
    assert not m[:3].any() and m[3:].any(axis=1).all()
    # left window wider than the sequence: only the right edge binds
    assert np.array_equal(band_mask(0, 4, 0, 4, 4, 4, False, (100, 0)), np.tri(4, dtype=bool))
    assert tile_class(0, 4, 0, 4, 4, 4, False, (100, 100)) == "full"


@pytest.mark.parametrize("call,exc,match", [
    (lambda: band_mask(0, 2, 0, 2, 2, 2, False, (-2, 0)), ValueError, "window"),
    (lambda: band_mask(0, 2, 0, 2, 2, 2, False, (1.0, 0)), TypeError, "window"),
    (lambda: band_mask(0, 2, 0, 2, 2, 2, False, 3), TypeError, "window"),
    (lambda: band_mask(0, 2, 0, 2, 2, 2, 1), TypeError, "causal"),
    (lambda: tile_class(0, 3, 0, 2, 2, 2), ValueError, "q1"),
    (lambda: tile_class(0, 2, 1, 0, 2, 2), ValueError, "k0"),
    (lambda: key_range(0, 2, 2, "yes"), TypeError, "causal"),
])
def test_mask_arguments_are_checked(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
