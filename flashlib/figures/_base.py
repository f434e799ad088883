"""What every module of flashlib.figures shares: the checkout's root, the colours, and SVG output
that is the same bytes on every run. (A module of its own, so that flashlib.figures and the modules
it re-exports import it without importing each other.)"""
from __future__ import annotations

import io as _io
import pathlib

import matplotlib
from matplotlib.figure import Figure

ROOT = pathlib.Path(__file__).resolve().parents[2]     # a checkout: _toc.yml and notebooks/ sit here
COLORS = matplotlib.colormaps["tab10"].colors


def to_svg(fig: Figure) -> str:
    """``fig`` as SVG text, the same bytes on every run (fixed ids, no date), text drawn as paths.

    Explained in: book/intro (the roadmap is written this way).
    Tested in: tests/test_figures.py.
    """
    if not isinstance(fig, Figure):
        raise TypeError(f"fig must be a matplotlib Figure, got {type(fig).__name__}")
    buf = _io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": "flashlib", "svg.fonttype": "path"}):
        fig.savefig(buf, format="svg", metadata={"Date": None}, bbox_inches="tight")
    return buf.getvalue()
