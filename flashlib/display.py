"""Show flashlib's own source in a chapter, so the book never holds a second copy of an algorithm.

Explained in: every chapter (the cells that display code).
"""
from __future__ import annotations

import ast
import html
import inspect
import re
import textwrap

__all__ = ["show", "table", "crisp_figures", "WIDTH"]

# The book's code width: the widest line a chapter shows (code cells, outputs, library listings). At the
# book's 13 px code font a line of 80 monospace characters fits the code column of a 1280 px window
# (book/_static/flashbook.css); tests/test_chapters.py and the browser test hold every page to it.
WIDTH = 80


# A docstring's pointers for maintainers ("Explained in: ...", "Tested in: ..."), up to its closing
# quotes, with the blank line before them: kept in the source, dropped from what a chapter shows.
_POINTERS = re.compile(r'(?:\n[ \t]*)*[ \t]*(?:Explained|Tested) in:.*?(?=(?:\"\"\"|\'\'\')$)', re.S)


def show(obj, *more, fold=()):
    """The source of ``obj`` (a function, class, method or module), highlighted in a notebook.

    ``more`` objects follow it in the same listing: a kernel and the helpers it calls are read in one
    place. An object also named in ``fold`` is shown folded (its first line, opened by a click), for
    the parts of a long listing the prose does not discuss; the text form (``str()``, what a terminal
    and nbval see) is always the whole source. Returns a :class:`Listing`.

    The docstrings' "Explained in" / "Tested in" pointers stay in the library (they are for its
    maintainers and tests/test_pointers.py) and are left out of what the chapter shows.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/test_display.py.
    """
    objs = (obj,) + more
    for i, o in enumerate(objs):
        if not (inspect.isfunction(o) or inspect.isclass(o) or inspect.ismodule(o) or inspect.ismethod(o)):
            name = "obj" if i == 0 else f"more[{i - 1}]"
            raise TypeError(f"{name} must be a function, class, method or module, got {type(o).__name__}")
    fold = (fold,) if not isinstance(fold, (tuple, list, set, frozenset)) else tuple(fold)
    for f in fold:
        if not any(f is o for o in objs):
            raise ValueError(f"fold must name objects that are shown, got {getattr(f, '__name__', f)!r}")
    return Listing([(_without_pointers(inspect.getsource(o)), any(o is f for f in fold)) for o in objs])


class Listing:
    """A code listing made of parts, some folded: highlighted HTML in a notebook (``_repr_html_``, a
    folded part is an HTML ``<details>`` whose summary is its first line, or the summary the part
    brings: ``(text, folded, summary)``, e.g. a CUDA function's signature) and plain text elsewhere
    (``str``, ``repr`` and ``.data``: every part in full, separated by a blank line).

    Explained in: notebooks/07_triton (the forward kernel with its helpers in one listing).
    Tested in: tests/test_display.py.
    """

    def __init__(self, parts, language: str = "python"):
        parts = [(p, False, None) if isinstance(p, str) else (*p, None)[:3] for p in parts]
        if not parts or not all(isinstance(t, str) and (m is None or isinstance(m, str))
                                for t, _, m in parts):
            raise TypeError("parts must be a non-empty list of str, (str, folded) or (str, folded, "
                            f"summary), got {parts!r:.80}")
        if not isinstance(language, str):
            raise TypeError(f"language must be a str, got {type(language).__name__}")
        self.parts = [(text.rstrip("\n") + "\n", bool(folded)) for text, folded, _ in parts]
        self.summaries = [summary for _, _, summary in parts]
        self.language = language

    @property
    def data(self) -> str:
        return "\n".join(text for text, _ in self.parts)

    def __str__(self) -> str:
        return self.data

    __repr__ = __str__

    def _repr_html_(self) -> str:
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import get_lexer_by_name
        lexer = get_lexer_by_name(self.language)
        blocks = []
        for (text, folded), first in zip(self.parts, self.summaries):
            block = highlight(text, lexer, HtmlFormatter(cssclass="highlight"))
            if folded:
                lines = text.splitlines()
                first = first or next((ln for ln in lines if ln.strip() and not ln.lstrip().startswith("@")),
                                      lines[0]).strip()
                n = len(lines)
                summary = html.escape(f"{first} … ({n} lines, click to open)", quote=False)
                block = f'<details class="flashbook-fold"><summary>{summary}</summary>{block}</details>'
            blocks.append(block)
        return "\n".join(blocks)


