"""flashlib.puzzles of chapter 9 (variant_puzzles, variant_solutions): the reference solutions pass,
plausible wrong ones fail with a message that says where, a stub is "not attempted", the solutions
agree with the library (flashlib.ladder.masks.tile_class, the float64 oracle) beyond the cases, and
the chapter's Puzzles section names exactly these puzzles."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from conftest import ROOT

from flashlib import puzzles, testing
from flashlib.puzzles import variant_puzzles, variant_solutions

CHAPTER = "notebooks/09_real_models"
MINE = variant_puzzles.PUZZLES


# ---- plausible wrong solutions --------------------------------------------------------------------

def _tile_class_top_left(q0, q1, k0, k1, nq, nk, causal, window):
    """Forgets the bottom-right offset: query i's own key taken as i."""
    return variant_solutions.tile_class(q0, q1, k0, k1, nk, nk, causal, window)


def _tile_class_by_four_corners(q0, q1, k0, k1, nq, nk, causal, window):
    """Calls a tile empty when none of its four corners is visible: a narrow band can pass between them."""
    seen = variant_puzzles._band(nq, nk, causal, window)
    corners = [seen[q, k] for q in (q0, q1 - 1) for k in (k0, k1 - 1)]
    return "full" if all(corners) else "partial" if any(corners) else "empty"


def _tile_class_inclusive_end(q0, q1, k0, k1, nq, nk, causal, window):
    """Reads k1 as the last key, not one past it."""
    return variant_solutions.tile_class(q0, q1, k0, min(k1 + 1, nk), nq, nk, causal, window)


def _alibi_no_lse_fix(q, k, v, slope):
    o, lse = variant_solutions.alibi_causal(q, k, v, slope)
    c = np.arange(len(q)) + len(k) - len(q)
    return o, lse + slope * c                                      # forgot the row constant


def _alibi_no_max(q, k, v, slope):
    nq, nk = len(q), len(k)
    c, j = np.arange(nq)[:, None] + nk - nq, np.arange(nk)[None, :]
    e = np.where(j <= c, np.exp(q.shape[1] ** -0.5 * q @ k.T + slope * j), 0.0)   # exp(2000) = inf
    l = e.sum(axis=1, keepdims=True)
    o = np.divide(e @ v, l, out=np.zeros((nq, v.shape[1])), where=l > 0)   # rows with no key: 0
    with np.errstate(divide="ignore"):
        return o, np.log(l[:, 0]) - slope * c[:, 0]


def _alibi_top_left(q, k, v, slope):
    """The mask and the distance without the offset Nk - Nq."""
    i, j = np.arange(len(q))[:, None], np.arange(len(k))[None, :]
    s = np.where(j <= i, q.shape[1] ** -0.5 * q @ k.T - slope * np.abs(i - j), -np.inf)
    m = s.max(axis=1, keepdims=True)
    e = np.exp(s - np.where(np.isneginf(m), 0.0, m))
    l = e.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        return np.divide(e @ v, l, out=np.zeros((len(q), v.shape[1])), where=l > 0), (m + np.log(l))[:, 0]


def _sink_no_rescale(o, lse, sink):
    return o, np.logaddexp(lse, sink)                              # the output keeps its old weight


def _sink_unsafe(o, lse, sink):
    total = np.exp(lse) + np.exp(sink)                             # exp(1000) = inf
    return o * (np.exp(lse) / total)[:, None], np.log(total)


def _sink_as_a_key(o, lse, sink):
    lse_new = np.logaddexp(lse, sink)
    return o * np.exp(lse - lse_new)[:, None] + np.exp(sink - lse_new)[:, None], lse_new   # value 1, not 0


WRONG = [
    ("tile_class", _tile_class_top_left, "wrong on case Nq=6, Nk=11"),
    ("tile_class", _tile_class_by_four_corners, "expected 'partial'"),
    ("tile_class", _tile_class_inclusive_end, "wrong on case"),
    ("tile_class", lambda *a: variant_solutions.tile_class(*a).upper(), "expected one of ('full'"),
    ("alibi_causal", _alibi_no_lse_fix, "lse: max error"),
    ("alibi_causal", _alibi_no_max, "slope=8"),
    ("alibi_causal", _alibi_top_left, "wrong on case Nq=1, Nk=37"),
    ("alibi_causal", lambda q, k, v, s: testing.reference(q, k, v, causal=True), "max error"),
    ("sink_merge", _sink_no_rescale, "o: max error"),
    ("sink_merge", _sink_unsafe, "sink=1000"),
    ("sink_merge", _sink_as_a_key, "o: max error"),
]


# The reference solutions passing, the wrong ones failing with one line each, and the stubs: the
# checks every puzzle gets, in tests/puzzles/test_puzzles.py (which takes WRONG from here).


def test_the_reference_solutions_pass_on_enough_cases():
    for puzzle in MINE:
        result = puzzle.check(puzzle.solution)
        assert result and result.cases >= 7, result


@pytest.mark.parametrize("returned", [None, 3, "full?", ("full",), np.zeros(3), (np.zeros(2),)], ids=repr)
def test_odd_return_values_give_one_line_not_a_crash(returned):
    for p in MINE:
        result = p.check(lambda *a: returned)
        assert result.status == "wrong" and "\n" not in str(result), str(result)


def test_the_puzzles_are_registered_for_chapter_9_and_their_specs_have_no_math():
    assert [p.name for p in puzzles.PUZZLES.values() if p.chapter == CHAPTER] == [p.name for p in MINE]
    assert 2 <= len(MINE) <= 4
    for p in MINE:
        assert "$" not in p.spec and p._repr_markdown_().startswith(f"**{p.title}")
        assert all(len(line) <= 80 for line in repr(p).splitlines())


