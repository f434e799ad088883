"""The NumPy puzzles of chapter 9 (what real models change): their specs and their adversarial cases.

Three small pieces of the variants, each checked in float64: the classification of a tile of the score
matrix under a causal mask and a sliding window (full, partial or empty: what a kernel visits, masks or
skips), ALiBi under a causal mask computed with the shift-invariant bias ``+slope * j`` and its lse
corrected, and an attention sink merged into a finished row as a state with no value. The cases cover
Nq != Nk both ways (the bottom-right offset), windows wider than the sequence and windows that leave
rows with no key, lengths no block divides, slopes and sinks large enough that ``exp`` overflows unless
the maximum is subtracted first. Expected values come from :mod:`flashlib.testing` (the float64 oracle)
or from the mask's definition written out here.

Explained in: notebooks/09_real_models.
"""
from __future__ import annotations

import functools

from .. import testing
from .core import Case, Puzzle


__all__ = ["PUZZLES"]

SOL = "flashlib.puzzles.variant_solutions:"
KINDS = ("full", "partial", "empty")


# ---- the mask, written out ------------------------------------------------------------------------

def _band(nq, nk, causal, window):
    """Boolean ``(nq, nk)``: query i sees key j (flash-attn's rule, bottom-right aligned), as the
    float64 oracle applies it (written once there, apart from the ladder's masks)."""
    from ..testing import _visible
    return _visible(nq, nk, causal, window)


def _mask_label(nq, nk, causal, window):
    return f"Nq={nq}, Nk={nk}, window={tuple(window)}" + (", causal" if causal else "")


# ---- puzzle 9.1: classify a tile ------------------------------------------------------------------

# (Nq, Nk, block_q, block_k, causal, window): Nq != Nk both ways, blocks that divide nothing, a window
# of one key, windows wider than the sequence, rows that see nothing (window (0, 0) with Nq > Nk).
_TILE_PROBLEMS = [
    (9, 9, 3, 3, True, (-1, -1)), (6, 11, 4, 3, True, (-1, -1)), (11, 6, 3, 4, True, (-1, -1)),
    (10, 10, 4, 3, False, (2, 2)), (7, 12, 3, 5, False, (1, 3)), (12, 7, 5, 2, False, (0, 0)),
    (10, 10, 3, 4, True, (3, -1)), (9, 14, 4, 4, True, (2, 0)), (14, 5, 4, 2, True, (1, -1)),
    (8, 8, 8, 8, False, (20, 20)), (5, 9, 2, 3, False, (-1, 0)), (9, 5, 3, 2, False, (-1, 1)),
    (1, 1, 1, 1, True, (0, 0)), (6, 6, 1, 6, False, (0, 1)), (4, 13, 4, 13, True, (30, -1)),
]


@functools.cache
def _tile_cases():
    cases = []
    for nq, nk, bq, bk, causal, window in _TILE_PROBLEMS:
        seen = _band(nq, nk, causal, window)
        for q0 in range(0, nq, bq):
            for k0 in range(0, nk, bk):
                q1, k1 = min(q0 + bq, nq), min(k0 + bk, nk)
                tile = seen[q0:q1, k0:k1]
                kind = "full" if tile.all() else "partial" if tile.any() else "empty"
                label = f"{_mask_label(nq, nk, causal, window)}, rows {q0}..{q1 - 1}, keys {k0}..{k1 - 1}"
                cases.append(Case(label, (q0, q1, k0, k1, nq, nk, causal, tuple(window)),
                                  functools.partial(_verify_kind, kind, tile)))
    return cases


def _verify_kind(kind, tile, got):
    if not isinstance(got, str) or got not in KINDS:
        return f"returned {got!r:.40}, expected one of {KINDS}"
    if got == kind:
        return None
    seen, total = int(tile.sum()), tile.size
    return f"expected {kind!r} ({seen} of the tile's {total} pairs are visible), got {got!r}"


# ---- puzzle 9.2: ALiBi under a causal mask --------------------------------------------------------

# (Nq, Nk, d, slope): Nq != Nk both ways (rows that see no key when Nq > Nk), N = 1, slopes up to 8:
# with 257 keys the bias spans 2000, and exp(slope * j) overflows float64 unless the max is subtracted.
_ALIBI_PROBLEMS = [
    (1, 1, 1, 0.5), (1, 37, 40, 0.25), (37, 1, 59, 1.0), (17, 45, 40, 0.0625), (45, 17, 59, 0.5),
    (33, 33, 111, 2.0 ** -8), (3, 257, 8, 8.0), (70, 130, 16, 4.0),
]


