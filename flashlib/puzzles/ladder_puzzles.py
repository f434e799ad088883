"""The NumPy puzzles of chapters 1-6: their specs and their adversarial cases, checked in float64.

Every case is small and seeded. Together they cover what breaks FlashAttention code: lengths that are
multiples of no block, Nq != Nk both ways, N = 1, odd head dims, causal rows that see no key (their
output is 0 and their lse -inf, never NaN) and scores large enough that ``exp`` overflows unless the
maximum is subtracted first. Expected values come from :mod:`flashlib.testing` (the float64 oracle) or
from the definitions written out in float64 here.

Explained in: notebooks/01_naive_attention (and each chapter's Puzzles section).
"""
from __future__ import annotations

import copy
import functools

import numpy as np

from .. import testing
from ..ladder import fa1, softmax
from ..ladder.decoding import split_bounds
from ..ladder.masks import causal_mask
from .core import Case, Puzzle, WrongAnswer, as_numbers, split_outputs

__all__ = ["PUZZLES"]

SOL = "flashlib.puzzles.solutions:"
SHAPES = testing.ADVERSARIAL_SHAPES                               # (Nq, Nk, d)


# ---- the float64 oracle, written out ------------------------------------------------------------

def _label(nq, nk, d=None, causal=None, **more):
    parts = [f"Nq={nq}", f"Nk={nk}"] + ([f"d={d}"] if d is not None else [])
    parts += [f"{k}={v}" for k, v in more.items()]
    return ", ".join(parts + (["causal"] if causal else []))


