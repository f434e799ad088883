"""flashlib.figures.serving: padding against packing, a paged cache and its
block table, and the one merge's four trees, each drawn from the data it is
given (lengths, block tables, ladder.decoding.split_bounds, ring.chunk_ids)
and refusing bad input with an error naming the argument."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import need_module

need_module("matplotlib")

from matplotlib.figure import Figure  # noqa: E402

from flashlib import figures  # noqa: E402
from flashlib.figures import serving as fserving  # noqa: E402


def _texts(fig):
    return [t.get_text() for ax in fig.axes for t in ax.texts]


# ---- padding_cost --------------------------------------------------------

@pytest.mark.parametrize("lengths", [[5, 12, 3, 9], [1], [7, 0, 7], (4, 4)])
def test_padding_cost_counts_padded_and_packed_pairs(lengths):
    fig = figures.padding_cost(lengths)
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    b, top = len(lengths), max(lengths)
    pad, pack = fig.axes
    assert f"{b * top * top:,} pairs" in pad.get_title()
    assert f"{sum(n * n for n in lengths):,} pairs" in pack.get_title()
    # the packed panel's ticks are cu_seqlens
    cu = np.concatenate([[0], np.cumsum(lengths)])
    assert list(pack.get_xticks()) == list(cu)
    assert pack.get_xlim() == (0, sum(lengths))
    for ax in fig.axes:
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any("padding" in t for t in legend)


def test_padding_cost_takes_numpy_and_torch_lengths():
    torch = pytest.importorskip("torch")
    a = figures.padding_cost(np.array([3, 5]))
    b = figures.padding_cost(torch.tensor([3, 5], dtype=torch.int32))
    assert a.axes[1].get_title() == b.axes[1].get_title()


@pytest.mark.parametrize("bad, error, match", [
    ([], ValueError, "lengths must hold 1 to"),
    ([0, 0], ValueError, "at least one token"),
    ([3, -1], ValueError, r"lengths\[1\]"),
    ([3, 2.5], TypeError, r"lengths\[1\] must be an int"),
    ("3, 4", TypeError, "lengths must be a list"),
    (np.zeros((2, 2), int), ValueError, "lengths must be 1-D"),
    ([fserving.MAX_LEN + 1], ValueError, r"lengths\[0\]"),
])
def test_padding_cost_refuses_bad_lengths(bad, error, match):
    with pytest.raises(error, match=match):
        figures.padding_cost(bad)


# ---- paged_cache ---------------------------------------------------------

TABLE = np.array([[3, 0, 7, 0], [3, 5, 1, 9], [2, 8, 0, 0]], dtype=np.int32)
LENS = [10, 14, 5]


def test_page_owners_reads_only_the_used_entries():
    owners = figures.page_owners(TABLE, LENS, 4, 10)
    assert owners == {3: [(0, 0), (1, 0)], 0: [(0, 1)], 7: [(0, 2)],
                      5: [(1, 1)], 1: [(1, 2)], 9: [(1, 3)],
                      2: [(2, 0)], 8: [(2, 1)]}
    # garbage past the used pages is never read
    garbage = TABLE.copy()
    garbage[0, 3] = garbage[2, 2:] = 10 ** 6
    assert figures.page_owners(garbage, LENS, 4, 10) == owners


def test_paged_cache_draws_every_token_where_the_table_says():
    fig = figures.paged_cache(TABLE, LENS, 4, num_pages=10)
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    ax = fig.axes[0]
    texts = _texts(fig)
    # one arrow per used entry of the block table, labelled with it
    arrows = [t for t in ax.texts if getattr(t, "arrow_patch", None)]
    assert len(arrows) == sum(-(-n // 4) for n in LENS) == 9
    for b, n in enumerate(LENS):
        for p in range(-(-n // 4)):
            assert f"[{b}, {p}] -> {TABLE[b, p]}" in texts
    assert "page 3: shared by seqs 0, 1" in texts
    assert [t for t in texts if t.endswith(": free")] == ["page 4: free",
                                                          "page 6: free"]
    assert "page 0" in texts and "page 9" in texts
    title = ax.get_title()
    assert "29 tokens in 8 of 10 pages (2 free)" in title
    assert "block_table[b, t // 4], row t % 4" in title
    # every token's position appears on both sides: logical and physical
    for t in range(14):
        assert texts.count(str(t)) >= 2


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_paged_cache_takes_any_page_size_and_torch_tables(page_size):
    torch = pytest.importorskip("torch")
    lens = [5, 2]
    pages = [-(-n // page_size) for n in lens]
    table = torch.arange(sum(pages), dtype=torch.int32).flip(0)
    rows = torch.zeros(2, max(pages), dtype=torch.int32)
    rows[0, :pages[0]], rows[1, :pages[1]] = table[:pages[0]], table[pages[0]:]
    fig = figures.paged_cache(rows, torch.tensor(lens), page_size)
    assert f"in {sum(pages)} of {sum(pages)} pages (0 free)" in \
        fig.axes[0].get_title()


@pytest.mark.parametrize("kw, error, match", [
    (dict(block_table=[[0, 1]]), TypeError, "block_table must be an integer"),
    (dict(block_table=TABLE.astype(float)), TypeError, "must hold integers"),
    (dict(block_table=TABLE[0]), ValueError, "block_table must be 2-D"),
    (dict(seqlens=[10, 14]), ValueError, "one length per row"),
    (dict(seqlens=[10, 17, 5]), ValueError, r"seqlens\[1\] = 17 needs 5"),
    (dict(page_size=0), ValueError, "page_size must be an int from 1"),
    (dict(num_pages=9), ValueError, r"block_table\[1, 3\] = 9 is not a page"),
    (dict(num_pages=0), ValueError, "num_pages must be an int from 1"),
])
def test_paged_cache_refuses_bad_input_naming_the_argument(kw, error, match):
    args = dict(block_table=TABLE, seqlens=LENS, page_size=4, num_pages=10)
    args.update(kw)
    with pytest.raises(error, match=match):
        figures.paged_cache(args.pop("block_table"), args.pop("seqlens"),
                            args.pop("page_size"), **args)


# ---- merge_uses ------------------------------------------------------------

def _merges(ax):
    return sum("oplus" in t.get_text() for t in ax.texts)


def test_merge_uses_draws_four_trees_from_the_librarys_splits_and_ring():
    from flashlib.ladder.decoding import split_bounds
    fig = figures.merge_uses(13, block_k=4, num_splits=3, world=4, rank=1,
                             prefix=8, suffixes=(3, 5, 2))
    assert isinstance(fig, Figure) and len(fig.axes) == 4
    fold, flash, ring, cascade = fig.axes
    for ax, (title, where) in zip(fig.axes, fserving.MERGE_USES):
        assert ax.get_title(loc="left") == f"{title} ({where})"
    # the fold: 4 blocks of 4 keys (the last holds 1), 3 merges
    assert _merges(fold) == 3
    # Flash-Decoding: the splits of split_bounds, one combine
    labels = [t.get_text() for t in flash.texts]
    assert sum(t.startswith("split ") for t in labels) == 3
    assert [p.get_x() for p in flash.patches] == \
        [a for a, _ in split_bounds(13, 3)]
    assert "combine: merge_states_many" in labels
    # the ring on rank 1: its own chunk first, then 0, 3, 2
    steps = {t.get_text(): t.get_position()[0] for t in ring.texts
             if t.get_text().startswith("step")}
    chunk = [int(steps[f"step {s}"] // (13 / 4)) for s in range(4)]
    assert chunk == [1, 0, 3, 2] and _merges(ring) == 3
    # cascade: one prefix state and one merge per sequence
    assert _merges(cascade) == 3
    assert sum(t.get_text().startswith("$p_") for t in cascade.texts) == 3
    assert "shared prefix (read once)" in [t.get_text() for t in cascade.texts]


def test_merge_uses_renders_to_svg():
    svg = figures.to_svg(figures.merge_uses())
    assert "<svg" in svg


@pytest.mark.parametrize("kw, error, match", [
    (dict(nk=1), ValueError, "nk must be an int from 2"),
    (dict(block_k=0), ValueError, "block_k must be an int from 1"),
    (dict(num_splits=17), ValueError, "num_splits must be an int from 1"),
    (dict(world=1), ValueError, "world must be an int from 2"),
    (dict(nk=3, block_k=1, num_splits=1, world=4), ValueError,
     "world must be at most nk"),
    (dict(rank=4), ValueError, "rank must be an int from 0 to 3"),
    (dict(prefix=True), TypeError, "prefix must be an int"),
    (dict(suffixes=3), TypeError, "suffixes must be a tuple"),
    (dict(suffixes=(3, 0)), ValueError, r"suffixes\[1\]"),
])
def test_merge_uses_refuses_bad_arguments(kw, error, match):
    with pytest.raises(error, match=match):
        figures.merge_uses(**kw)
