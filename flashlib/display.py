"""Show flashlib's own source in a chapter, so the book never holds a second copy of an algorithm.

Explained in: every chapter (the cells that display code).
"""
from __future__ import annotations

import ast
import inspect
import re
import textwrap

__all__ = ["show", "crisp_figures"]


# A docstring's pointers for maintainers ("Explained in: ...", "Tested in: ..."), up to its closing
# quotes, with the blank line before them: kept in the source, dropped from what a chapter shows.
_POINTERS = re.compile(r'(?:\n[ \t]*)*[ \t]*(?:Explained|Tested) in:.*?(?=(?:\"\"\"|\'\'\')$)', re.S)


def show(obj):
    """The source of ``obj`` (a function, class or module), highlighted in a notebook, plain elsewhere.

    The docstrings' "Explained in" / "Tested in" pointers stay in the library (they are for its
    maintainers and tests/test_pointers.py) and are left out of what the chapter shows.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/test_display.py.
    """
    if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismodule(obj)
            or inspect.ismethod(obj)):
        raise TypeError(f"obj must be a function, class, method or module, got {type(obj).__name__}")
    src = _without_pointers(inspect.getsource(obj))
    try:
        from IPython.display import Code
    except ImportError:  # pragma: no cover - IPython ships with every notebook environment
        return src
    return Code(src, language="python")


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
