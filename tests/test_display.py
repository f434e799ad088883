"""flashlib.display: chapters show the library's own source."""
import pytest

import flashlib


def test_show_returns_the_library_source():
    code = flashlib.show(flashlib.ladder.fa2.forward)
    src = getattr(code, "data", code)      # IPython's Code in a notebook environment, plain str without
    assert "def forward(" in src and "line 12" in src
    with pytest.raises(TypeError, match="obj must be a function"):
        flashlib.show(3)
