"""flashlib.kernels.cuda.source and excerpt: a chapter shows one CUDA function, or the part of a long
kernel its prose discusses, found in the file by name and brace matching (never pasted)."""
from __future__ import annotations

import pytest

import flashlib.kernels.cuda as fc
from flashlib.display import Listing
from flashlib.kernels.cuda import build, function_source


def test_the_whole_file_without_pointers():
    shown = fc.source("v1")
    assert isinstance(shown, Listing) and shown.language == "cuda"
    assert "__global__" in shown.data and "Explained in" not in shown.data
    assert str(shown) == shown.data


@pytest.mark.parametrize("version,name,first,inside", [
    ("v1", "fa2_fwd_v1_f32", 'extern "C" __global__', "__syncthreads();"),
    ("v2", "forward", "template <class T>", "wmma::mma_sync"),
    ("v3", "forward", "template <class T, int D, int BC>", "ptx::ldmatrix_x4"),
    ("v3", "at", "// Element (r, c)", "return tile"),
    ("decode", "combine", "template <class T>", "lse_parts"),
    ("bwd", "dkdv", "// Lines 5-19", "mma_abt"),
])
def test_one_function_from_its_comment_to_its_closing_brace(version, name, first, inside):
    text = fc.source(version, name).data
    assert text.startswith(first) and inside in text and text.rstrip().endswith("}")
    whole = (build.CSRC / fc.SOURCES[version]).read_text()
    assert text in whole                                  # a slice of the file, not a copy


def test_brace_matching_skips_comments_literals_and_declarations():
    text = ('template <class T> __device__ T f(T x);   // declared first\n'
            '// f: the { in this comment does not count\n'
            'template <class T>\n'
            '__device__ T f(T x) {\n'
            '    const char* s = "}";  /* } */\n'
            '    if (x) { return g(x); }\n'
            '    return x;\n'
            '}\n'
            '__global__ void k() { f(1); }\n')
    body, signature = function_source(text, "f")
    assert body == "".join(text.splitlines(True)[1:8])
    assert signature == "template <class T> __device__ T f(…)"
    assert function_source(text, "k")[0] == "__global__ void k() { f(1); }\n"


def test_several_functions_in_one_listing_some_folded():
    shown = fc.source("v3", "forward", "at", "load_tile", fold=["at", "load_tile"])
    assert [folded for _, folded in shown.parts] == [False, True, True]
    assert shown.data.index("void forward(") < shown.data.index("T* at(") < shown.data.index("load_tile(T*")
    html = shown._repr_html_()
    assert html.count("<details") == 2 and "__device__ __forceinline__ T* at(…)" in html


def test_excerpt_between_markers_and_to_the_end_of_a_block():
    part = fc.excerpt("v3", "// Element (r, c)", "// rows x D tile")
    assert part.data.startswith("// Element (r, c)") and part.data.rstrip().endswith("}")
    loop = fc.excerpt("v3", "for (int j = 0; j < ntiles; ++j)")
    assert loop.data.startswith("for (int j = 0") and loop.data.rstrip().endswith("}")
    assert "\n#pragma unroll\n" in loop.data                # preprocessor lines stay at column 0


def test_refusals_name_the_argument():
    with pytest.raises(ValueError, match="version must be one of"):
        fc.source("v9")
    with pytest.raises(ValueError, match="no __global__ or __device__ function 'nope'"):
        fc.source("v1", "nope")
    with pytest.raises(TypeError, match="more\\[0\\] must be a str"):
        fc.source("v3", "forward", 3)
    with pytest.raises(ValueError, match="fold must name functions that are shown"):
        fc.source("v3", "forward", fold="at")
    with pytest.raises(ValueError, match="more and fold need a function"):
        fc.source("v3", fold="at")
    with pytest.raises(ValueError, match="start 'no such line' is not in"):
        fc.excerpt("v3", "no such line")
    with pytest.raises(ValueError, match="name must be a C\\+\\+ identifier"):
        function_source("x", "a b")
