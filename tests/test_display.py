"""flashlib.display: chapters show the library's own source."""
import pytest

import flashlib
from conftest import require_module


def test_show_returns_the_library_source():
    code = flashlib.show(flashlib.ladder.fa2.forward)
    src = getattr(code, "data", code)      # IPython's Code in a notebook environment, plain str without
    assert "def forward(" in src and "line 12" in src
    with pytest.raises(TypeError, match="obj must be a function"):
        flashlib.show(3)


def test_crisp_figures_sets_the_inline_format_in_ipython_only(monkeypatch):
    require_module("IPython")
    import IPython

    class Shell:
        calls = []

        def run_line_magic(self, name, line):
            self.calls.append((name, line))

    monkeypatch.setattr(IPython, "get_ipython", lambda: None)
    assert flashlib.display.crisp_figures() is None           # a plain script: nothing to configure
    assert Shell.calls == []
    monkeypatch.setattr(IPython, "get_ipython", lambda: Shell())
    assert flashlib.display.crisp_figures("svg") is None      # no output under the setup cell
    assert Shell.calls == [("config", "InlineBackend.figure_formats = ['svg']")]
    with pytest.raises(ValueError, match="fmt must be 'retina', 'svg' or 'png', got 'jpeg'"):
        flashlib.display.crisp_figures("jpeg")
