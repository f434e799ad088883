"""flashlib.puzzles: the reference solutions pass, plausible wrong ones fail with a message that says
where, a stub is "not attempted", and each chapter's Puzzles section uses only registered puzzles.

The Triton puzzles' wrong kernels are in test_puzzles_triton.py.
"""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from conftest import ROOT, need_module

need_module("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from flashlib import puzzles  # noqa: E402
from flashlib.puzzles import Puzzle, Result, check, get, solutions  # noqa: E402
from flashlib.puzzles.core import mismatch  # noqa: E402
from test_serving_puzzles import WRONG as SERVING_WRONG  # noqa: E402
from test_variant_puzzles import WRONG as VARIANT_WRONG  # noqa: E402

NUMPY_PUZZLES = [p for p in puzzles.PUZZLES.values() if p.chapter != "notebooks/07_triton"]


# ---- plausible wrong solutions, one or more per puzzle -------------------------------------------

def _tri(nq, nk):
    return np.arange(nk)[None, :] <= np.arange(nq)[:, None]


def _softmax(s, subtract_max=True):
    e = np.exp(s - s.max(axis=1, keepdims=True)) if subtract_max else np.exp(s)
    return e / e.sum(axis=1, keepdims=True)


def _scores(q, k, causal, mask=solutions.causal_mask, scale=True):
    s = (q.shape[1] ** -0.5 if scale else 1.0) * q @ k.T
    return np.where(mask(len(q), len(k)), s, -np.inf) if causal else s


def _unsafe_online_step(m, l, x):
    m_new = np.maximum(m, x)
    return m_new, l * np.exp(m - m_new) + np.exp(x - m_new)       # -inf - (-inf) = NaN


def _exp_minus(x, m):
    return np.exp(x - np.where(np.isneginf(m), 0.0, m))


def _chunked_no_rescale(q, k, v, causal, chunk):
    s_all = _scores(q, k, causal)
    m, l, acc = np.full((len(q), 1), -np.inf), np.zeros((len(q), 1)), np.zeros((len(q), v.shape[1]))
    for j in range(0, len(k), chunk):
        s = s_all[:, j:j + chunk]
        m_new = np.maximum(m, s.max(axis=1, keepdims=True))
        l = l * _exp_minus(m, m_new) + _exp_minus(s, m_new).sum(axis=1, keepdims=True)
        acc, m = acc + _exp_minus(s, m_new) @ v[j:j + chunk], m_new        # forgot: acc * exp(m - m_new)
    return np.divide(acc, l, out=np.zeros_like(acc), where=l > 0)


def _fa1_unnormalized(o_i, l_i, m_i, s_ij, v_j):
    return solutions.fa2_step(o_i, l_i, m_i, s_ij, v_j)           # FA2's step where FA1's is asked


def _fa1_unsafe(o_i, l_i, m_i, s_ij, v_j):
    m_t = s_ij.max(axis=1, keepdims=True)
    p_t = np.exp(s_ij - m_t)                                      # NaN on a tile row of -inf
    l_t = p_t.sum(axis=1, keepdims=True)
    m_new = np.maximum(m_i, m_t)
    a, b = np.exp(m_i - m_new), np.exp(m_t - m_new)
    l_new = a * l_i + b * l_t
    return (l_i * a * o_i + b * p_t @ v_j) / l_new, l_new, m_new


def _fa2_step_divides(o_i, l_i, m_i, s_ij, v_j):
    return solutions.fa1_update(o_i, l_i, m_i, s_ij, v_j)         # normalizes every step


def _fa2_step_no_alpha(o_i, l_i, m_i, s_ij, v_j):
    m_new = np.maximum(m_i, s_ij.max(axis=1, keepdims=True))
    p = _exp_minus(s_ij, m_new)
    return o_i + p @ v_j, l_i * _exp_minus(m_i, m_new) + p.sum(axis=1, keepdims=True), m_new   # o_i not rescaled


def _fa2_forward_skips_early(q, k, v, causal, block_q, block_k):
    """Skips a key block when the *first* query of the block cannot see it: later queries could."""
    nq, nk = len(q), len(k)
    o, lse = np.zeros((nq, v.shape[1])), np.full(nq, -np.inf)
    for i in range(0, nq, block_q):
        q_i = q[i:i + block_q]
        o_i, l_i, m_i = np.zeros((len(q_i), v.shape[1])), np.zeros((len(q_i), 1)), np.full((len(q_i), 1), -np.inf)
        for j in range(0, nk, block_k):
            if causal and j > i + nk - nq:
                break
            s = _scores(q, k, causal)[i:i + block_q, j:j + block_k]
            o_i, l_i, m_i = solutions.fa2_step(o_i, l_i, m_i, s, v[j:j + block_k])
        o[i:i + block_q], lse[i:i + block_q] = solutions.fa2_finish(o_i, l_i, m_i)
    return o, lse


def _backward_tile_unsafe(q_i, k_j, v_j, do_i, lse_i, d_i, scale, mask):
    s = np.where(mask, scale * q_i @ k_j.T, -np.inf)
    p = np.exp(s - lse_i[:, None])                                # lse = -inf: NaN
    ds = p * (do_i @ v_j.T - d_i[:, None])
    return scale * ds @ k_j, scale * ds.T @ q_i, p.T @ do_i


def _backward_tile_no_scale(*args):
    dq, dk, dv = solutions.backward_tile(*args)
    return dq / args[6], dk / args[6], dv


def _split_bounds_floor(nk, num_splits):
    size = nk // num_splits
    return [(s * size, (s + 1) * size) for s in range(num_splits)]  # drops the remainder


def _split_partial_local(q, k_s, v_s, k0, nk, causal):
    return solutions.split_partial(q, k_s, v_s, 0, len(k_s), causal)  # masks as if the split were all keys


def _combine_unsafe(o_parts, lse_parts):
    w = np.exp(lse_parts)                                         # exp(1000) = inf
    l = w.sum(axis=0)
    return (w[..., None] * o_parts).sum(axis=0) / l[:, None], np.log(l)


WRONG = [
    ("causal_mask", lambda nq, nk: _tri(nq, nk), "wrong on case Nq=1, Nk=6: mask is wrong at row 0, column 1"),
    ("causal_mask", lambda nq, nk: np.arange(nk)[None] < np.arange(nq)[:, None] + nk - nq, "mask is wrong at row 0"),
    ("causal_mask", lambda nq, nk: solutions.causal_mask(nq, nk).astype(int), "dtype int64, expected bool"),
    ("softmax_rows", lambda s: _softmax(s, subtract_max=False), "case large scores ~800 (2, 6): p is NaN at row 0"),
    ("softmax_rows", _softmax, "case row 1 all -inf (3, 5): p is NaN at row 1, column 0"),
    ("naive_attention", lambda q, k, v, c: solutions.softmax_rows(_scores(q, k, c, scale=False)) @ v, "o: max error"),
    ("naive_attention", lambda q, k, v, c: solutions.softmax_rows(_scores(q, k, c, mask=_tri)) @ v, "causal"),
    ("naive_attention", lambda q, k, v, c: solutions.softmax_rows(_scores(q, k, c)),
     "wrong on case Nq=1, Nk=1, d=1: o: max error 0.36 at row 0, column 0 (expected 0.640423, got 1)"),
    ("naive_attention", lambda q, k, v, c: (solutions.softmax_rows(_scores(q, k, c)) @ v)[:, :1],
     "o has shape (1, 1), expected (1, 21)"),
    ("online_step", lambda m, l, x: (np.maximum(m, x), l + np.exp(x - np.maximum(m, x))), "l: max error"),
    ("online_step", _unsafe_online_step, "is NaN"),
    ("online_step", lambda m, l, x: solutions.online_step(m, l, x)[0], "after step 1: returned ndarray"),
    ("merge_states", lambda ma, la, mb, lb: (np.maximum(ma, mb), la + lb), "l: max error"),
    ("merge_states", lambda ma, la, mb, lb: (np.maximum(ma, mb), la * np.exp(ma - np.maximum(ma, mb))
                                             + lb * np.exp(mb - np.maximum(ma, mb))), "is NaN"),
    ("chunked_attention", _chunked_no_rescale, "o: max error"),
    ("fa1_update", _fa1_unnormalized, "o_i: max error"),
    ("fa1_update", _fa1_unsafe, "is NaN"),
    ("block_sizes", lambda sram, d, b: (min(-(-sram // b // (4 * d)), d), -(-sram // b // (4 * d))),
     "Bc: expected 17 = floor(M / 4d) with M = 500 elements, got 18"),
    ("block_sizes", lambda sram, d, b: (sram // b // (4 * d),) * 2,
     "Br: expected 64 = min(Bc, d) = min(96, 64), got 96"),
    ("block_sizes", lambda sram, d, b: (min(sram / b / (4 * d), d), sram / b / (4 * d)), "Bc must be an int"),
    ("block_sizes", lambda sram, d, b: (max(1, min(sram // b // (4 * d), d)), max(1, sram // b // (4 * d))),
     "expected a ValueError"),
    ("block_hidden", lambda q0, q1, k0, nq, nk: k0 > q0 + nk - nq, "hidden is wrong: expected False, got True"),
    ("block_hidden", lambda q0, q1, k0, nq, nk: k0 > q1 - 1, "hidden is wrong"),
    ("fa2_step", _fa2_step_divides, "o_i: max error"),
    ("fa2_step", _fa2_step_no_alpha, "o_i: max error"),
    ("fa2_finish", lambda o, l, m: (o / l, (m + np.log(l))[:, 0]), "o is NaN at row 0"),
    ("fa2_finish", lambda o, l, m: (solutions.fa2_finish(o, l, m)[0], np.log(l[:, 0])), "lse: max error"),
    ("fa2_finish", lambda o, l, m: (solutions.fa2_finish(o, l, m)[0], solutions.fa2_finish(o, l, m)[1][:, None]),
     "lse has shape"),
    ("fa2_forward", _fa2_forward_skips_early, "causal"),
    ("fa2_forward", lambda q, k, v, c, bq, bk: solutions.fa2_forward(q, k, v, c, bq, bk)[0],
     "returned ndarray, expected a tuple of 2 values (o, lse)"),
    ("rowsum_d", lambda do, o: (do * o).sum(axis=0), "D has shape"),
    ("rowsum_d", lambda do, o: do.sum(axis=1) * o.sum(axis=1), "D: max error"),
    ("ds_tile", lambda p, dp, d: dp - d[:, None], "ds: max error"),
    ("ds_tile", lambda p, dp, d: p * (dp - dp.sum(axis=1, keepdims=True)), "ds: max error"),
    ("backward_tile", _backward_tile_unsafe, "is NaN"),
    ("backward_tile", _backward_tile_no_scale, "dq: max error"),
    ("split_bounds", _split_bounds_floor,
     "case nk=1, num_splits=3: the splits must cover keys 0 .. 1: they start at 0 and stop at 0"),
    ("split_bounds", lambda nk, s: [(0, nk)] * s, "not contiguous"),
    ("split_partial", _split_partial_local, "o_s"),
    ("combine_splits", _combine_unsafe, "is NaN"),
    ("combine_splits", lambda o, lse: (o.mean(axis=0), lse.max(axis=0)), "max error"),
]
# chapter 9's wrong solutions live beside its puzzles' own tests
WRONG += VARIANT_WRONG + SERVING_WRONG


@pytest.mark.parametrize("puzzle", NUMPY_PUZZLES, ids=lambda p: p.name)
def test_the_reference_solution_passes(puzzle):
    result = puzzle.check(puzzle.solution)
    assert result and result.status == "correct", result
    assert str(result) == f"✔ {puzzle.name}: correct on {result.cases} cases" and result.cases >= 2


@pytest.mark.parametrize("name,fn,message", WRONG, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(WRONG)])
def test_a_plausible_wrong_solution_fails_and_says_where(name, fn, message):
    result = check(name, fn)
    assert not result and result.status == "wrong", result
    assert message in str(result), str(result)
    assert str(result).startswith(f"✘ {name}: ") and "\n" not in str(result)


def test_every_numpy_puzzle_has_a_wrong_solution_that_fails():
    assert {p.name for p in NUMPY_PUZZLES} <= {name for name, _, _ in WRONG}


@pytest.mark.parametrize("puzzle", NUMPY_PUZZLES, ids=lambda p: p.name)
def test_a_stub_is_not_attempted_yet(puzzle):
    def stub(*args):
        raise NotImplementedError

    result = puzzle.check(stub)
    assert result.status == "not attempted" and not result
    assert str(result) == f"… {puzzle.name}: not attempted yet (the stub raises NotImplementedError)"
    assert len(str(result)) <= 80                # one line of the book's code width


@pytest.mark.parametrize("bad", [None, 42, "merge_states", np.zeros(3)], ids=repr)
def test_check_refuses_what_is_not_a_function_naming_the_argument(bad):
    with pytest.raises(TypeError, match=r"^fn must be a function merge_states\(m_a, l_a, m_b, l_b\)"):
        check("merge_states", bad)


def test_get_refuses_unknown_names_and_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"name must be one of \[.*'causal_mask'.*\], got 'causal-mask'"):
        get("causal-mask")
    with pytest.raises(TypeError, match="name must be a puzzle's name"):
        get(3)
    assert get("causal_mask") is puzzles.PUZZLES["causal_mask"] and isinstance(get("fa2_step"), Puzzle)


def test_a_puzzle_shows_its_spec_and_signature():
    p = get("combine_splits")
    assert p._repr_markdown_().startswith("**Combine the splits.** Given the splits' normalized outputs")
    assert "Write `combine_splits(o_parts, lse_parts) -> (o, lse)`." in p._repr_markdown_()
    assert repr(p).startswith("Combine the splits. ") and "$" not in p.spec   # Markdown output: no math
    from flashlib.puzzles import ladder_puzzles
    asks = [q for q in ladder_puzzles.PUZZLES if q.title.endswith("?")]
    assert asks and all(q._repr_markdown_().startswith(f"**{q.title}** ") for q in asks)   # no "skip?."


def test_the_readers_own_exception_is_reported_with_the_case():
    def broken(q, k, v, causal):
        return q[len(q)]                                          # one past the last row
    result = check("naive_attention", broken)
    assert str(result) == ("✘ naive_attention: raised IndexError: index 1 is out of bounds for axis 0 with size 1 "
                           "on case Nq=1, Nk=1, d=1")


@pytest.mark.parametrize("returned,message", [
    (None, "o is None (does the function return it?)"),
    ("zeros", "dtype <U5, expected numbers"),
    ([[1, 2], [3]], "is a list that is not an array of numbers"),
    (np.zeros((1, 1), dtype=bool), "o has dtype bool, expected floating point"),
])
def test_odd_return_values_give_a_message_not_a_crash(returned, message):
    result = check("naive_attention", lambda *a: returned)
    assert result.status == "wrong" and message in str(result), str(result)


_garbage = st.one_of(st.none(), st.integers(), st.text(max_size=5), st.floats(),
                     st.lists(st.floats(), max_size=4), st.tuples(st.integers(), st.none()),
                     hnp.arrays(np.float64, hnp.array_shapes(max_dims=3, max_side=4)))


@settings(max_examples=60, deadline=None)
@given(returned=_garbage, name=st.sampled_from([p.name for p in NUMPY_PUZZLES]))
def test_whatever_a_reader_returns_the_checker_answers_with_one_line(returned, name):
    result = check(name, lambda *a: returned)
    assert isinstance(result, Result) and result.status == "wrong" and "\n" not in str(result)


@settings(max_examples=80, deadline=None)
@given(a=hnp.arrays(np.float64, st.tuples(st.integers(1, 5), st.integers(1, 5)),
                    elements=st.floats(-1e3, 1e3)),
       data=st.data())
def test_mismatch_finds_any_element_off_by_more_than_the_tolerance(a, data):
    i = data.draw(st.integers(0, a.shape[0] - 1))
    j = data.draw(st.integers(0, a.shape[1] - 1))
    bad = a.copy()
    bad[i, j] += data.draw(st.sampled_from([1.0, -0.5, np.nan, np.inf]))
    assert mismatch(a.copy(), a, "o") is None
    message = mismatch(bad, a, "o")
    assert message is not None and f"row {i}, column {j}" in message


def test_mismatch_treats_matching_minus_inf_as_equal_and_names_shapes_and_kinds():
    lse = np.array([0.5, -np.inf])
    assert mismatch(lse.copy(), lse, "lse") is None
    assert mismatch(np.array([0.5, 0.0]), lse, "lse") == "lse at row 1: expected -inf, got 0"
    assert mismatch(np.zeros(3), lse, "lse") == "lse has shape (3,), expected (2,)"
    assert (mismatch(np.array([1, 2]), np.array([1, 3]), "n")
            == "n is wrong at row 1: expected 3, got 2 (1 of 2 entries wrong)")


def test_a_torch_tensor_answer_is_read_like_an_array():
    torch = pytest.importorskip("torch")
    result = check("causal_mask", lambda nq, nk: torch.from_numpy(solutions.causal_mask(nq, nk)))
    assert result, result


# ---- the chapters' Puzzles sections -------------------------------------------------------------

CHAPTERS = sorted({p.chapter for p in puzzles.PUZZLES.values()})
_NAME = re.compile(r"""puzzles\.(?:get|check)\(\s*["'](\w+)["']""")


def _cells(chapter):
    return json.loads((ROOT / f"{chapter}.ipynb").read_text())["cells"]


def test_chapters_one_to_seven_have_two_to_four_puzzles_each():
    assert CHAPTERS == [f"notebooks/{p.stem}" for p in sorted((ROOT / "notebooks").glob("0[1-7]_*.ipynb"))
                        + sorted((ROOT / "notebooks").glob("09_*.ipynb"))
                        + sorted((ROOT / "notebooks").glob("10_*.ipynb"))]
    for chapter in CHAPTERS:
        assert 2 <= len([p for p in puzzles.PUZZLES.values() if p.chapter == chapter]) <= 4, chapter


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_chapter_ends_with_a_puzzles_section_naming_its_registered_puzzles(chapter):
    _assert_puzzles_section(chapter, _cells(chapter))


def test_the_section_check_fails_on_an_unknown_name_and_on_a_visible_solution():
    chapter = "notebooks/01_naive_attention"
    renamed = json.loads(json.dumps(_cells(chapter)).replace('check(\\"causal_mask\\"', 'check(\\"causal_masks\\"'))
    with pytest.raises(AssertionError, match=r"names puzzles that are not registered: \['causal_masks'\]"):
        _assert_puzzles_section(chapter, renamed)
    shown = _cells(chapter)
    for cell in shown:
        cell.get("metadata", {}).pop("tags", None)
    with pytest.raises(AssertionError, match="causal_mask: the solution must be hidden"):
        _assert_puzzles_section(chapter, shown)


def _assert_puzzles_section(chapter, cells):
    src = ["".join(c["source"]) for c in cells]
    starts = [i for i, s in enumerate(src) if cells[i]["cell_type"] == "markdown" and s.startswith("## Puzzles")]
    assert len(starts) == 1, f"{chapter}: expected one '## Puzzles' section, found {len(starts)}"
    first = starts[0]
    assert any("Exercises" in s for s in src[:first]), f"{chapter}: the puzzles must come after the exercises"
    section = list(zip(cells[first:], src[first:]))
    assert not any(c["cell_type"] == "markdown" and re.search(r"^##? ", s, re.M) for c, s in section[1:]), \
        f"{chapter}: the Puzzles section must be the chapter's last"
    used = [n for c, s in section if c["cell_type"] == "code" for n in _NAME.findall(s)]
    unknown = sorted(set(used) - set(puzzles.PUZZLES))
    assert not unknown, f"{chapter} names puzzles that are not registered: {unknown}"
    mine = [p.name for p in puzzles.PUZZLES.values() if p.chapter == chapter]
    assert list(dict.fromkeys(used)) == mine, f"{chapter}: puzzles {list(dict.fromkeys(used))}, registered {mine}"
    for number, name in enumerate(mine, 1):
        _assert_puzzle_cells(chapter, section, number, name)


def _assert_puzzle_cells(chapter, section, number, name):
    p = puzzles.PUZZLES[name]
    heading = f"### Puzzle {int(chapter.split('/')[1][:2])}.{number}: {p.title}"
    at = [i for i, (c, s) in enumerate(section) if s.startswith(heading)]
    assert at, f"{chapter}: no heading {heading!r}"
    cells = section[at[0] + 1:at[0] + 6]
    kinds = [c["cell_type"] for c, _ in cells]
    assert kinds == ["code", "code", "markdown", "code"] + kinds[4:], f"{chapter} {name}: cells {kinds}"
    (_, spec), (_, stub), (_, reveal), (hidden, solution) = cells[:4]
    assert spec.strip() == f'puzzles.get("{name}")'
    assert "raise NotImplementedError" in stub or "pass" in stub, f"{name}: the stub must be left to the reader"
    assert stub.rstrip().endswith(f'puzzles.check("{name}", {name})')
    assert reveal.startswith("Solution (click to reveal)")
    assert "hide-cell" in hidden.get("metadata", {}).get("tags", []), f"{name}: the solution must be hidden"
    assert "flashlib.show(" in solution and f'puzzles.check("{name}", ' in solution


# ---- careful-user arguments to the checker: a TypeError or ValueError naming the argument ----
@pytest.mark.parametrize("fn, got", [
    (lambda: 1, r"got <lambda>\(\)"),
    (lambda m_a, l_a, m_b: 1, r"got <lambda>\(m_a, l_a, m_b\)"),
    (lambda m_a, l_a, m_b, l_b, extra: 1, r"got <lambda>\(m_a, l_a, m_b, l_b, extra\)"),
    (lambda *, m_a, l_a, m_b, l_b: 1, r"got <lambda>\(\*, m_a, l_a, m_b, l_b\)"),
], ids=["no parameters", "one too few", "one too many", "keyword-only"])
def test_a_function_with_other_parameters_is_wrong_naming_fn_and_both_signatures(fn, got):
    """Before: reported as the reader's own TypeError on the first case ("raised TypeError: <lambda>()
    takes 0 positional arguments but 4 were given on case ..."), as if its answer were wrong there. A
    reader's mistake stays a one-line Result (the checker raises only for what is no function)."""
    result = check("merge_states", fn)
    assert result.status == "wrong" and not result
    assert re.match(r"^✘ merge_states: fn must take the arguments of merge_states\(m_a, l_a, m_b, l_b\), "
                    + got, str(result)), str(result)
    assert " on case " not in str(result)


def test_functions_that_take_the_arguments_in_other_ways_are_checked():
    """Defaults, *args and a callable object all take the signature's arguments: checked, not refused."""
    assert check("merge_states", lambda m_a, l_a, m_b, l_b, extra=0: solutions.merge_states(m_a, l_a, m_b, l_b))
    assert check("merge_states", lambda *a: solutions.merge_states(*a))

    class Merge:
        def __call__(self, m_a, l_a, m_b, l_b):
            return solutions.merge_states(m_a, l_a, m_b, l_b)
    assert check("merge_states", Merge())
    result = check("merge_states", dict)            # no signature Python can read: the cases tell
    assert result.status == "wrong" and "raised TypeError" in str(result)


@pytest.mark.parametrize("name, error, message", [
    (None, TypeError, r"name must be a puzzle's name \(str\), got NoneType"),
    (b"merge_states", TypeError, r"got bytes"),
    (" merge_states", ValueError, r"name must be one of .*got ' merge_states'"),
    ("Merge_States", ValueError, r"got 'Merge_States'"),
    ("", ValueError, r"got ''"),
])
def test_check_refuses_a_name_that_is_no_puzzle(name, error, message):
    with pytest.raises(error, match=message):
        check(name, solutions.merge_states)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(atol=-1.0), ValueError, r"atol must be a finite real number >= 0, got -1.0"),
    (dict(rtol=float("nan")), ValueError, r"rtol must be a finite real number >= 0, got nan"),
    (dict(atol="1e-6"), TypeError, r"atol must be a real number >= 0, got str '1e-6'"),
    (dict(rtol=True), TypeError, r"rtol must be a real number >= 0, got bool True"),
])
def test_mismatch_refuses_a_bad_tolerance(kwargs, error, message):
    """Before: atol=-1 made every answer wrong ("max error 0"), rtol=nan every answer right, and a str
    tolerance ended in numpy's UFuncTypeError."""
    with pytest.raises(error, match=message):
        mismatch(np.ones(2), np.ones(2), "o", **kwargs)