class Table:
    """A table: an HTML table in the book (``_repr_html_``), aligned text in a terminal (``str``).

    Explained in: notebooks/appendix_verification (the compile report's table).
    Tested in: tests/test_display.py.
    """

    def __init__(self, rows, header, caption=None):
        if isinstance(header, str) or not all(isinstance(h, str) for h in header):
            raise TypeError(f"header must be a sequence of str, got {header!r:.80}")
        rows = [list(r) for r in rows]
        bad = [i for i, r in enumerate(rows) if len(r) != len(header)]
        if bad:
            raise ValueError(f"rows must have {len(header)} cells each (one per header), "
                             f"row {bad[0]} has {len(rows[bad[0]])}")
        if caption is not None and not isinstance(caption, str):
            raise TypeError(f"caption must be a str or None, got {type(caption).__name__}")
        self.header, self.rows, self.caption = list(header), rows, caption

    @staticmethod
    def _cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return "" if value is None else str(value)

    def _numeric(self) -> list[bool]:
        """Per column: every cell a number (bools are not), so it aligns right."""
        return [bool(self.rows) and all(isinstance(r[i], (int, float)) and not isinstance(r[i], bool)
                                        for r in self.rows) for i in range(len(self.header))]

    def __str__(self) -> str:
        cells = [self.header] + [[self._cell(v) for v in r] for r in self.rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(self.header))]
        numeric = self._numeric()
        lines = ["  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric)).rstrip()
                 for r in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(([self.caption] if self.caption else []) + lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        def esc(text):
            return html.escape(text, quote=False)
        numeric = self._numeric()

        def td(v, num, tag="td"):
            style = ' style="text-align: right"' if num else ""
            return f"<{tag}{style}>{esc(self._cell(v))}</{tag}>"
        head = "".join(td(h, num, "th") for h, num in zip(self.header, numeric))
        body = "".join("<tr>" + "".join(td(v, num) for v, num in zip(r, numeric)) + "</tr>" for r in self.rows)
        cap = f"<caption>{esc(self.caption)}</caption>" if self.caption else ""
        return (f'<table class="table flashbook-table">{cap}<thead><tr>{head}</tr></thead>'
                f"<tbody>{body}</tbody></table>")


def table(rows, header, *, caption=None) -> Table:
    """``rows`` (a list of equal-length sequences) under ``header`` as a :class:`Table`: an HTML table in
    the book, so a wide table never breaks into half-rows, and aligned text in a terminal. Floats
    print with 4 significant digits; numeric columns align right.

    Explained in: notebooks/appendix_verification.
    Tested in: tests/test_display.py.
    """
    return Table(rows, header, caption)


def _without_comment_pointers(text: str, comment: str = "//") -> str:
    """``text`` (a C++ or CUDA file) without its header's ``// Explained in:`` / ``// Tested in:`` lines
    and their continuation lines (``//`` and two spaces or more), as chapters display a source file."""
    out, skipping = [], False
    for line in text.splitlines(True):
        if re.match(rf"\s*{re.escape(comment)}\s*(?:Explained|Tested) in:", line):
            skipping = True
            continue
        if skipping and re.match(rf"\s*{re.escape(comment)}\s{{2,}}\S", line):
            continue
        skipping = False
        out.append(line)
    return "".join(out)


def _without_pointers(src: str) -> str:
    """``src`` (Python source) with every docstring's "Explained in:" / "Tested in:" lines removed, to
    the docstring's closing quotes, as :func:`show` displays code. Only docstrings are touched (found
    with :mod:`ast`); source that does not parse is returned as it came.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/test_display.py.
    """
    if not isinstance(src, str):
        raise TypeError(f"src must be a str, got {type(src).__name__}")
    src = textwrap.dedent(src)                   # a method's source is indented
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return src
    lines = src.splitlines(True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def offset(lineno, col):                      # ast columns count UTF-8 bytes
        return starts[lineno - 1] + len(lines[lineno - 1].encode()[:col].decode())

    spans = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and \
                node.body and isinstance(node.body[0], ast.Expr) and \
                isinstance(node.body[0].value, ast.Constant) and isinstance(node.body[0].value.value, str):
            doc = node.body[0].value
            spans.append((offset(doc.lineno, doc.col_offset), offset(doc.end_lineno, doc.end_col_offset)))
    for a, b in sorted(spans, reverse=True):       # from the end: earlier offsets stay valid
        src = src[:a] + _POINTERS.sub(_keep_closing_indent, src[a:b]) + src[b:]
    return src


def _keep_closing_indent(m: re.Match) -> str:
    """What a pointer block becomes: the closing quotes' own line (a newline and its indent) when they
    stand on a line of their own, nothing when they end the pointer's line (``...  Explained in: x.\"\"\"``)."""
    text = m.group(0)
    last = text[text.rfind("\n") + 1:]              # what precedes the closing quotes on their line
    return "\n" + last if "\n" in text and not last.strip() else ""


def crisp_figures(fmt: str = "retina") -> None:
    """Draw this notebook's matplotlib figures at twice the resolution ("retina") or as vectors ("svg").

    Every chapter's setup cell calls it. Outside IPython (a plain script) it changes nothing. It returns None,
    so the setup cell shows no output.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/test_display.py.
    """
    if fmt not in ("retina", "svg", "png"):
        raise ValueError(f"fmt must be 'retina', 'svg' or 'png', got {fmt!r}")
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython ships with every notebook environment
        return
    shell = get_ipython()
    if shell is not None:
        shell.run_line_magic("config", f"InlineBackend.figure_formats = [{fmt!r}]")
