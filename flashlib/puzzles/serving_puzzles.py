"""The NumPy puzzles of chapter 10 (serving): their specs and their adversarial cases.

Four small pieces of a serving engine, each checked exactly or in float64: the prefix sums that pack a
ragged batch (``cu_seqlens``, int32, from 0), the translation of a sequence's logical tokens to rows of
a paged cache through its block table, the merge of two attention states ``(o, lse)`` with empty ones,
and causal attention over a packed batch, where the causal offset is each sequence's own. The cases
cover empty sequences and batches, length 1, page sizes 1, 3, 16 and 256, shuffled and shared pages,
table entries past a sequence's length that are garbage (and must not be read), states that are both
empty, scores large enough that ``exp`` overflows, and sequences with more queries than keys. Expected
values come from :mod:`flashlib.testing` (the float64 oracle, one sequence at a time) or from the
definitions written out here.

Explained in: notebooks/10_serving.
"""
from __future__ import annotations

import functools

import numpy as np

from .. import testing
from .core import Case, Puzzle

__all__ = ["PUZZLES"]

SOL = "flashlib.puzzles.serving_solutions:"
GARBAGE = 10 ** 6            # a block-table entry past the length: no page


# ---- puzzle 10.1: cu_seqlens --------------------------------------------------------------------

_LENGTHS = [[3, 1, 4], [5], [1, 1, 1, 1], [0, 0, 5], [7, 0, 0, 2], [0], [], [2, 0],
            [1000, 1, 30000, 17]]


def _verify_cu(lengths, got):
    want = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)
    if type(got).__module__.startswith("torch"):
        got = got.detach().cpu().numpy()
    if not isinstance(got, np.ndarray):
        return f"returned {type(got).__name__}, expected a NumPy array of dtype int32"
    if got.dtype != np.int32:
        return f"cu_seqlens has dtype {got.dtype}, expected int32 (kernels read 32-bit offsets)"
    if got.shape != want.shape:
        return f"cu_seqlens has shape {got.shape}, expected {want.shape} (B + 1 entries, from 0)"
    bad = np.flatnonzero(got != want)
    if bad.size:
        i = int(bad[0])
        return f"cu_seqlens[{i}] is {int(got[i])}, expected {int(want[i])}"
    return None


@functools.cache
def _cu_cases():
    return [Case(f"lengths={lens}", (list(lens),), functools.partial(_verify_cu, lens))
            for lens in _LENGTHS]


# ---- puzzle 10.2: a paged cache, read in logical order --------------------------------------------

# (num_pages, page_size, lengths, table kind): page sizes 1, 3, 16, 256; lengths no page divides and
# lengths that fill their last page exactly (the next entry is garbage); a sequence of length 0.
_PAGED_PROBLEMS = [
    (12, 1, [5, 3], "shuffled"), (9, 3, [7, 6, 1], "shuffled"), (4, 16, [16, 17], "shuffled"),
    (3, 256, [300, 1], "shuffled"), (6, 4, [9, 9], "shared"), (5, 2, [0, 4], "shuffled"),
    (7, 5, [10, 3, 0], "shared"),
]