@functools.cache
def _alibi_cases():
    cases = []
    for n, (nq, nk, d, slope) in enumerate(_ALIBI_PROBLEMS):
        q, k, v = testing.random_qkv(nq, nk, d, dv=max(1, d // 2 + 1), seed=90 + n)
        expected = testing.reference(q, k, v, causal=True, alibi_slopes=slope)
        cases.append(Case(f"Nq={nq}, Nk={nk}, d={d}, slope={slope:g}", (q, k, v, slope), expected))
    return cases


# ---- puzzle 9.3: merge a sink ----------------------------------------------------------------------

# (Nq, Nk, d, causal, boost, sink): rows with lse = -inf (causal, Nq > Nk), scores near 800, sinks far
# above and far below the rows' lse (exp(1000) overflows), a sink of 0.
_SINK_PROBLEMS = [
    (4, 9, 8, False, 1.0, 0.0), (9, 4, 8, True, 1.0, 1.5), (1, 1, 1, False, 1.0, -3.0),
    (5, 17, 16, True, 1.0, 1000.0), (6, 6, 4, False, 300.0, 2.0), (7, 3, 5, True, 300.0, 900.0),
    (3, 12, 6, False, 1.0, -1000.0),
]


@functools.cache
def _sink_cases():
    cases = []
    for n, (nq, nk, d, causal, boost, sink) in enumerate(_SINK_PROBLEMS):
        q, k, v = testing.random_qkv(nq, nk, d, dv=3, seed=110 + n)
        q = boost * q
        o, lse = testing.reference(q, k, v, causal=causal)
        expected = testing.reference(q, k, v, causal=causal, sinks=sink)
        label = f"Nq={nq}, Nk={nk}, sink={sink:g}" + (", scores ~800" if boost > 1 else "")
        cases.append(Case(label + (", causal" if causal else ""), (o, lse, sink), expected))
    return cases


# ---- the registry ---------------------------------------------------------------------------------

def _puzzle(name, title, spec, signature, outputs, cases, **kw):
    # the default hint is short, so that the checker's line fits the book's 80 columns
    kw.setdefault("not_attempted_hint", "the stub raises NotImplementedError")
    return Puzzle(name=name, chapter="notebooks/09_real_models", title=title, spec=" ".join(spec.split()),
                  signature=signature, outputs=outputs, cases=lambda: list(cases()), solution_ref=SOL + name,
                  **kw)


PUZZLES = [
    _puzzle("tile_class", "Full, partial or empty?", """
        Queries `q0 .. q1 - 1` of `nq` and keys `k0 .. k1 - 1` of `nk` form a tile of the score matrix.
        Query `i` sees key `j` when the causal mask (if `causal`) and the window `(left, right)` both let
        it: with `c = i + nk - nq`, the causal mask needs `j <= c` and the window needs
        `c - left <= j <= c + right`, where `-1` leaves that side unbounded. Return `"full"` if every query
        of the tile sees every key of the tile (no mask to apply), `"empty"` if no query sees any of them
        (skip the tile) and `"partial"` otherwise. A kernel decides without building the tile's mask:
        the band's edges are straight lines, so two corners of the tile decide (which two?). The checker
        tries every tile of many small grids.""",
            "tile_class(q0, q1, k0, k1, nq, nk, causal, window) -> kind", ("kind",), _tile_cases),
    _puzzle("alibi_causal", "ALiBi under a causal mask, by shift invariance", """
        ALiBi adds `-slope * |c - j|` to the scaled score of query `i` and key `j`, with `c = i + nk - nq`.
        Under the causal mask `j <= c`, so the bias is `slope * j - slope * c`, and the row constant
        `slope * c` cancels in the softmax. Return `(o, lse)` of causal attention with ALiBi for one head,
        `q (Nq, d)`, `k (Nk, d)`, `v (Nk, dv)`, scale `d ** -0.5`, using the bias `slope * j` only, then
        correct `lse (Nq,)` so that it is the log-sum-exp of the true ALiBi scores. Rows that see no key
        give `o = 0` and `lse = -inf`. With 257 keys and a slope of 8, `exp(slope * j)` overflows unless
        you subtract each row's maximum.""",
            "alibi_causal(q, k, v, slope) -> (o, lse)", ("o", "lse"), _alibi_cases),
    _puzzle("sink_merge", "A sink is a state with no value", """
        `o (Nq, dv)` and `lse (Nq,)` are a finished attention row block, normalised over its keys. An
        attention sink adds `exp(sink)` to every row's softmax denominator but brings no value vector.
        Treat it as one more softmax state, with log-sum-exp `sink` and output 0, and merge it as the
        combine of chapter 6 merges splits. Return the new `(o, lse)`. A row that saw no key
        (`lse = -inf`) gets `o = 0` and `lse = sink`. Sinks of 1000 and scores near 800 overflow `exp`
        unless you subtract the larger of the two first.""",
            "sink_merge(o, lse, sink) -> (o, lse)", ("o", "lse"), _sink_cases),
]
