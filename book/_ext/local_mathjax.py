"""The book ships its own MathJax 3, so its formulas typeset with no network.

Sphinx loads MathJax from a CDN by default; offline, every formula would stay raw TeX. This extension
takes MathJax 3.2.2's browser build from the ``django-static-mathjax`` package (a dev dependency: plain
files, Django is not needed) and copies the component that ``mathjax_path`` names (``_config.yml``:
``mathjax/tex-mml-chtml.js``, the one Sphinx would load from the CDN, so the MathJax configuration
myst-parser writes is unchanged) and the folders MathJax loads on demand (TeX extensions, fonts, the
menu, accessibility) into ``_build/html/_static/mathjax/``.

Checked by: tests/test_book_browser.py (formulas typeset, no raw TeX, a local script).
"""
from __future__ import annotations

import importlib.resources
import pathlib

from sphinx.errors import ConfigError
from sphinx.util.fileutil import copy_asset, copy_asset_file

PREFIX = "mathjax/"          # mathjax_path is relative to _static/ and must start with this


def mathjax_source() -> pathlib.Path:
    """MathJax's es5 folder (its browser build) inside the installed package."""
    try:
        root = importlib.resources.files("mathjax")
    except ModuleNotFoundError:
        raise ConfigError("local_mathjax: the package django-static-mathjax is not installed "
                          "(pip install -c constraints.txt -e '.[dev]')") from None
    return pathlib.Path(str(root)) / "static" / "mathjax" / "es5"


def _check(app, config) -> None:
    path = config.mathjax_path
    if not path.startswith(PREFIX):
        raise ConfigError(f"local_mathjax: mathjax_path must name a file under {PREFIX} (a local copy), "
                          f"got {path!r}")
    if not (mathjax_source() / path[len(PREFIX):]).is_file():
        raise ConfigError(f"local_mathjax: {path[len(PREFIX):]!r} is not in {mathjax_source()}")


def _copy(app, exc) -> None:
    if exc is not None or app.builder.format != "html":
        return
    src, dest = mathjax_source(), pathlib.Path(app.outdir) / "_static" / PREFIX
    dest.mkdir(parents=True, exist_ok=True)
    copy_asset_file(src / app.config.mathjax_path[len(PREFIX):], dest)
    for folder in sorted(p for p in src.iterdir() if p.is_dir()):    # a11y, input, output, sre, ui, ...
        copy_asset(folder, dest / folder.name)


def setup(app):
    app.connect("config-inited", _check)
    app.connect("build-finished", _copy)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