def _paged_problem(n, num_pages, size, lengths, kind):
    """A cache of distinct values, a table whose unused entries are garbage."""
    rng = np.random.default_rng(700 + n)
    k_cache = rng.standard_normal((num_pages, size, 2, 3))
    need = [-(-ln // size) for ln in lengths]
    width = max(need) + 1
    table = np.full((len(lengths), width), GARBAGE, dtype=np.int32)
    free = list(rng.permutation(num_pages))
    if kind == "shared":                     # every sequence starts with the same first page
        first = free.pop()
        for b, m in enumerate(need):
            if m:
                table[b, 0] = first
    for b, m in enumerate(need):
        for p in range(1 if kind == "shared" and m else 0, m):
            table[b, p] = free.pop()
    return k_cache, table


def _gather(k_cache, table, b, n):
    """The definition: token t of sequence b is row t % P of page table[b, t // P]."""
    size = k_cache.shape[1]
    rows = [k_cache[table[b, t // size], t % size] for t in range(n)]
    return np.stack(rows) if rows else np.zeros((0, *k_cache.shape[2:]))


@functools.cache
def _paged_cases():
    cases = []
    for n, (num_pages, size, lengths, kind) in enumerate(_PAGED_PROBLEMS):
        k_cache, table = _paged_problem(n, num_pages, size, lengths, kind)
        for b, ln in enumerate(lengths):
            label = (f"page_size={size}, {kind} table, sequence {b} of lengths {lengths}")
            cases.append(Case(label, (k_cache, table, b, ln), _gather(k_cache, table, b, ln)))
    return cases


# ---- puzzle 10.3: merge two attention states ------------------------------------------------------

# (H, N, d, split, boost, empty): keys 0 .. nk-1 split at `split`; scores near 1000 with boost; one
# side or both sides empty (-inf) on some rows.
_MERGE_PROBLEMS = [
    (1, 1, 1, 3, 1.0, None), (2, 5, 4, 1, 1.0, None), (3, 4, 8, 6, 1000.0, None),
    (2, 6, 3, 4, 1.0, "a"), (2, 6, 3, 4, 1.0, "b"), (1, 4, 5, 2, 1.0, "both"),
    (2, 5, 4, 3, 1000.0, "mixed"),
]


def _state(q, k, v):
    """(o, lse) of q against k (float64, one head); no key: (0, -inf)."""
    if len(k) == 0:
        return np.zeros((len(q), v.shape[1])), np.full(len(q), -np.inf)
    return testing.reference(q, k, v)


@functools.cache
def _merge_cases():
    cases = []
    for n, (heads, nq, d, split, boost, empty) in enumerate(_MERGE_PROBLEMS):
        nk = split + 3
        o_a, l_a, o_b, l_b, o, lse = ([] for _ in range(6))
        for h in range(heads):
            q, k, v = testing.random_qkv(nq, nk, d, dv=3, seed=800 + 10 * n + h)
            q = boost * q
            sa, sb = _state(q, k[:split], v[:split]), _state(q, k[split:], v[split:])
            whole = _state(q, k, v)
            if empty in ("a", "both"):
                sa = _state(q, k[:0], v[:0])
                whole = sb if empty == "a" else sa
            if empty in ("b", "both"):
                sb = _state(q, k[:0], v[:0])
                whole = sa
            if empty == "mixed":             # row 0: both empty; row 1: only b
                for arr in (sa[0], sb[0]):
                    arr[0] = 0.0
                sa[1][0], sb[1][0] = -np.inf, -np.inf
                sb[0][1], sb[1][1] = 0.0, -np.inf
                whole = (whole[0].copy(), whole[1].copy())
                whole[0][0], whole[1][0] = 0.0, -np.inf
                whole[0][1], whole[1][1] = sa[0][1], sa[1][1]
            for lst, val in zip((o_a, l_a, o_b, l_b, o, lse), (*sa, *sb, *whole)):
                lst.append(val)
        args = tuple(np.stack(x) for x in (o_a, l_a, o_b, l_b))
        label = f"H={heads}, N={nq}, d={d}" + (", huge scores" if boost > 1 else "")
        label += {None: "", "a": ", state a empty", "b": ", state b empty",
                  "both": ", both empty", "mixed": ", rows both empty / one empty"}[empty]
        cases.append(Case(label, args, (np.stack(o), np.stack(lse))))
    return cases


# ---- puzzle 10.4: causal attention over a packed batch --------------------------------------------

# (lengths_q, lengths_k, d, boost): Nq < Nk (decode, chunked prefill), Nq = Nk (prefill), Nq > Nk
# (rows that see no key), empty sequences both ways, length 1, scores near 1000.
_VARLEN_PROBLEMS = [
    ([3], [3], 4, 1.0), ([1, 1, 1], [5, 1, 9], 8, 1.0), ([4, 2, 3], [4, 7, 3], 5, 1.0),
    ([0, 3, 2], [4, 3, 0], 3, 1.0), ([5, 1], [2, 1], 6, 1.0), ([2, 4], [6, 4], 16, 1000.0),
    ([1, 0, 6, 2], [1, 3, 6, 9], 7, 1.0),
]


def _varlen_expected(q, k, v, cu_q, cu_k):
    o = np.zeros((len(q), v.shape[1]))
    lse = np.full(len(q), -np.inf)
    for b in range(len(cu_q) - 1):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if cu_q[b + 1] > cu_q[b] and cu_k[b + 1] > cu_k[b]:
            o[rq], lse[rq] = testing.reference(q[rq], k[rk], v[rk], causal=True)
    return o, lse


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@functools.cache
def _varlen_cases():
    cases = []
    for n, (lq, lk, d, boost) in enumerate(_VARLEN_PROBLEMS):
        rng = np.random.default_rng(900 + n)
        q = boost * rng.standard_normal((sum(lq), d))
        k, v = rng.standard_normal((sum(lk), d)), rng.standard_normal((sum(lk), 3))
        cu_q, cu_k = _cu(lq), _cu(lk)
        label = f"lengths q={lq}, k={lk}, d={d}" + (", huge scores" if boost > 1 else "")
        cases.append(Case(label, (q, k, v, cu_q, cu_k), _varlen_expected(q, k, v, cu_q, cu_k)))
    return cases


# ---- the registry ---------------------------------------------------------------------------------

def _puzzle(name, title, spec, signature, outputs, cases, **kw):
    # the default hint is short, so that the checker's line fits the book's 80 columns
    kw.setdefault("not_attempted_hint", "the stub raises NotImplementedError")
    return Puzzle(name=name, chapter="notebooks/10_serving", title=title, spec=" ".join(spec.split()),
                  signature=signature, outputs=outputs, cases=lambda: list(cases()), solution_ref=SOL + name,
                  **kw)


PUZZLES = [
    _puzzle("cu_seqlens", "Pack a ragged batch: cu_seqlens from lengths", """
        A packed batch stores its sequences end to end, token after token, and a kernel finds sequence
        `b` at rows `cu[b]` to `cu[b + 1] - 1`. Given the `lengths` of `B` sequences (a list of ints,
        zeros allowed), return `cu`, a NumPy array of `B + 1` offsets of dtype int32 starting at 0,
        where `cu[b + 1] - cu[b]` is the length of sequence `b`. An empty batch gives `[0]`.""",
            "cu_seqlens(lengths) -> cu", ("cu",), _cu_cases),
    _puzzle("paged_gather", "Where token t lives: read a sequence from a paged cache", """
        A paged cache `k_cache (num_pages, page_size, Hkv, d)` stores every sequence in fixed-size
        pages, and `block_table (B, max_pages)` lists sequence `b`'s pages in logical order. Return
        the keys of sequence `b`'s first `n` tokens in order, an array `(n, Hkv, d)`: token `t` lives
        in page `block_table[b, t // page_size]`, row `t % page_size`. Entries of the table past the
        `n` tokens are garbage (a page number far too large): do not read them. The checker tries
        page sizes 1, 3, 16 and 256, shuffled tables and a page shared by several sequences.""",
            "paged_gather(k_cache, block_table, b, n) -> keys", ("keys",), _paged_cases),
    _puzzle("merge_attention", "Merge two attention states, empty ones included", """
        An attention state is the pair `(o, lse)` that attending to a set of keys leaves: the
        normalised output `o (H, N, dv)` and the log-sum-exp `lse (H, N)` of the scores. Given the
        states of the same queries over two disjoint key sets, return the state over their union:
        `lse = log(exp(lse_a) + exp(lse_b))` and `o` the two outputs weighted by `exp(lse_a - lse)`
        and `exp(lse_b - lse)`. A state over no key has `o = 0` and `lse = -inf`; when both are
        empty the result is `o = 0` and `lse = -inf`, never NaN. Scores near 1000 overflow `exp`
        unless you subtract the larger lse first.""",
            "merge_attention(o_a, lse_a, o_b, lse_b) -> (o, lse)", ("o", "lse"),
            _merge_cases, atol=1e-9, rtol=1e-9),
    _puzzle("varlen_causal", "Causal per sequence: attention over a packed batch", """
        `q (total_q, d)` and `k (total_k, d)`, `v (total_k, dv)` pack a batch of sequences end to
        end, sequence `b` at rows `cu_q[b]` to `cu_q[b + 1] - 1` of `q` and `cu_k[b]` to
        `cu_k[b + 1] - 1` of `k` and `v` (one head). Return `o (total_q, dv)` and `lse (total_q,)`
        of causal attention with scale `d ** -0.5`, where each sequence attends only to its own
        keys and the causal mask is bottom-right aligned per sequence: with `nq` queries and `nk`
        keys, query `i` sees key `j` iff `j <= i + nk - nq`. A row that sees no key (a sequence with
        no key, or more queries than keys) has `o = 0` and `lse = -inf`.""",
            "varlen_causal(q, k, v, cu_q, cu_k) -> (o, lse)", ("o", "lse"), _varlen_cases,
            atol=1e-9, rtol=1e-9),
]
