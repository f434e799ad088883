"""flashlib.puzzles of chapter 10 (serving_puzzles, serving_solutions): the reference solutions pass,
plausible wrong ones fail with a message that says where, a stub is "not attempted", the solutions
agree with the library (flashlib.merge_states, the paged layout, the float64 oracle) beyond the cases,
and the chapter's Puzzles section names exactly these puzzles."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from conftest import ROOT

from flashlib import puzzles, testing
from flashlib.puzzles import serving_puzzles, serving_solutions

CHAPTER = "notebooks/10_serving"
MINE = serving_puzzles.PUZZLES
BY_NAME = {p.name: p for p in MINE}


# ---- plausible wrong solutions --------------------------------------------------------------------

def _cu_no_zero(lengths):
    return np.cumsum(lengths).astype(np.int32)                    # forgot the leading 0


def _cu_int64(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _cu_list(lengths):
    return [0] + list(np.cumsum(lengths))                         # not an array


def _gather_row_major(k_cache, block_table, b, n):
    """Swaps page and row: page t % P, row t // P."""
    size = k_cache.shape[1]
    t = np.arange(n)
    return k_cache[block_table[b, t % size], np.minimum(t // size, size - 1)]


def _gather_first_sequence(k_cache, block_table, b, n):
    """Reads sequence 0's table whatever b is."""
    return serving_solutions.paged_gather(k_cache, block_table, 0, n)


def _gather_whole_pages(k_cache, block_table, b, n):
    """Reads every page of the table's row, garbage included, then cuts."""
    pages = k_cache[block_table[b]]                               # IndexError on garbage
    return pages.reshape(-1, *k_cache.shape[2:])[:n]


def _gather_physical_order(k_cache, block_table, b, n):
    """Reads the sequence's pages sorted by physical number, not in logical order."""
    size = k_cache.shape[1]
    used = np.sort(block_table[b, :-(-n // size)])
    return k_cache[used].reshape(-1, *k_cache.shape[2:])[:n]


def _merge_unsafe(o_a, lse_a, o_b, lse_b):
    lse = np.logaddexp(lse_a, lse_b)
    return (np.exp(lse_a - lse)[..., None] * o_a + np.exp(lse_b - lse)[..., None] * o_b), lse  # NaN


def _merge_no_max(o_a, lse_a, o_b, lse_b):
    total = np.exp(lse_a) + np.exp(lse_b)                         # exp(800) = inf
    with np.errstate(divide="ignore"):
        lse = np.log(total)
    w_a = np.divide(np.exp(lse_a), total, out=np.zeros_like(total), where=total > 0)
    w_b = np.divide(np.exp(lse_b), total, out=np.zeros_like(total), where=total > 0)
    return w_a[..., None] * o_a + w_b[..., None] * o_b, lse


def _merge_max_lse(o_a, lse_a, o_b, lse_b):
    o, _ = serving_solutions.merge_attention(o_a, lse_a, o_b, lse_b)
    return o, np.maximum(lse_a, lse_b)                            # the max, not the log-sum-exp


def _merge_average(o_a, lse_a, o_b, lse_b):
    _, lse = serving_solutions.merge_attention(o_a, lse_a, o_b, lse_b)
    return (o_a + o_b) / 2, lse


def _varlen_top_left(q, k, v, cu_q, cu_k):
    """Causal from the top-left of each sequence: query i sees keys 0 .. i."""
    o, lse = np.zeros((len(q), v.shape[1])), np.full(len(q), -np.inf)
    for b in range(len(cu_q) - 1):
        qb, kb, vb = q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        # pad with keys it cannot see, then drop them: the mask j <= i
        if len(qb) and len(kb):
            n = len(kb)
            ob, lb = [], []
            for i in range(len(qb)):
                seen = min(i + 1, n)
                oi, li = testing.reference(qb[i:i + 1], kb[:seen], vb[:seen])
                ob.append(oi[0]), lb.append(li[0])
            o[cu_q[b]:cu_q[b + 1]], lse[cu_q[b]:cu_q[b + 1]] = ob, lb
    return o, lse


def _varlen_one_sequence(q, k, v, cu_q, cu_k):
    """Ignores the boundaries: causal attention over the whole packed batch."""
    if len(q) == 0 or len(k) == 0:
        return np.zeros((len(q), v.shape[1])), np.full(len(q), -np.inf)
    return testing.reference(q, k, v, causal=True)


def _varlen_global_offset(q, k, v, cu_q, cu_k):
    """Each sequence against its own keys, but the offset total_k - total_q of the whole batch."""
    off = len(k) - len(q)
    o, lse = np.zeros((len(q), v.shape[1])), np.full(len(q), -np.inf)
    for b in range(len(cu_q) - 1):
        qb, kb, vb = q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        s = qb @ kb.T / np.sqrt(q.shape[1])
        s = np.where(np.arange(len(kb))[None] <= np.arange(len(qb))[:, None] + off, s, -np.inf)
        m = s.max(axis=1, initial=-np.inf)
        safe = np.where(np.isneginf(m), 0.0, m)[:, None]
        p = np.exp(s - safe)
        l = p.sum(axis=1)
        o[cu_q[b]:cu_q[b + 1]] = np.divide(p @ vb, l[:, None], out=np.zeros((len(qb), v.shape[1])),
                                           where=l[:, None] > 0)
        with np.errstate(divide="ignore"):
            lse[cu_q[b]:cu_q[b + 1]] = safe[:, 0] + np.log(l)
    return o, lse


WRONG = [
    ("cu_seqlens", _cu_no_zero, "shape"),
    ("cu_seqlens", _cu_int64, "expected int32"),
    ("cu_seqlens", _cu_list, "returned list"),
    ("cu_seqlens", lambda lengths: np.array(lengths, dtype=np.int32), "wrong on case"),
    ("paged_gather", _gather_row_major, "page_size="),
    ("paged_gather", _gather_first_sequence, "sequence 1"),
    ("paged_gather", _gather_whole_pages, "raised IndexError"),
    ("paged_gather", _gather_physical_order, "max error"),
    ("merge_attention", _merge_unsafe, "is NaN"),
    ("merge_attention", _merge_no_max, "huge scores"),
    ("merge_attention", _merge_max_lse, "lse: max error"),
    ("merge_attention", _merge_average, "o: max error"),
    ("varlen_causal", _varlen_top_left, "wrong on case lengths q=[1, 1, 1]"),
    ("varlen_causal", _varlen_one_sequence, "wrong on case lengths q=[1, 1, 1]"),
    ("varlen_causal", _varlen_global_offset, "wrong on case"),
]


def test_the_reference_solutions_pass_on_enough_cases():
    for puzzle in MINE:
        result = puzzle.check(puzzle.solution)
        assert result and result.cases >= 7, result
        assert str(result) == f"✔ {puzzle.name}: correct on {result.cases} cases"


@pytest.mark.parametrize("name,fn,message", WRONG, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(WRONG)])
def test_a_plausible_wrong_solution_fails_and_says_where(name, fn, message):
    result = BY_NAME[name].check(fn)
    assert not result and result.status == "wrong", result
    assert message in str(result), str(result)
    assert str(result).startswith(f"✘ {name}: ") and "\n" not in str(result)


def test_every_puzzle_has_a_wrong_solution_and_a_stub_is_not_attempted():
    assert {p.name for p in MINE} <= {name for name, _, _ in WRONG}
    for p in MINE:
        def stub(*args):
            raise NotImplementedError
        result = p.check(stub)
        assert result.status == "not attempted" and len(str(result)) <= 80, str(result)


@pytest.mark.parametrize("returned", [None, 3, "cu", ([0],), np.zeros(3), (np.zeros(2),)], ids=repr)
def test_odd_return_values_give_one_line_not_a_crash(returned):
    for p in MINE:
        result = p.check(lambda *a: returned)
        assert result.status == "wrong" and "\n" not in str(result), str(result)


def test_the_puzzles_are_for_chapter_10_and_their_specs_have_no_math():
    assert [p.chapter for p in MINE] == [CHAPTER] * len(MINE)
    assert 2 <= len(MINE) <= 4
    for p in MINE:
        assert "$" not in p.spec and p._repr_markdown_().startswith(f"**{p.title}")
        assert all(len(line) <= 80 for line in repr(p).splitlines())
    registered = [p.name for p in puzzles.PUZZLES.values() if p.chapter == CHAPTER]
    assert registered == [p.name for p in MINE]
    # no name taken by another chapter's puzzle
    assert not {p.name for p in MINE} & {p.name for p in puzzles.PUZZLES.values() if p.chapter != CHAPTER}


def test_the_cases_are_adversarial():
    paged = serving_puzzles._paged_cases()
    assert {c.args[0].shape[1] for c in paged} >= {1, 3, 16, 256}
    assert any(c.args[3] == 0 for c in paged)                     # a sequence of length 0
    # a length that fills its last page exactly, with garbage in the next entry
    assert any(c.args[3] and c.args[3] % c.args[0].shape[1] == 0 and
               c.args[1][c.args[2], c.args[3] // c.args[0].shape[1]] == serving_puzzles.GARBAGE
               for c in paged)
    merge = serving_puzzles._merge_cases()
    assert any(np.isneginf(c.expected[1]).any() for c in merge)
    varlen = serving_puzzles._varlen_cases()
    assert any(np.isneginf(c.expected[1]).any() for c in varlen)  # rows that see no key
    assert any((np.diff(c.args[3]) == 0).any() for c in varlen)   # an empty sequence


# ---- the solutions agree with the library beyond the cases ----------------------------------------

def test_cu_seqlens_solution_matches_a_running_sum():
    rng = np.random.default_rng(0)
    for _ in range(50):
        lengths = list(rng.integers(0, 9, size=int(rng.integers(0, 7))))
        cu = serving_solutions.cu_seqlens(lengths)
        assert cu.dtype == np.int32 and cu[0] == 0 and list(np.diff(cu)) == lengths


def test_paged_gather_solution_inverts_a_scatter_through_a_shuffled_table():
    rng = np.random.default_rng(1)
    for size in (1, 3, 16, 256):
        lengths = [int(x) for x in rng.integers(0, 3 * size + 2, size=3)]
        need = [-(-n // size) for n in lengths]
        pages = rng.permutation(sum(need) + 2)
        table = np.full((3, max(need) + 1), -7, dtype=np.int32)
        dense = [rng.standard_normal((n, 2, 4)) for n in lengths]
        k_cache = np.zeros((len(pages), size, 2, 4))
        at = 0
        for b, n in enumerate(lengths):
            table[b, :need[b]] = pages[at:at + need[b]]
            at += need[b]
            for t in range(n):                                  # the scatter, token by token
                k_cache[table[b, t // size], t % size] = dense[b][t]
        for b, n in enumerate(lengths):
            got = serving_solutions.paged_gather(k_cache, table, b, n)
            assert np.array_equal(got, dense[b])


def test_merge_solution_matches_flashlib_merge_states_and_the_oracle():
    torch = pytest.importorskip("torch")
    q, k, v = testing.random_qkv(6, 11, 8, lead=(2,), seed=4)
    o_a, l_a = testing.reference(q, k[:, :4], v[:, :4])
    o_b, l_b = testing.reference(q, k[:, 4:], v[:, 4:])
    o, lse = serving_solutions.merge_attention(o_a, l_a, o_b, l_b)
    want_o, want_lse = testing.reference(q, k, v)
    testing.assert_close(o, want_o, atol=1e-12, name="o")
    testing.assert_close(lse, want_lse, atol=1e-12, name="lse")
    import flashlib
    merge = getattr(flashlib, "merge_states", None)
    if merge is None:
        pytest.skip("flashlib.merge_states not in this tree yet")
    t = [torch.from_numpy(x) for x in (o_a, l_a, o_b, l_b)]
    t[3][0, 2] = t[1][0, 2] = float("-inf")                        # a row with both states empty
    got_o, got_lse = merge(*t)
    mine_o, mine_lse = serving_solutions.merge_attention(*(x.numpy() for x in t))
    testing.assert_close(got_o.numpy(), mine_o, atol=1e-12, name="o")
    testing.assert_close(got_lse.numpy(), mine_lse, atol=1e-12, name="lse")
    assert (mine_o[0, 2] == 0).all() and np.isneginf(mine_lse[0, 2])


def test_varlen_solution_matches_the_varlen_oracle():
    ref = getattr(testing, "reference_varlen", None)
    if ref is None:
        pytest.skip("flashlib.testing.reference_varlen not in this tree yet")
    for case in serving_puzzles._varlen_cases():
        q, k, v, cu_q, cu_k = case.args
        o, lse = serving_solutions.varlen_causal(q, k, v, cu_q, cu_k)
        want_o, want_lse = ref(q[:, None], k[:, None], v[:, None], cu_q, cu_k, causal=True)
        testing.assert_close(o, want_o[:, 0], atol=1e-9, name="o " + case.label)
        testing.assert_close(lse, want_lse[0], atol=1e-9, name="lse " + case.label)


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
        heading = f"### Puzzle 10.{number}: {p.title}"
        at = src.index(heading) if heading in src else -1
        assert at > start[0], f"no heading {heading!r}"
        spec, stub, reveal, hidden = cells[at + 1:at + 5]
        assert "".join(spec["source"]).strip() == f'puzzles.get("{p.name}")'
        assert "raise NotImplementedError" in "".join(stub["source"])
        assert "".join(reveal["source"]).startswith("Solution (click to reveal)")
        assert "hide-cell" in hidden["metadata"].get("tags", [])
        assert f"serving_solutions.{p.name}" in "".join(hidden["source"])
