"""Show flashlib's own source in a chapter, so the book never holds a second copy of an algorithm.

Explained in: every chapter (the cells that display code).
"""
from __future__ import annotations

import inspect

__all__ = ["show", "crisp_figures"]


def show(obj):
    """The source of ``obj`` (a function, class or module), highlighted in a notebook, plain elsewhere.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/test_display.py.
    """
    if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismodule(obj)
            or inspect.ismethod(obj)):
        raise TypeError(f"obj must be a function, class, method or module, got {type(obj).__name__}")
    src = inspect.getsource(obj)
    try:
        from IPython.display import Code
    except ImportError:  # pragma: no cover - IPython ships with every notebook environment
        return src
    return Code(src, language="python")


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