def test_the_case_kinds_cover_full_partial_and_empty():
    kinds = [c.expected.args[0] for c in variant_puzzles._tile_cases()]
    assert {k: kinds.count(k) >= 10 for k in variant_puzzles.KINDS} == dict.fromkeys(variant_puzzles.KINDS, True)


# ---- the solutions agree with the library beyond the cases ----------------------------------------

def test_tile_class_solution_agrees_with_the_ladder_and_with_brute_force():
    masks = pytest.importorskip("flashlib.ladder.masks")
    ladder = getattr(masks, "tile_class", None)
    rng = np.random.default_rng(3)
    for _ in range(300):
        nq, nk = (int(x) for x in rng.integers(1, 14, size=2))
        window = tuple(int(x) for x in rng.integers(-1, 6, size=2))
        causal = bool(rng.integers(2))
        q0 = int(rng.integers(nq))
        q1 = int(rng.integers(q0 + 1, nq + 1))
        k0 = int(rng.integers(nk))
        k1 = int(rng.integers(k0 + 1, nk + 1))
        tile = variant_puzzles._band(nq, nk, causal, window)[q0:q1, k0:k1]
        want = "full" if tile.all() else "partial" if tile.any() else "empty"
        got = variant_solutions.tile_class(q0, q1, k0, k1, nq, nk, causal, window)
        assert got == want, (q0, q1, k0, k1, nq, nk, causal, window)
        if ladder is not None:
            assert ladder(q0, q1, k0, k1, nq, nk, causal=causal, window=window) == want


def test_the_band_written_out_is_the_oracles():
    """The puzzle's mask agrees with flashlib.testing.reference: a key outside the band changes nothing."""
    for nq, nk, causal, window in [(5, 9, True, (2, -1)), (9, 5, False, (1, 1)), (7, 7, True, (0, 0))]:
        q, k, v = testing.random_qkv(nq, nk, 4, seed=nq)
        seen = variant_puzzles._band(nq, nk, causal, window)
        o, lse = testing.reference(q, k, v, causal=causal, window_size=window)
        s = np.where(seen, q @ k.T / 2.0, -np.inf)
        m = s.max(axis=1, keepdims=True)
        e = np.exp(s - np.where(np.isneginf(m), 0.0, m))
        with np.errstate(divide="ignore", invalid="ignore"):
            want_lse = np.where(e.sum(1) > 0, (m[:, 0] + np.log(e.sum(1))), -np.inf)
        testing.assert_close(lse, want_lse, atol=1e-12, name="lse")


@pytest.mark.parametrize("nq,nk,slope", [(6, 6, 0.5), (3, 11, 2.0), (11, 3, 0.125)])
def test_alibi_shift_solution_matches_the_oracle_with_leading_dims_free(nq, nk, slope):
    q, k, v = testing.random_qkv(nq, nk, 8, seed=nk)
    o, lse = variant_solutions.alibi_causal(q, k, v, slope)
    want_o, want_lse = testing.reference(q, k, v, causal=True, alibi_slopes=slope)
    testing.assert_close(o, want_o, atol=1e-12, name="o")
    testing.assert_close(lse, want_lse, atol=1e-12, name="lse")


def test_sink_merge_matches_the_oracle_and_keeps_empty_rows_finite():
    q, k, v = testing.random_qkv(7, 3, 5, seed=1)
    o, lse = testing.reference(q, k, v, causal=True)               # rows 0-3 see no key
    got_o, got_lse = variant_solutions.sink_merge(o, lse, 0.75)
    want_o, want_lse = testing.reference(q, k, v, causal=True, sinks=0.75)
    testing.assert_close(got_o, want_o, atol=1e-12, name="o")
    testing.assert_close(got_lse, want_lse, atol=1e-12, name="lse")
    assert (got_lse[:4] == 0.75).all() and (got_o[:4] == 0).all()


# ---- the chapter's Puzzles section ------------------------------------------------------------------

_NAME = re.compile(r"""puzzles\.(?:get|check)\(\s*["'](\w+)["']""")


def test_the_chapter_ends_with_a_puzzles_section_naming_these_puzzles():
    path = ROOT / f"{CHAPTER}.ipynb"
    if not path.is_file():
        pytest.skip(f"{CHAPTER}.ipynb not written yet")
    cells = json.loads(path.read_text())["cells"]
    src = ["".join(c["source"]) for c in cells]
    start = [i for i, s in enumerate(src) if cells[i]["cell_type"] == "markdown" and s.startswith("## Puzzles")]
    assert len(start) == 1
    used = [n for c, s in zip(cells[start[0]:], src[start[0]:]) if c["cell_type"] == "code"
            for n in _NAME.findall(s)]
    assert list(dict.fromkeys(used)) == [p.name for p in MINE]
    for number, p in enumerate(MINE, 1):
        heading = f"### Puzzle 9.{number}: {p.title}"
        at = src.index(heading) if heading in src else -1
        assert at > start[0], f"no heading {heading!r}"
        spec, stub, reveal, hidden = cells[at + 1:at + 5]
        assert "".join(spec["source"]).strip() == f'puzzles.get("{p.name}")'
        assert "raise NotImplementedError" in "".join(stub["source"])
        assert "".join(reveal["source"]).startswith("Solution (click to reveal)")
        assert "hide-cell" in hidden["metadata"].get("tags", [])
        assert f"variant_solutions.{p.name}" in "".join(hidden["source"])
