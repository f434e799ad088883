"""flashlib.figures: every picture shows flashlib's own numbers, is labelled, and refuses bad input."""
from __future__ import annotations

import importlib
import inspect
import json
import math
import re

import numpy as np
import pytest

from conftest import ROOT, need_module

need_module("matplotlib")

from matplotlib.figure import Figure  # noqa: E402

from flashlib import IOCounter, figures  # noqa: E402
from flashlib.ladder import decoding, fa1, naive, softmax  # noqa: E402
from flashlib.ladder.masks import causal_mask  # noqa: E402
from flashlib.testing import random_qkv  # noqa: E402


def _texts(fig: Figure) -> str:
    return "\n".join(t.get_text() for ax in fig.axes for t in ax.texts)


def _labelled(ax) -> None:
    assert ax.get_title(), "every plot has a title"
    assert ax.get_xlabel() and ax.get_ylabel(), "every plot labels both axes"


def _frames(html: str) -> int:
    return len(re.findall(r'frames\[\d+\]\s*=\s*"data:image/png;base64,', html))


# --- SVG output -------------------------------------------------------------------------------------

def test_to_svg_is_deterministic_vector_output_without_a_date():
    fig = figures.hbm_traffic(128, 16, sram_bytes=4096)
    first, second = figures.to_svg(fig), figures.to_svg(fig)
    assert first == second and first.lstrip().startswith("<?xml") and "<svg" in first
    assert "<dc:date>" not in first


def test_svg_wraps_the_text_for_a_notebook():
    need_module("IPython")
    fig = figures.hbm_traffic(128, 16, sram_bytes=4096)
    shown = figures.svg(fig)
    assert "<svg" in shown.data and shown.data.strip().endswith("</svg>")


@pytest.mark.parametrize("bad", [None, "figure.svg", object()])
def test_to_svg_refuses_what_is_not_a_figure(bad):
    with pytest.raises(TypeError, match="fig must be a matplotlib Figure"):
        figures.to_svg(bad)


# --- the roadmap ------------------------------------------------------------------------------------

def _chapter_headings():
    toc = (ROOT / "_toc.yml").read_text()
    found = []
    for nb in re.findall(r"file:\s*(notebooks/\d\d_\S+)", toc):
        cells = json.loads((ROOT / f"{nb}.ipynb").read_text())["cells"]
        first = "".join(next(c["source"] for c in cells if c["cell_type"] == "markdown"))
        number, title = re.search(r"^#\s+(\d+)\.\s+(.+?)\s*$", first, re.M).groups()
        found.append((int(number), title))
    return found


def test_the_committed_roadmap_is_what_the_function_draws_now():
    committed = (ROOT / "book" / "_static" / "roadmap.svg").read_text()
    assert committed == figures.to_svg(figures.roadmap()), (
        "book/_static/roadmap.svg is stale (a chapter heading, _toc.yml or CHAPTER_MODULES changed): "
        "regenerate it with `python -m flashlib.figures`")


def test_roadmap_shows_every_chapter_with_its_short_title_and_idea():
    headings = _chapter_headings()
    assert [n for n, _ in headings] == list(range(1, 13))
    text = _texts(figures.roadmap())
    for number, title in headings:
        assert f"{number}" in text and title.split(":")[0].strip() in text
        assert figures.CHAPTER_IDEAS[number] in text, f"chapter {number} needs its idea on the roadmap"


def test_roadmap_text_is_large_enough_to_read_at_the_pages_width():
    fig = figures.roadmap()
    sizes = [t.get_fontsize() for ax in fig.axes for t in ax.texts]
    assert min(sizes) >= 11 and fig.get_figwidth() <= 10   # about 13 px or more on a 750 px column


def test_roadmap_shows_chapters_only_not_sub_pages(tmp_path):
    import shutil
    (tmp_path / "notebooks").mkdir()
    for n in ("01_naive_attention", "07_triton"):
        shutil.copy(ROOT / "notebooks" / f"{n}.ipynb", tmp_path / "notebooks")
    shutil.copy(ROOT / "notebooks" / "07_triton.ipynb", tmp_path / "notebooks" / "07b_backward.ipynb")
    (tmp_path / "_toc.yml").write_text(
        "parts:\n  - caption: A\n    chapters:\n      - file: notebooks/01_naive_attention\n"
        "  - caption: B\n    chapters:\n      - file: notebooks/07_triton\n        sections:\n"
        "          - file: notebooks/07b_backward\n")
    assert [c[2] for c in figures._chapters(tmp_path)] == [1, 7]


