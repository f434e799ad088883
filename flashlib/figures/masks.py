"""Masks as tile classification: the band of (query, key) pairs a mask lets through, over the tile
grid of a tiled kernel, each tile full, partial or empty.

* :func:`tile_counts` — how many tiles of a ``block_q x block_k`` grid are full (computed without a
  mask), partial (computed with one) and empty (skipped), by ``flashlib.ladder.masks.tile_class``;
* :func:`mask_tiles` — the picture: for a causal mask, a sliding window and a window with a causal
  mask, the visible pairs (``flashlib.ladder.masks.band_mask``) and every tile coloured by its class.

Explained in: notebooks/09_real_models.
"""
from __future__ import annotations

import math
import numbers

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ..validation import check_flag, check_int

__all__ = ["tile_counts", "mask_tiles", "MASKS"]

KINDS = ("full", "partial", "empty")
_FACE = {"full": "#6aa84f", "partial": "#f6b26b", "empty": "white"}
MAX_TILES = 1024                # a grid the picture can still draw
MAX_COUNT = 1 << 16             # a grid tile_counts classifies tile by tile


def _window(window, name: str = "window") -> tuple[int, int]:
    if not (isinstance(window, (tuple, list)) and len(window) == 2):
        raise TypeError(f"{name} must be a pair of ints (left, right), got {window!r}")
    for w in window:
        if isinstance(w, bool) or not isinstance(w, numbers.Integral):
            raise TypeError(f"{name} must be a pair of ints (left, right), got {window!r}")
        if w < -1:
            raise ValueError(f"{name} entries must be >= 0, or -1 for unbounded, got {tuple(window)}")
    return int(window[0]), int(window[1])


def _grid(nq, nk, block_q, block_k, limit=MAX_TILES):
    nq, nk = check_int(nq, "nq", 1, 1 << 24), check_int(nk, "nk", 1, 1 << 24)
    bq, bk = check_int(block_q, "block_q", 1), check_int(block_k, "block_k", 1)
    tiles = math.ceil(nq / bq) * math.ceil(nk / bk)
    if tiles > limit:
        raise ValueError(f"block_q, block_k give {tiles} tiles for nq={nq}, nk={nk}; at most "
                         f"{limit} (choose larger blocks)")
    return nq, nk, bq, bk


def _classes(nq, nk, bq, bk, causal, window):
    """``{(q0, k0): kind}`` for every tile, by the ladder's own rule."""
    from ..ladder.masks import tile_class
    return {(q0, k0): tile_class(q0, min(q0 + bq, nq), k0, min(k0 + bk, nk), nq, nk,
                                 causal=causal, window=window)
            for q0 in range(0, nq, bq) for k0 in range(0, nk, bk)}


def tile_counts(nq: int, nk: int, *, block_q: int, block_k: int, causal: bool = False,
                window=(-1, -1)) -> dict[str, int]:
    """``{"full": ..., "partial": ..., "empty": ...}``: the tiles of the ``block_q x block_k`` grid
    over the ``nq x nk`` score matrix in each class of ``flashlib.ladder.masks.tile_class``, under
    ``causal`` and ``window = (left, right)`` (-1: unbounded; bottom-right aligned). A tiled kernel
    computes the full tiles without a mask, the partial ones with it, and skips the empty ones.
    At most ``MAX_COUNT`` (65,536) tiles: each is classified by the ladder's own rule.

    Explained in: notebooks/09_real_models.
    Tested in: tests/figures/test_masks.py.
    """
    nq, nk, bq, bk = _grid(nq, nk, block_q, block_k, MAX_COUNT)
    kinds = list(_classes(nq, nk, bq, bk, check_flag(causal, "causal"), _window(window)).values())
    return {kind: kinds.count(kind) for kind in KINDS}


# The three masks of the picture: (title, causal, window) with W the window's width.
MASKS = (("causal", True, None), ("sliding window (W, W)", False, "both"),
         ("window + causal (W, 0)", True, "left"))


def mask_tiles(nq: int = 48, nk: int = 48, *, block_q: int = 8, block_k: int = 8,
               window: int = 16) -> Figure:
    """Three masks over the same tile grid: causal; a sliding window of ``window`` keys on each side
    (``window_size = (W, W)``); and a window with a causal mask (``(W, 0)``, Mistral's and Gemma 2's
    local layers). In each panel the visible (query, key) pairs are shaded
    (``flashlib.ladder.masks.band_mask``) and each tile is coloured by
    ``flashlib.ladder.masks.tile_class``: full (no mask needed), partial (masked), empty (skipped,
    hatched). Titles give the counts; the grid is bottom-right aligned as every flashlib mask is.

    Explained in: notebooks/09_real_models.
    Tested in: tests/figures/test_masks.py.
    """
    from ..ladder.masks import band_mask
    nq, nk, bq, bk = _grid(nq, nk, block_q, block_k)
    w = check_int(window, "window", 0, max(nq, nk))
    fig = Figure(figsize=(8.6, 4.6))
    axes = fig.subplots(1, len(MASKS), sharey=True)
    fig.subplots_adjust(left=0.07, right=0.99, top=0.80, bottom=0.25, wspace=0.1)
    for ax, (title, causal, side) in zip(axes, MASKS):
        win = {None: (-1, -1), "both": (w, w), "left": (w, -1)}[side]
        seen = band_mask(0, nq, 0, nk, nq, nk, causal=causal, window=win)
        ax.imshow(np.where(seen, 0.4, 0.0), cmap="Greys", vmin=0, vmax=1,
                  extent=(0, nk, nq, 0), interpolation="nearest")
        classes = _classes(nq, nk, bq, bk, causal, win)
        for (q0, k0), kind in classes.items():
            h, wd = min(bq, nq - q0), min(bk, nk - k0)
            ax.add_patch(Rectangle((k0, q0), wd, h, facecolor=_FACE[kind],
                                   alpha=0.45 if kind != "empty" else 0.0,
                                   hatch="///" if kind == "empty" else None,
                                   edgecolor="0.35", lw=0.7, label=kind))
        counts = {kind: list(classes.values()).count(kind) for kind in KINDS}
        name = title.replace("W", str(w))
        ax.set_title(f"{name}\n{counts['full']} full, {counts['partial']} partial, "
                     f"{counts['empty']} empty", fontsize=10.5)
        ax.set_xlim(0, nk), ax.set_ylim(nq, 0)
        ax.set_xticks(range(0, nk + 1, bk * max(1, math.ceil(nk / bk / 6))))
        ax.set_yticks(range(0, nq + 1, bq * max(1, math.ceil(nq / bq / 6))))
        ax.set_xlabel("key index j", fontsize=10)
        ax.tick_params(labelsize=9)
    axes[0].set_ylabel("query index i", fontsize=10)
    handles = [Patch(facecolor=matplotlib.colors.to_rgba(_FACE["full"], 0.45), edgecolor="0.35",
                     label="full tile: computed, no mask"),
               Patch(facecolor=matplotlib.colors.to_rgba(_FACE["partial"], 0.45), edgecolor="0.35",
                     label="partial tile: computed with the mask"),
               Patch(facecolor="white", edgecolor="0.35", hatch="///", label="empty tile: skipped"),
               Patch(facecolor="0.6", label="visible (query, key) pair")]
    fig.legend(handles=handles, loc="lower center", ncol=2, frameon=False, fontsize=10)
    fig.suptitle(f"Nq = {nq}, Nk = {nk}, tiles of {bq} x {bk} (ladder.masks.tile_class)",
                 fontsize=11, y=0.98)
    return fig
