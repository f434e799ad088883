"""flashlib.figures.masks: the tile classes of a mask, counted and drawn from the ladder's own
band_mask and tile_class, checked against a brute-force classification of the mask."""
from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import need_module

need_module("matplotlib")

from matplotlib.figure import Figure  # noqa: E402

from flashlib import figures  # noqa: E402
from flashlib.figures import masks as fmasks  # noqa: E402
from flashlib.testing import _visible, random_qkv, reference  # noqa: E402


def _brute(nq, nk, bq, bk, causal, window):
    """The classes from the oracle's mask: a key is visible to query i iff it changes row i's lse."""
    seen = _visible(nq, nk, causal, window)          # the float64 oracle's mask
    counts = dict.fromkeys(fmasks.KINDS, 0)
    for q0 in range(0, nq, bq):
        for k0 in range(0, nk, bk):
            t = seen[q0:q0 + bq, k0:k0 + bk]
            counts["full" if t.all() else "partial" if t.any() else "empty"] += 1
    return counts, seen


@pytest.mark.parametrize("nq, nk, bq, bk, causal, window", [
    (48, 48, 8, 8, True, (-1, -1)), (48, 48, 8, 8, False, (12, 12)), (48, 48, 8, 8, True, (12, -1)),
    (37, 70, 16, 8, True, (5, 0)), (70, 37, 8, 16, False, (0, 3)), (9, 9, 4, 3, False, (-1, -1)),
    (130, 70, 64, 64, True, (100, -1)), (5, 40, 2, 7, False, (50, 50)), (12, 7, 5, 2, False, (0, 0))])
def test_tile_counts_match_a_brute_force_classification(nq, nk, bq, bk, causal, window):
    want, seen = _brute(nq, nk, bq, bk, causal, window)
    got = figures.tile_counts(nq, nk, block_q=bq, block_k=bk, causal=causal, window=window)
    assert got == want
    assert sum(got.values()) == math.ceil(nq / bq) * math.ceil(nk / bk)
    # the brute-force mask is the oracle's: a key outside it does not change the output
    q, k, v = random_qkv(nq, nk, 4, seed=nq + nk)
    o, _ = reference(q, k, v, causal=causal, window_size=window)
    v2 = v.copy()
    v2[~seen.any(axis=0)] = 1e6                       # keys nobody sees
    assert np.array_equal(o, reference(q, k, v2, causal=causal, window_size=window)[0])


def test_tile_counts_takes_grids_larger_than_a_picture():
    c = figures.tile_counts(8192, 8192, block_q=128, block_k=128, causal=True, window=(127, 0))
    assert c == {"full": 0, "partial": 127, "empty": 64 * 64 - 127}     # two tiles per query block


def test_a_window_makes_the_computed_tiles_grow_linearly_not_quadratically():
    computed = []
    for n in (256, 512, 1024):
        c = figures.tile_counts(n, n, block_q=32, block_k=32, causal=True, window=(64, -1))
        computed.append(c["full"] + c["partial"])
    assert computed[2] - computed[1] == 2 * (computed[1] - computed[0])   # constant per query block


def test_mask_tiles_draws_three_panels_with_counts_and_a_legend():
    fig = figures.mask_tiles(48, 48, block_q=8, block_k=8, window=12)
    assert isinstance(fig, Figure) and len(fig.axes) == 3
    for ax, (title, causal, side) in zip(fig.axes, fmasks.MASKS):
        win = {None: (-1, -1), "both": (12, 12), "left": (12, -1)}[side]
        c = figures.tile_counts(48, 48, block_q=8, block_k=8, causal=causal, window=win)
        assert f"{c['full']} full, {c['partial']} partial, {c['empty']} empty" in ax.get_title()
        assert title.replace("W", "12").split(" (")[0] in ax.get_title()
        tiles = [p for p in ax.patches if p.get_label() in fmasks.KINDS]
        assert len(tiles) == 36
        assert sorted(p.get_label() for p in tiles) == sorted(
            k for k, n in c.items() for _ in range(n))
        assert ax.get_xlabel() == "key index j"
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any("skipped" in t for t in legend) and any("no mask" in t for t in legend)
    assert "Nq = 48, Nk = 48" in fig.get_suptitle()


def test_mask_tiles_draws_nq_not_nk_and_svg_renders():
    fig = figures.mask_tiles(24, 40, block_q=8, block_k=8, window=6)
    assert fig.axes[0].get_xlim() == (0.0, 40.0) and fig.axes[0].get_ylim() == (24.0, 0.0)
    assert figures.to_svg(fig).startswith("<?xml")


@pytest.mark.parametrize("call, error, match", [
    (lambda: figures.mask_tiles(nq=0), ValueError, "nq must"),
    (lambda: figures.mask_tiles(nk=4.0), TypeError, "nk must"),
    (lambda: figures.mask_tiles(block_q=0), ValueError, "block_q must"),
    (lambda: figures.mask_tiles(window=-1), ValueError, "window must"),
    (lambda: figures.mask_tiles(window=(4, 4)), TypeError, "window must"),
    (lambda: figures.mask_tiles(4096, 4096, block_q=8, block_k=8), ValueError, "block_q, block_k give"),
    (lambda: figures.tile_counts(1 << 20, 1 << 20, block_q=512, block_k=512), ValueError, "at most 65536"),
    (lambda: figures.tile_counts(8, 8, block_q=2, block_k=2, window=(-2, 3)), ValueError, "window entries"),
    (lambda: figures.tile_counts(8, 8, block_q=2, block_k=2, window=5), TypeError, "window must be a pair"),
    (lambda: figures.tile_counts(8, 8, block_q=2, block_k=2, window=(1.0, 2)), TypeError, "window must"),
    (lambda: figures.tile_counts(8, 8, block_q=2, block_k=2, causal=1), TypeError, "causal must"),
])
def test_bad_arguments_are_refused_naming_them(call, error, match):
    with pytest.raises(error, match=match):
        call()