@pytest.mark.parametrize("number,module", [(n, m) for n, ms in figures.CHAPTER_MODULES.items() for m in ms])
def test_each_module_on_the_roadmap_says_it_is_explained_in_that_chapter(number, module):
    doc = inspect.getdoc(importlib.import_module(f"flashlib.{module}")) or ""
    explained = re.findall(r"notebooks/(\d\d)_", doc.split("Explained in:", 1)[-1])
    assert f"{number:02d}" in explained, f"flashlib.{module}'s docstring does not point at chapter {number}"


def test_write_roadmap_writes_the_deterministic_svg(tmp_path):
    path = figures.write_roadmap(tmp_path / "roadmap.svg")
    assert path.read_text() == figures.to_svg(figures.roadmap())


def test_roadmap_needs_a_checkout(tmp_path):
    with pytest.raises(FileNotFoundError, match="_toc.yml"):
        figures.roadmap(tmp_path)


# --- chapter 3: HBM traffic -------------------------------------------------------------------------

@pytest.mark.parametrize("n,d,sram,causal", [(256, 32, 16 * 1024, False), (300, 16, 8 * 1024, True)])
def test_hbm_traffic_bars_are_the_counted_bytes(n, d, sram, causal):
    q, k, v = random_qkv(n, n, d, dtype=np.float32, seed=7)
    io_std, io_fa1 = IOCounter(2), IOCounter(2, sram_bytes=sram)
    naive.attention(q, k, v, causal=causal, io=io_std)
    fa1.forward(q, k, v, causal=causal, sram_bytes=sram, io=io_fa1)
    fig = figures.hbm_traffic(n, d, sram_bytes=sram, causal=causal)
    bars = fig.axes[1]
    _labelled(bars)
    reads, writes = ([p.get_height() for p in c] for c in bars.containers)
    assert reads == [io_std.hbm_read_bytes, io_fa1.hbm_read_bytes]
    assert writes == [io_std.hbm_write_bytes, io_fa1.hbm_write_bytes]
    assert [p.get_y() for p in bars.containers[1]] == reads               # stacked: writes on reads
    assert [t.get_text() for t in bars.get_xticklabels()] == ["standard attention", "FlashAttention-1"]
    floor = [line.get_ydata()[0] for line in bars.get_lines()]
    assert floor == [4 * n * d * 2]                                        # Q, K, V, O once
    text = _texts(fig)
    for io in (io_std, io_fa1):
        assert f"{io.hbm_read_bytes / 1e6:.2f} MB" in text and f"{io.hbm_write_bytes / 1e6:.2f} MB" in text
    assert f"peak {io_fa1.peak_sram_bytes / 1024:.1f} KB" in text
    br, bc = fa1.paper_block_sizes(sram, d)
    assert f"$B_r$={br}, $B_c$={bc}" in text


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(n="64"), TypeError, "n must be an int"),
    (dict(n=0), ValueError, "n must be an int"),
    (dict(d=2.5), TypeError, "d must be an int"),
    (dict(sram_bytes=100), ValueError, "too small"),
    (dict(causal="yes"), TypeError, "causal must be True or False"),
    (dict(bytes_per_element=0), ValueError, "bytes_per_element"),
])
def test_hbm_traffic_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        figures.hbm_traffic(**{"n": 64, "d": 16, **kwargs})


# --- chapter 7: the program grid --------------------------------------------------------------------

def _loads_by_definition(q0, q1, nq, nk, bn, causal):
    """(whole, masked) key blocks of a query block, from the mask of every (query, key) pair."""
    whole = masked = 0
    for k0 in range(0, nk, bn):
        k1 = min(k0 + bn, nk)
        seen = causal_mask(q0, q1, k0, k1, nq, nk) if causal else np.ones((q1 - q0, k1 - k0), bool)
        if seen.any():
            full = seen.all() and k1 - k0 == bn
            whole, masked = whole + full, masked + (not full)
    return whole, masked