def _qkv(nq, nk, d, seed, boost=1.0):
    q, k, v = testing.random_qkv(nq, nk, d, dv=max(1, d // 2 + 1), seed=seed)
    return boost * q, k, v


def _problems(seed, shapes=SHAPES, boost_at=None, boost=1.0):
    """``(n, causal, q, k, v)`` for each shape, without then with the causal mask; shape ``boost_at`` has
    its queries scaled by ``boost`` (scores in the hundreds: ``exp`` overflows without the max)."""
    for n, (nq, nk, d) in enumerate(shapes):
        for causal in (False, True):
            yield (n, causal, *_qkv(nq, nk, d, seed=seed + n, boost=boost if n == boost_at else 1.0))


def _case(q, k, v, causal, args, expected, **more):
    return Case(_label(len(q), len(k), q.shape[1], causal, **more), args, expected)


def _scores(q, k, causal):
    s = q.shape[1] ** -0.5 * q @ k.T                              # (Nq, Nk), float64
    return np.where(causal_mask(0, len(q), 0, len(k), len(q), len(k)), s, -np.inf) if causal else s


def _state(s):
    """Row-wise ``(m, l)``: ``m = max_j s_j`` and ``l = sum_j exp(s_j - m)``; ``(-inf, 0)`` for no key."""
    m = s.max(axis=-1, initial=-np.inf)
    l = softmax.safe_exp_diff(s, m[..., None]).sum(axis=-1)
    return m, l


def _partial(q, k, v, k0, k1, causal):
    """The normalized output and lse of q against keys ``k0 .. k1`` of k, under the global causal mask."""
    s = _scores(q, k, causal)[:, k0:k1]
    m, l = _state(s)
    o = softmax.divide_rows(softmax.safe_exp_diff(s, m[:, None]) @ v[k0:k1], l[:, None])
    return o, softmax.lse_from_state(m, l)


def _checked(got, names, shapes, step):
    """The outputs of one step of a fold, as float arrays of the given shapes, or WrongAnswer."""
    outputs, message = split_outputs(got, names)
    if message:
        raise WrongAnswer(f"{step} {message}")
    arrays = []
    for name, x, shape in zip(names, outputs, shapes):
        a, message = as_numbers(x, name)
        if message or a.shape != shape:
            raise WrongAnswer(f"{step} " + (message or f"{name} has shape {a.shape}, expected {shape}"))
        arrays.append(a.astype(np.float64))
    return arrays


# ---- chapter 1 ----------------------------------------------------------------------------------

@functools.cache
def _mask_cases():
    pairs = [(1, 1), (1, 6), (6, 1), (4, 4), (3, 8), (8, 3), (5, 2), (2, 5), (13, 7)]
    return [Case(_label(nq, nk), (nq, nk), causal_mask(0, nq, 0, nk, nq, nk)) for nq, nk in pairs]


@functools.cache
def _softmax_cases():
    rng = np.random.default_rng(1)
    some_masked = rng.standard_normal((4, 7))
    some_masked[rng.random((4, 7)) < 0.4] = -np.inf
    some_masked[:, 3] = 0.5                                       # every row keeps one entry
    empty_row = rng.standard_normal((3, 5))
    empty_row[1] = -np.inf                                        # a causal row that sees no key
    arrays = {"random (3, 5)": rng.standard_normal((3, 5)), "one column (4, 1)": rng.standard_normal((4, 1)),
              "one entry (1, 1)": np.array([[2.0]]),
              "large scores ~800 (2, 6)": 800 + 5 * rng.standard_normal((2, 6)),
              "some entries -inf (4, 7)": some_masked, "row 1 all -inf (3, 5)": empty_row}
    return [Case(label, (s,), softmax.safe_softmax(s)) for label, s in arrays.items()]


@functools.cache
def _attention_cases():
    return [_case(q, k, v, causal, (q, k, v, causal), testing.reference(q, k, v, causal=causal)[0])
            for n, causal, q, k, v in _problems(0)]


# ---- chapter 2 ----------------------------------------------------------------------------------

def _rows(seed):
    """Rows whose softmax states are hard: large values, -inf first, all -inf, increasing (max grows)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((6, 9))
    x[1] = 900 + 3 * rng.standard_normal(9)                       # exp(900) overflows float64
    x[2, :4] = -np.inf                                            # starts with keys it cannot see
    x[3] = -np.inf                                                # sees no key
    x[4] = np.arange(9) * 40.0                                    # a new maximum at every step
    x[5] = -np.arange(9) * 40.0                                   # the first maximum stays
    return x


@functools.cache
def _step_cases():
    x, rng = _rows(2), np.random.default_rng(4)
    holes = rng.standard_normal((3, 12))
    holes[rng.random((3, 12)) < 0.5] = -np.inf                    # -inf between finite scores
    arrays = {"1 row of 1": x[:1, :1], "4 rows of 20": rng.standard_normal((4, 20)),
              "3 rows of 12 with -inf between the scores": holes,
              "6 rows of 9: ~900, -inf first, all -inf, increasing, decreasing": x}
    return [Case(label, (a,), _state(a)) for label, a in arrays.items()]


def _fold_steps(fn, case):
    (x,) = case.args
    m, l = np.full(len(x), -np.inf), np.zeros(len(x))            # m_0 = -inf, l_0 = 0
    for j in range(x.shape[1]):
        got = fn(m.copy(), l.copy(), x[:, j].copy())
        m, l = _checked(got, ("m", "l"), ((len(x),), (len(x),)), f"after step {j + 1}:")
    return m, l


@functools.cache
def _merge_cases():
    x = _rows(3)
    x[0, 5:] = -np.inf                                            # part b of row 0 sees nothing
    x[5, :] = np.concatenate([np.zeros(4), 700 + np.arange(5.0)])  # part b's max is 700 above a's
    cases = []
    for c in (0, 1, 4, 8, 9):                                     # split before column c (0, 9: empty part)
        a, b = x[:, :c], x[:, c:]
        cases.append(Case(f"6 rows of 9 split at column {c}", (*_state(a), *_state(b)), _state(x)))
    return cases


@functools.cache
def _chunked_cases():
    chunks = (1, 16, 7, 16, 5, 64, 16, 32, 100)
    return [_case(q, k, v, causal, (q, k, v, causal, chunks[n]), testing.reference(q, k, v, causal=causal)[0],
                  chunk=chunks[n]) for n, causal, q, k, v in _problems(10, boost_at=3, boost=30.0)]


# ---- chapters 3 and 4: one tile at a time -------------------------------------------------------

@functools.cache
def _tile_problems():
    """(q, k, v, causal, block_k) with their full scores: tiles where rows see no key, huge scores."""
    return [(q, k, v, causal, 16 if len(k) > 16 else max(1, len(k) // 2))
            for n, causal, q, k, v in _problems(20, SHAPES[:7], boost_at=4, boost=40.0)]


def _tile_cases(expected):
    return [_case(q, k, v, causal, (q, k, v, causal, bk), expected(_scores(q, k, causal), v), block_k=bk)
            for q, k, v, causal, bk in _tile_problems()]


def _fold_tiles(fn, case):
    """Run the reader's tile update over the key blocks, all queries as one block, as Algorithm 1 does."""
    q, k, v, causal, bk = case.args
    s, nq, dv = _scores(q, k, causal), len(q), v.shape[1]
    o, l, m = np.zeros((nq, dv)), np.zeros((nq, 1)), np.full((nq, 1), -np.inf)
    for j in range(0, len(k), bk):
        got = fn(o.copy(), l.copy(), m.copy(), s[:, j:j + bk].copy(), v[j:j + bk].copy())
        o, l, m = _checked(got, ("o_i", "l_i", "m_i"), ((nq, dv), (nq, 1), (nq, 1)),
                           f"after key block {j // bk + 1} (keys {j}..{min(j + bk, len(k)) - 1}):")
    return o, l, m


def _fa1_expected(s, v):
    m, l = _state(s)
    return softmax.divide_rows(softmax.safe_exp_diff(s, m[:, None]) @ v, l[:, None]), l[:, None], m[:, None]


def _fa2_expected(s, v):
    m, l = _state(s)
    return softmax.safe_exp_diff(s, m[:, None]) @ v, l[:, None], m[:, None]


@functools.cache
def _block_size_cases():
    rows = [(49152, 64, 2), (65536, 128, 2), (196608, 64, 4), (1000, 7, 2), (16384, 3, 2),
            (4 * 59 * 2, 59, 2), (4 * 59 * 2 - 1, 59, 2), (256, 64, 2)]
    cases = []
    for sram, d, bpe in rows:
        label = f"sram_bytes={sram}, d={d}, bytes_per_element={bpe}"
        if sram // bpe < 4 * d:
            cases.append(Case(label, (sram, d, bpe), ValueError,
                              why=f"M = {sram // bpe} elements < 4d = {4 * d}: not one row of each tile fits"))
        else:
            cases.append(Case(label, (sram, d, bpe), functools.partial(_verify_blocks, sram // bpe, d,
                                                                       fa1.paper_block_sizes(sram, d, bpe))))
    return cases


def _verify_blocks(m, d, expected, got):
    outputs, message = split_outputs(got, ("Br", "Bc"))
    if message:
        return message
    for name, x in zip(("Br", "Bc"), outputs):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            return f"{name} must be an int, got {type(x).__name__} {x!r}"
    (br, bc), (want_br, want_bc) = outputs, expected
    if bc != want_bc:
        over = 2 * (br + bc) * d
        fits = f"; then K_j, V_j, Q_i, O_i need 2 (Br + Bc) d = {over} elements > M" if over > m else ""
        return f"Bc: expected {want_bc} = floor(M / 4d) with M = {m} elements, got {bc}{fits}"
    if br != want_br:
        return f"Br: expected {want_br} = min(Bc, d) = min({bc}, {d}), got {br}"
    return None


@functools.cache
def _hidden_cases():
    cases = []
    for nq in range(1, 6):
        for nk in range(1, 6):
            for br in (1, 2, 3):
                for q0 in range(0, nq, br):
                    q1 = min(q0 + br, nq)
                    for k0 in range(nk):
                        hidden = not causal_mask(q0, q1, k0, k0 + 1, nq, nk).any()
                        cases.append(Case(f"q0={q0}, q1={q1}, k0={k0}, Nq={nq}, Nk={nk}",
                                          (q0, q1, k0, nq, nk), np.bool_(hidden)))
    return cases


@functools.cache
def _finish_cases():
    cases = []
    for n, (nq, nk, d) in enumerate(SHAPES):
        causal = n % 2 == 1 or nq > nk                            # includes rows that see no key
        q, k, v = _qkv(nq, nk, d, seed=30 + n, boost=40.0 if n == 5 else 1.0)
        o_i, l_i, m_i = _fa2_expected(_scores(q, k, causal), v)
        cases.append(Case(_label(nq, nk, d, causal), (o_i, l_i, m_i), testing.reference(q, k, v, causal=causal)))
    return cases


@functools.cache
def _forward_cases():
    blocks = [(16, 8), (7, 16), (64, 64), (1, 3), (16, 16), (5, 40), (32, 16), (8, 64), (3, 1)]
    return [_case(q, k, v, causal, (q, k, v, causal, *blocks[n]), testing.reference(q, k, v, causal=causal),
                  block_q=blocks[n][0], block_k=blocks[n][1]) for n, causal, q, k, v in _problems(40)]


# ---- chapter 5 ----------------------------------------------------------------------------------

@functools.cache
def _backward_problems():
    out = []
    for n, causal, q, k, v in _problems(50, SHAPES[:8]):
        do = np.random.default_rng(60 + n).standard_normal((len(q), v.shape[1]))
        out.append((q, k, v, do, *testing.reference(q, k, v, causal=causal), causal))
    return out


def _p(q, k, causal):
    return softmax.safe_softmax(_scores(q, k, causal))            # (Nq, Nk); 0 on rows that see nothing


@functools.cache
def _d_cases():
    return [_case(q, k, v, causal, (do, o), (do * o).sum(axis=1))
            for q, k, v, do, o, lse, causal in _backward_problems()[::2]]


@functools.cache
def _ds_cases():
    cases = []
    for q, k, v, do, o, lse, causal in _backward_problems():
        p, dp, d_rows = _p(q, k, causal), do @ v.T, (do * o).sum(axis=1)
        cases.append(_case(q, k, v, causal, (p, dp, d_rows), p * (dp - d_rows[:, None])))
    return cases


@functools.cache
def _tile_backward_cases():
    cases = []
    for n, (q, k, v, do, o, lse, causal) in enumerate(_backward_problems()):
        br, bc = ((16, 8), (7, 16), (1, 1), (32, 5))[n % 4]
        cases.append(_case(q, k, v, causal, (q, k, v, do, o, lse, causal, br, bc),
                           testing.reference_backward(q, k, v, do, causal=causal), block_q=br, block_k=bc))
    return cases


def _fold_backward(fn, case):
    """Lines 5-18 of FA2's backward: every tile's contributions from the reader's function, summed."""
    q, k, v, do, o, lse, causal, br, bc = case.args
    nq, nk, scale = len(q), len(k), q.shape[1] ** -0.5
    d_rows, allowed = (do * o).sum(axis=1), causal_mask(0, nq, 0, nk, nq, nk) if causal else np.ones((nq, nk), bool)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for j in range(0, nk, bc):
        for i in range(0, nq, br):
            rows, cols = slice(i, i + br), slice(j, j + bc)
            args = (q[rows], k[cols], v[cols], do[rows], lse[rows], d_rows[rows], scale, allowed[rows, cols])
            got = fn(*copy.deepcopy(args))
            tile = _checked(got, ("dq_i", "dk_j", "dv_j"), (q[rows].shape, k[cols].shape, v[cols].shape),
                            f"tile (query block {i // br + 1}, key block {j // bc + 1}):")
            dq[rows] += tile[0]
            dk[cols] += tile[1]
            dv[cols] += tile[2]
    return dq, dk, dv


# ---- chapter 6 ----------------------------------------------------------------------------------

@functools.cache
def _bounds_cases():
    pairs = [(1, 1), (1, 3), (7, 3), (8, 4), (100, 7), (5, 5), (3, 8), (1000, 13), (257, 2)]
    return [Case(f"nk={nk}, num_splits={s}", (nk, s), functools.partial(_verify_bounds, nk, s)) for nk, s in pairs]


def _verify_bounds(nk, num_splits, got):
    b, message = as_numbers(got, "the bounds")
    if message:
        return message
    if b.shape != (num_splits, 2) or b.dtype.kind not in "iu":
        return f"expected {num_splits} (start, stop) pairs of ints, got an array of shape {b.shape}, dtype {b.dtype}"
    if b[0, 0] != 0 or b[-1, 1] != nk:
        return f"the splits must cover keys 0 .. {nk}: they start at {b[0, 0]} and stop at {b[-1, 1]}"
    gaps = np.nonzero(b[1:, 0] != b[:-1, 1])[0]
    if gaps.size:
        s = int(gaps[0])
        return f"split {s} stops at {b[s, 1]} but split {s + 1} starts at {b[s + 1, 0]}: not contiguous"
    sizes = b[:, 1] - b[:, 0]
    if sizes.min() < 0 or sizes.max() - sizes.min() > 1:
        return f"split sizes {sizes.tolist()} differ by more than one key (or are negative)"
    return None


@functools.cache
def _split_problems():
    """(q, k, v, causal, num_splits): decoding (Nq = 1), several queries with a causal mask, huge scores."""
    rng = np.random.default_rng(70)
    out = []
    for nq, nk, d, causal, splits, boost in [(1, 37, 16, False, 4, 1.0), (1, 40, 8, True, 3, 1.0),
                                             (3, 17, 9, True, 4, 1.0), (5, 3, 8, True, 5, 1.0),
                                             (4, 64, 16, False, 6, 300.0), (2, 9, 5, True, 2, 300.0),
                                             (6, 2, 4, True, 3, 1.0)]:
        q, k, v = _qkv(nq, nk, d, seed=int(rng.integers(1000)), boost=boost)
        out.append((q, k, v, causal, splits))
    return out


@functools.cache
def _partial_cases():
    cases = []
    for q, k, v, causal, splits in _split_problems():
        for k0, k1 in split_bounds(len(k), splits):
            cases.append(_case(q, k, v, causal, (q, k[k0:k1], v[k0:k1], k0, len(k), causal),
                               _partial(q, k, v, k0, k1, causal), keys=f"{k0}..{k1 - 1}" if k1 > k0 else "none"))
    return cases


@functools.cache
def _combine_cases():
    cases = []
    for q, k, v, causal, splits in _split_problems():
        parts = [_partial(q, k, v, k0, k1, causal) for k0, k1 in split_bounds(len(k), splits)]
        o_parts, lse_parts = np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts])
        cases.append(_case(q, k, v, causal, (o_parts, lse_parts), testing.reference(q, k, v, causal=causal),
                           splits=splits))
    return cases


