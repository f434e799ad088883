"""flashlib.display: chapters show the library's own source."""
import pytest

import flashlib


def test_show_returns_the_library_source():
    code = flashlib.show(flashlib.fa2.forward)
    assert "def forward(" in code.data and "line 12" in code.data
    with pytest.raises(TypeError, match="obj must be a function"):
        flashlib.show(3)