@pytest.mark.parametrize("B,H,nq,nk,causal", [(2, 2, 1000, None, True), (1, 3, 200, 90, True),
                                              (2, 1, 130, 300, False), (1, 1, 70, 200, True)])
def test_program_grid_draws_every_program_of_the_launch(B, H, nq, nk, causal):
    from flashlib.kernels.triton import configs, fa2_fwd_v1, tables
    cfg = configs.Config(32, 16) if nq < 500 else None
    fig = figures.program_grid(B, H, nq, nk, config=cfg, causal=causal)
    cfg = cfg or tables.CANDIDATES["fwd"][0]
    nk = nq if nk is None else nk
    ax = fig.axes[0]
    _labelled(ax)
    programs = fa2_fwd_v1.grid(B, H, nq, cfg.block_m)[0]
    cells = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in ax.texts}
    assert len(cells) == programs and str(programs) in ax.get_title()
    n_blocks = math.ceil(nq / cfg.block_m)
    image = ax.get_images()[0].get_array()
    for pid in range(programs):
        bh, i = pid // n_blocks, pid % n_blocks             # query block fastest (kit.unflatten)
        whole, masked = _loads_by_definition(i * cfg.block_m, min((i + 1) * cfg.block_m, nq), nq, nk,
                                             cfg.block_n, causal)
        assert cells[bh, i] == f"{pid}\n{whole}+{masked}"
        assert image[bh, i] == whole + masked


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(config=(128, 64)), TypeError, "config must be"),
    (dict(B=0), ValueError, "B must be an int"),
    (dict(H=True), TypeError, "H must be an int"),
    (dict(nq=10_000), ValueError, "at most 32 query blocks"),
    (dict(causal=None), TypeError, "causal must be True or False"),
])
def test_program_grid_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        figures.program_grid(**kwargs)


# --- chapter 6: split-KV ----------------------------------------------------------------------------

def test_split_kv_shows_each_splits_lse_and_the_combine_weights():
    q, k, v = random_qkv(1, 500, 32, seed=3)
    k[300:320] += 0.5 * q
    fig = figures.split_kv(q, k, v, 5)
    cache, lse_ax, w_ax = fig.axes
    for ax in (lse_ax, w_ax):
        assert ax.get_title() and ax.get_ylabel()
    assert cache.get_xlabel() and cache.get_title()
    scores = (q @ k.T)[0] / math.sqrt(32)
    expected = [np.log(np.exp(scores[a:b] - scores[a:b].max()).sum()) + scores[a:b].max()
                for a, b in decoding.split_bounds(500, 5)]
    total = np.log(np.exp(scores - scores.max()).sum()) + scores.max()
    heights = [p.get_height() for p in lse_ax.containers[0]]
    np.testing.assert_allclose(heights, expected, rtol=1e-12)
    assert lse_ax.get_lines()[0].get_ydata()[0] == pytest.approx(total, rel=1e-12)
    weights = [p.get_height() for p in w_ax.containers[0]]
    np.testing.assert_allclose(weights, np.exp(np.array(expected) - total), rtol=1e-10)
    assert sum(weights) == pytest.approx(1.0) and int(np.argmax(weights)) == 3       # keys 300..399
    assert [(round(p.get_x()), round(p.get_x() + p.get_width())) for p in cache.patches] == \
        decoding.split_bounds(500, 5)


@pytest.mark.parametrize("args,error,match", [
    ((np.ones(4), np.ones((9, 4)), np.ones((9, 4))), ValueError, "q must be a non-empty 2-D"),
    ((np.ones((2, 4)), np.ones((9, 4)), np.ones((9, 4))), ValueError, r"q must be \(1, d\)"),
    ((np.ones((1, 4), int), np.ones((9, 4)), np.ones((9, 4))), TypeError, "floating-point"),
    ((np.ones((1, 4)), np.ones((9, 4)), np.ones((9, 4)), 10), ValueError, "num_splits must be an int"),
    ((np.ones((1, 4)), np.full((9, 4), np.nan), np.ones((9, 4))), ValueError, "finite"),
])
def test_split_kv_refuses_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        figures.split_kv(*args)


