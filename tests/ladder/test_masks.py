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
