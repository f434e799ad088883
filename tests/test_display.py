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


def test_show_leaves_out_the_docstrings_pointers_and_nothing_else():
    import inspect
    from flashlib.display import _without_pointers
    from flashlib.kernels.triton import fa2_fwd_v1
    for obj in (flashlib.ladder.fa2.forward, flashlib.api.decode, fa2_fwd_v1.grid, flashlib.IOCounter):
        source = inspect.getsource(obj)
        assert "Explained in:" in source                       # the library keeps its pointers ...
        shown = _without_pointers(source)
        assert "Explained in:" not in shown and "Tested in:" not in shown   # ... the chapter does not
        assert shown.count('"""') == source.count('"""')        # every docstring still closes
        compile(shown, "<shown>", "exec")                      # and the code is unchanged Python
    code = flashlib.show(flashlib.ladder.fa2.forward)
    assert "Explained in" not in getattr(code, "data", code)
    inline = 'def f():\n    """Summary.  Explained in: notebooks/07_triton."""\n    return "Tested in: x"\n'
    assert _without_pointers(inline) == 'def f():\n    """Summary."""\n    return "Tested in: x"\n'
    multi = ('class A:\n    def m(self):\n        """Summary.\n\n        Explained in: notebooks/01_x.\n'
             '        Tested in: tests/t.py.\n        """\n        return 1\n')
    assert _without_pointers(multi) == 'class A:\n    def m(self):\n        """Summary.\n        """\n        return 1\n'
    assert _without_pointers("def broken(:\n    Explained in: x") == "def broken(:\n    Explained in: x"
    with pytest.raises(TypeError, match="src must be a str, got int"):
        _without_pointers(3)


def test_pointers_on_the_closing_quotes_line_and_in_cuda_headers_are_left_out():
    import inspect
    from flashlib.display import _without_comment_pointers, _without_pointers
    src = 'def f():\n    """Summary.\n    Explained in: notebooks/07_triton."""\n    return 1\n'
    assert _without_pointers(src) == 'def f():\n    """Summary."""\n    return 1\n'
    from flashlib.kernels.triton import kit
    shown = _without_pointers(inspect.getsource(kit.attend.fn))
    assert "Explained in" not in shown and '"""' in shown
    header = ("// v1.cu: a kernel.\n// Run: forward(q, k, v); on a CPU\n//   in the emulator.\n"
              "// Explained in: notebooks/08_cuda (the algorithm: notebooks/06_x).\n"
              "//   more of the pointer.\n// Tested in: tests/kernels/cuda/test_x.py.\n#include <x.h>\n")
    assert _without_comment_pointers(header) == ("// v1.cu: a kernel.\n// Run: forward(q, k, v); on a CPU\n"
                                                 "//   in the emulator.\n#include <x.h>\n")
    from flashlib.kernels import cuda
    for version in ("v1", "v2", "v3", "decode"):
        text = getattr(cuda.source(version), "data", cuda.source(version))
        assert "Explained in" not in text and "Tested in" not in text and "__global__" in text


def test_show_puts_a_kernel_and_its_helpers_in_one_listing_and_folds_what_it_is_told():
    from flashlib.display import show
    from flashlib.ladder import fa2, naive
    listing = show(fa2.forward, naive.attention, fold=[naive.attention])
    text = str(listing)
    assert text.index("def forward(") < text.index("def attention(")       # in the order given
    assert listing.data == text == repr(listing)
    html = listing._repr_html_()
    assert html.count("<details") == 1                                    # only the folded part
    folded = html[html.index("<details"):]
    assert "def attention(" in folded[:folded.index("</summary>")]        # its first line is the summary
    assert "lines, click to open" in folded
    assert "<details" not in show(fa2.forward)._repr_html_()
    with pytest.raises(TypeError, match=r"more\[0\] must be a function, class, method or module, got int"):
        show(fa2.forward, 3)
    with pytest.raises(ValueError, match="fold must name objects that are shown, got 'attention'"):
        show(fa2.forward, fold=naive.attention)


def test_table_is_html_in_the_book_and_aligned_text_in_a_terminal():
    from flashlib.display import table
    t = table([["sm_80", 128, 0.5], ["sm_90a", 7, 12.25]], ["arch", "regs", "ms"], caption="Compiled")
    assert str(t).splitlines() == ["Compiled", "arch    regs     ms",
                                   "------  ----  -----", "sm_80    128    0.5", "sm_90a     7  12.25"]
    html = t._repr_html_()
    assert html.startswith("<table") and "<caption>Compiled</caption>" in html
    assert html.count("<tr>") == 3 and "<th>arch</th>" in html
    assert '<td style="text-align: right">128</td>' in html and "<td>sm_90a</td>" in html
    assert "&lt;b&gt;" in table([["<b>"]], ["x"])._repr_html_()           # cells are escaped
    with pytest.raises(ValueError, match="rows must have 3 cells each .*row 1 has 2"):
        table([[1, 2, 3], [1, 2]], ["a", "b", "c"])
    with pytest.raises(TypeError, match="header must be a sequence of str"):
        table([[1]], "a")
    with pytest.raises(TypeError, match="caption must be a str or None, got int"):
        table([[1]], ["a"], caption=3)