# --- chapter 2: the online softmax animation ----------------------------------------------------------

def test_online_softmax_animation_is_a_standalone_player_with_one_frame_per_step():
    x = np.array([1.0, 3.0, 2.0, 5.0, 0.5])
    html = figures.online_softmax_animation(x)
    assert "new Animation(" in html and "<img id=" in html
    assert _frames(html) == len(x) + 1 <= figures.MAX_FRAMES
    assert "http" not in html, "the player must not load anything from a network"


def test_online_softmax_frames_show_the_running_state():
    x = np.array([1.0, 3.0, 2.0, 5.0, 4.5, 0.5])
    fig, update, n = figures._online_softmax_movie(x)
    scores, terms = fig.axes
    _labelled(scores), _labelled(terms)
    for j in range(len(x)):
        update(j)
        m, l = softmax.online_state(x[:j + 1])
        assert scores.get_lines()[0].get_ydata()[0] == m
        heights = np.array([p.get_height() for p in terms.containers[0]])
        np.testing.assert_allclose(heights[:j + 1].sum(), l, rtol=1e-12)       # the terms add up to l
        assert not heights[j + 1:].any()
        assert f"l = Σ = {l:.3f}" in _texts(fig)
    update(n - 1)                                                           # pass 2
    np.testing.assert_allclose([p.get_height() for p in terms.containers[0]], softmax.online_softmax(x))


@pytest.mark.parametrize("x,error,match", [
    (np.array([1.0]), ValueError, "len"),
    (np.zeros(16), ValueError, "len"),
    (np.array([1, 2, 3]), TypeError, "floating-point"),
    (np.array([1.0, np.inf]), ValueError, "finite"),
    (np.ones((2, 3)), ValueError, "1-D"),
])
def test_online_softmax_animation_refuses_bad_rows(x, error, match):
    with pytest.raises(error, match=match):
        figures.online_softmax_animation(x)


def test_animations_refuse_a_bad_frame_rate():
    with pytest.raises(ValueError, match="fps"):
        figures.online_softmax_animation(np.ones(3), fps=0)
    with pytest.raises(ValueError, match="fps"):
        figures.ring_animation(2, fps="fast")


# --- chapter 12: the ring schedule animation ----------------------------------------------------------

@pytest.mark.parametrize("world,layout,causal", [(4, "zigzag", True), (3, "contiguous", True),
                                                 (2, "contiguous", False)])
def test_ring_animation_frames_follow_the_schedule(world, layout, causal):
    need_module("torch")
    from flashlib.parallel import ring
    html = figures.ring_animation(world, layout, causal=causal)
    assert "new Animation(" in html and _frames(html) == world and "http" not in html
    fig, update, n = figures._ring_movie(world, layout, causal)
    ring_ax, matrix = fig.axes
    assert ring_ax.get_title() and matrix.get_xlabel() and matrix.get_ylabel()
    n_chunks = world * len(ring.chunk_ids(0, world, layout))
    for step in range(n):
        update(step)
        held = [t.get_text() for t in ring_ax.texts if t.get_text().startswith("holds")]
        assert held == ["holds " + ",".join(f"K{c}" for c in ring.chunk_ids((r - step) % world, world, layout))
                        for r in range(world)]
        shown = sorted(int(t.get_text()) for t in matrix.texts if t.get_visible())
        expected = sorted(s for r in range(world) for s in range(step + 1)
                          for b in ring.chunk_ids((r - s) % world, world, layout)
                          for a in ring.chunk_ids(r, world, layout)
                          if not (causal and b > a))
        assert shown == expected
    computed = n_chunks * (n_chunks + 1) // 2 if causal else n_chunks ** 2
    assert len(matrix.texts) == computed                                    # every block once


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(world=1), ValueError, "world must be an int"),
    (dict(world=9), ValueError, "world must be an int"),
    (dict(layout="spiral"), ValueError, "layout must be one of"),
    (dict(causal=1), TypeError, "causal must be True or False"),
])
def test_ring_animation_refuses_bad_arguments(kwargs, error, match):
    need_module("torch")
    with pytest.raises(error, match=match):
        figures.ring_animation(**kwargs)
