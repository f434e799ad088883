"""The chapters are numbered as the prose refers to them, and each opens the same way.

The book's prose says "chapter 4"; the page title must then read "4. FlashAttention-2" (the number is the
notebook's file prefix, and the table of contents lists the chapters in that order). Each chapter's opening
cell ends with a "Before you start" box naming its prerequisites and its notation, and every "chapter N" in
the book points at a chapter that exists.
"""
from __future__ import annotations

import json
import re

import pytest

from conftest import ROOT, need_module

need_module("yaml")  # PyYAML reads _toc.yml; skip the module, saying why, where it is missing
import yaml  # noqa: E402

CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
_MENTION = re.compile(r"\b[Cc]hapters? (\d+)(?:(?:–| to | and |, )(\d+))*")


def _markdown(path):
    nb = json.loads(path.read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]


def _mentions(text):
    """Every chapter number in phrases like "chapter 4", "chapters 4 and 5", "chapters 4 to 6"."""
    found = []
    for m in _MENTION.finditer(text):
        found += [int(x) for x in re.findall(r"\d+", m.group(0))]
    return found


def test_mentions_parser():
    assert _mentions("see chapter 4, then chapters 5 and 6; chapters 7 to 9. Chapter 10") == [4, 5, 6, 7, 9, 10]
    assert _mentions("no reference here, a 4-chapter book") == []


def test_chapters_are_numbered_one_to_ten_in_toc_order():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [c["file"] for part in toc["parts"] for c in part["chapters"]]
    listed = [f for f in files if re.match(r"notebooks/\d\d_", f)]
    assert listed == [f"notebooks/{p.stem}" for p in CHAPTERS]
    assert [int(p.name[:2]) for p in CHAPTERS] == list(range(1, len(CHAPTERS) + 1))
    # A chapter's further pages (notebooks/07b_*.ipynb, ...) are its sections, found by a glob.
    sections = [s["glob"] for part in toc["parts"] for c in part["chapters"] for s in c.get("sections", [])]
    assert all(re.fullmatch(r"notebooks/(\d\d)\[b-z\]_\*", g) for g in sections), sections
    pages = [f"notebooks/{p.stem}" for g in sections for p in sorted(ROOT.glob(g + ".ipynb"))]
    # Every notebook is in the book: the numbered chapters and their pages, then the appendices, last.
    notebooks = sorted(f"notebooks/{p.stem}" for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert sorted([f for f in files if f.startswith("notebooks/")] + pages) == notebooks
    appendices = [i for i, f in enumerate(files) if f.startswith("notebooks/appendix_")]
    assert all(i > files.index(listed[-1]) for i in appendices)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_title_carries_the_chapter_number(path):
    title = _markdown(path)[0].splitlines()[0]
    assert re.match(rf"# {int(path.name[:2])}\. \S", title), f"{path.name}: title {title!r} lacks its number"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_opening_box_names_prerequisites_and_notation(path):
    opening = _markdown(path)[0]
    box = opening[opening.find(":::{admonition} Before you start"):]
    assert box.startswith(":::{admonition} Before you start"), f"{path.name}: no 'Before you start' box"
    assert "**Prerequisites:**" in box and "**Notation:**" in box
    assert "{doc}`../book/notation`" in box and box.rstrip().endswith(":::")
    earlier = [n for n in _mentions(box.split("**Notation:**")[0]) if n >= int(path.name[:2])]
    assert not earlier, f"{path.name}: a prerequisite names a later chapter {earlier}"


def test_every_chapter_mention_points_at_a_chapter():
    texts = {p.name: "\n".join(_markdown(p)) for p in CHAPTERS}
    texts.update({p.name: p.read_text() for p in (ROOT / "book").glob("*.md")})
    texts["README.md"] = (ROOT / "README.md").read_text()
    bad = {name: n for name, text in texts.items() for n in _mentions(text) if not 1 <= n <= len(CHAPTERS)}
    assert not bad, f"chapter numbers that do not exist: {bad}"


def test_admonitions_are_closed():
    """A `:::{admonition}` left open swallows the rest of the page; count openers and closers per cell."""
    for path in CHAPTERS:
        for cell in _markdown(path):
            opened = len(re.findall(r"^:::\{", cell, re.M))
            closed = len(re.findall(r"^:::\s*$", cell, re.M))
            assert opened == closed, f"{path.name}: {opened} admonitions opened, {closed} closed in {cell[:60]!r}"


def test_test_markers_are_cell_tags_not_lines_the_reader_sees():
    """nbval's output checks are cell tags (nbval-check-output), never a `# NBVAL_...` comment shown on
    the page; every chapter keeps some checked outputs."""
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        shown = [c for c in cells if "NBVAL" in "".join(c["source"])]
        assert not shown, f"{path.name}: a cell shows an nbval marker: {''.join(shown[0]['source'])[:80]!r}"
        checked = [c for c in cells if "nbval-check-output" in c.get("metadata", {}).get("tags", [])]
        assert checked, f"{path.name}: no cell's output is checked (tag nbval-check-output)"


_HIDDEN = {"remove-input", "hide-input", "remove-cell", "hide-cell"}


def _shown_lines(path):
    """(where, line) for every line a page shows as code: visible code cells, their text outputs
    (``show()`` listings included: their text form is the whole listing) and fenced code in markdown.
    Markdown outputs (a puzzle's statement) render as prose, which wraps like any paragraph."""
    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        tags = set(cell.get("metadata", {}).get("tags", []))
        src = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            for fence, info, body in re.findall(r"^(```+)([^\n]*)\n(.*?)^\1", src, flags=re.M | re.S):
                if not info.lstrip().startswith("{") or info.strip() in ("{code-block}", "{code}"):
                    yield from ((f"cell {i} markdown code", line) for line in body.splitlines())
            continue
        if cell["cell_type"] != "code" or "remove-cell" in tags:
            continue
        if not tags & _HIDDEN:
            yield from ((f"cell {i} source", line) for line in src.splitlines())
        if "remove-output" in tags:
            continue
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "text" in out:
                text = "".join(out["text"])
            elif "text/plain" in data and not ({"image/png", "image/svg+xml", "text/markdown"} & data.keys()) and \
                    ("text/html" not in data or "<pre" in "".join(data["text/html"])):
                text = "".join(data["text/plain"])           # a listing's HTML holds the same text
            else:
                continue
            yield from ((f"cell {i} output", line) for line in text.splitlines())


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_every_shown_line_fits_the_books_code_width(path):
    """The book's code column holds flashlib.display.WIDTH (80) characters at 1280 px and code never wraps
    (book/_static/flashbook.css): every line a page shows, library listings included, fits. The browser
    test checks the rendered pages the same way."""
    from flashlib.display import WIDTH
    wide = [(where, len(line), line) for where, line in _shown_lines(path) if len(line) > WIDTH]
    assert not wide, f"{path.name}: {len(wide)} shown lines are wider than {WIDTH}, e.g. {wide[:3]}"