# ---- the registry -------------------------------------------------------------------------------

def _puzzle(name, chapter, title, spec, signature, outputs, cases, **kw):
    # short enough that the checker's line fits the book's 80 columns
    kw.setdefault("not_attempted_hint", "the stub raises NotImplementedError")
    return Puzzle(name=name, chapter=f"notebooks/{chapter}", title=title, spec=" ".join(spec.split()),
                  signature=signature, outputs=outputs, cases=lambda: list(cases()), solution_ref=SOL + name, **kw)


C1, C2, C3 = "01_naive_attention", "02_online_softmax", "03_flashattention1"
C4, C5, C6 = "04_flashattention2", "05_backward", "06_flash_decoding"

PUZZLES = [
    _puzzle("causal_mask", C1, "The causal mask, bottom-right aligned", """
        Return a boolean array of shape `(nq, nk)`, True where query `i` may see key `j`. The mask is aligned
        to the bottom-right corner: query `i` sees key `j` if and only if `j <= i + nk - nq`, so the last
        query sees every key. When `nq > nk` the first `nq - nk` queries see no key at all.""",
            "causal_mask(nq, nk) -> mask (nq, nk) bool", ("mask",), _mask_cases),
    _puzzle("softmax_rows", C1, "A softmax that survives large scores and empty rows", """
        Return the softmax of each row of the float64 array `s` of shape `(rows, n)`. Some scores are about
        800, and `exp(800)` overflows, so subtract each row's maximum first. A row whose entries are all
        `-inf` is a query that sees no key: its softmax is all zeros, not NaN.""",
            "softmax_rows(s) -> p (rows, n)", ("p",), _softmax_cases),
    _puzzle("naive_attention", C1, "Attention, the standard way", """
        Given one head's `q (Nq, d)`, `k (Nk, d)` and `v (Nk, dv)`, return `softmax(tau q k^T) v` with
        `tau = d ** -0.5`. When `causal` is true, use the bottom-right causal mask. A row that sees no key
        outputs zeros. The checker uses Nq != Nk both ways, N = 1 and odd head dims.""",
            "naive_attention(q, k, v, causal) -> o (Nq, dv)", ("o",), _attention_cases),
    _puzzle("online_step", C2, "One step of the online softmax", """
        Each row keeps a state `(m, l)`: `m` is the largest score seen so far and `l` is the sum of
        `exp(x - m)` over the scores seen so far. Fold the next score `x` of every row into that state and
        return the new `(m, l)`. The arrays have shape `(rows,)`, and the checker starts from
        `m = -inf, l = 0`. Whenever `m` grows, the old `l` must be rescaled. A row that has seen only
        `-inf` keeps `(-inf, 0)`: `exp(-inf - (-inf))` is NaN, so never compute it.""",
            "online_step(m, l, x) -> (m, l)", ("m", "l"), _step_cases, call=_fold_steps),
    _puzzle("merge_states", C2, "Merge two softmax states", """
        `(m_a, l_a)` and `(m_b, l_b)` are the states, with shapes `(rows,)`, of two disjoint parts of the same
        rows. Return the state of the whole rows: the larger maximum, and both sums rescaled to it. An
        empty part has the state `(-inf, 0)`. Its maximum can be hundreds below the other part's.""",
            "merge_states(m_a, l_a, m_b, l_b) -> (m, l)", ("m", "l"), _merge_cases),
    _puzzle("chunked_attention", C2, "Attention without an N x N matrix", """
        Compute the same output as `naive_attention(q, k, v, causal)`, but look at only `chunk` keys at a
        time. Keep a running state per query: `m`, `l` and the accumulator `acc = sum exp(s - m) v`, and
        rescale all three when `m` grows. Never build the `(Nq, Nk)` score matrix. The last chunk may be
        shorter than the others, and one case has scores in the thousands.""",
            "chunked_attention(q, k, v, causal, chunk) -> o (Nq, dv)", ("o",), _chunked_cases),
    _puzzle("fa1_update", C3, "FlashAttention-1's inner-loop update", """
        This is lines 10-12 of Algorithm 1. `o_i (Br, dv)` is the *normalized* output so far, and
        `l_i, m_i (Br, 1)` are its sum and maximum. `s_ij (Br, Bc)` is the next tile of scores, already
        scaled and masked (`-inf` where a key is hidden), and `v_j (Bc, dv)` is its values. Return the
        updated `(o_i, l_i, m_i)`, with `o_i` still normalized. The checker folds your update over all the key
        blocks. Some tile rows are all `-inf`, so keep them free of NaN.""",
            "fa1_update(o_i, l_i, m_i, s_ij, v_j) -> (o_i, l_i, m_i)", ("o_i", "l_i", "m_i"),
            lambda: _tile_cases(_fa1_expected), call=_fold_tiles),
    _puzzle("block_sizes", C3, "Block sizes for an SRAM budget", """
        An SRAM of `sram_bytes` holds `M = sram_bytes // bytes_per_element` elements. Return Algorithm 1's
        block sizes `(Br, Bc)` as ints: `Bc = floor(M / 4d)` and `Br = min(Bc, d)`. Rounding down keeps the
        four tiles `K_j, V_j (Bc x d)` and `Q_i, O_i (Br x d)` within M. When `M < 4d`, not even one row of
        each tile fits: raise ValueError.""",
            "block_sizes(sram_bytes, d, bytes_per_element) -> (Br, Bc)", ("Br", "Bc"), _block_size_cases),
    _puzzle("block_hidden", C3, "Which key blocks can a causal kernel skip?", """
        Queries `q0 .. q1 - 1` of `nq` and the keys from `k0` on of `nk` form a block. Return True if the
        bottom-right causal mask hides every one of those keys from every one of those queries, so the
        kernel can skip the block (and every later one). Return False if any query sees any key from `k0`
        on. The checker tries every small case.""",
            "block_hidden(q0, q1, k0, nq, nk) -> bool", ("hidden",), _hidden_cases),
    _puzzle("fa2_step", C4, "FlashAttention-2's step: rescale, don't divide", """
        Lines 9-10 of FA2's Algorithm 1. Same arguments as `fa1_update`, but `o_i (Br, dv)` is *unnormalized*:
        `o_i = sum_j exp(s_j - m_i) v_j`. Return the updated `(o_i, l_i, m_i)` without dividing by `l`.
        FA2 divides once, at the end, which saves one `(Br, dv)` division per tile. Rows that have seen
        only `-inf` must stay `(0, 0, -inf)`.""",
            "fa2_step(o_i, l_i, m_i, s_ij, v_j) -> (o_i, l_i, m_i)", ("o_i", "l_i", "m_i"),
            lambda: _tile_cases(_fa2_expected), call=_fold_tiles),
    _puzzle("fa2_finish", C4, "FlashAttention-2's finish: normalize once, save the lse", """
        Lines 12-13. After the last key block, `o_i (Br, dv)` is unnormalized, and `l_i, m_i` have shape
        `(Br, 1)`. Return `o = o_i / l_i` and `lse = m_i + log(l_i)`, with `lse` of shape `(Br,)`. A row
        with `l_i = 0` saw no key: its output is 0 and its lse is `-inf`, never NaN.""",
            "fa2_finish(o_i, l_i, m_i) -> (o, lse)", ("o", "lse"), _finish_cases),
    _puzzle("fa2_forward", C4, "The whole FlashAttention-2 forward", """
        Return `(o, lse)` for one head, with the loops of FA2: the outer loop runs over query blocks of
        `block_q`, the inner loop over key blocks of `block_k`. Use a bottom-right causal mask when `causal`
        is true, and stop the inner loop at the first block that the mask hides entirely. The block sizes
        divide none of the lengths, and some are larger than a whole sequence.""",
            "fa2_forward(q, k, v, causal, block_q, block_k) -> (o, lse)", ("o", "lse"), _forward_cases),
    _puzzle("rowsum_d", C5, "The D term", """
        Return `D = rowsum(dO * O)` with shape `(Nq,)`, given `do` and `o` of shape `(Nq, dv)`. It equals
        `rowsum(P * dP)`, which is what the softmax's Jacobian needs, and it costs one pass over `O`
        instead of the `(Nq, Nk)` matrix `P`.""",
            "rowsum_d(do, o) -> D (Nq,)", ("D",), _d_cases),
    _puzzle("ds_tile", C5, "The gradient of the scores", """
        Given `p` and `dp = dO V^T` of shape `(Br, Bc)` and `d_rows = D (Br,)`, return
        `dS = P * (dP - D)`, with D broadcast along each row. Rows that see no key have `P = 0`, so their
        `dS` is 0.""",
            "ds_tile(p, dp, d_rows) -> ds (Br, Bc)", ("ds",), _ds_cases),
    _puzzle("backward_tile", C5, "One tile of FlashAttention-2's backward", """
        Lines 10-16 of FA2's Algorithm 2, for one tile. Recompute `S = scale q_i k_j^T` and set it to `-inf`
        where `mask (Br, Bc)` is False. Then compute `P = exp(S - lse_i)`, `dP = dO_i v_j^T` and
        `dS = P * (dP - d_i)`. Return this tile's contributions `(dq_i = scale dS k_j,
        dk_j = scale dS^T q_i, dv_j = P^T dO_i)`. The checker adds them up over every tile. A row that sees
        no key has `lse_i = -inf`, and `exp(-inf - (-inf))` is NaN: its `P` must be 0.""",
            "backward_tile(q_i, k_j, v_j, do_i, lse_i, d_i, scale, mask) -> (dq_i, dk_j, dv_j)",
            ("dq", "dk", "dv"), _tile_backward_cases, call=_fold_backward),
    _puzzle("split_bounds", C6, "Split the keys", """
        Return `num_splits` key ranges `[(start, stop), ...]` as ints. They must be contiguous, cover keys
        `0 .. nk` exactly and differ in size by at most one key. Some ranges are empty when
        `num_splits > nk`.""",
            "split_bounds(nk, num_splits) -> [(start, stop), ...]", ("bounds",), _bounds_cases),
    _puzzle("split_partial", C6, "One split's partial attention", """
        Attend `q (Nq, d)` to one split: keys `k0 .. k0 + len(k_s) - 1` of `nk`, given as `k_s` and `v_s`.
        Return the split's normalized output `o_s (Nq, dv)` and its `lse_s (Nq,)`. The causal mask is
        bottom-right for the *whole* sequence, so use the global key index `k0 + j`, not `j`. A row that
        sees none of the split's keys, or an empty split, gives `o_s = 0` and `lse_s = -inf`.""",
            "split_partial(q, k_s, v_s, k0, nk, causal) -> (o_s, lse_s)", ("o_s", "lse_s"), _partial_cases),
    _puzzle("combine_splits", C6, "Combine the splits", """
        Given the splits' normalized outputs `o_parts (S, Nq, dv)` and their `lse_parts (S, Nq)`, return the
        attention over all the keys: `lse = log sum_s exp(lse_s)` and `o = sum_s exp(lse_s - lse) o_s`.
        Some lse are near 1000, where `exp` overflows, so subtract the maximum first. A split, or all of
        them, can be empty (`lse = -inf`).""",
            "combine_splits(o_parts, lse_parts) -> (o, lse)", ("o", "lse"), _combine_cases),
]
