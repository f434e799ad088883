"""Reference solutions of the puzzles of chapter 9 (what real models change),
one short function each.

What a reader could write after the chapter, for one head. Scores are
``tau * Q K^T`` with ``tau = d ** -0.5``; query i's own key is
``c = i + Nk - Nq`` (bottom-right alignment); a row that sees no key has
output 0 and ``lse = -inf``. Every one passes its checker
(tests/puzzles/test_variant_puzzles.py).

Explained in: notebooks/09_real_models.
"""
from __future__ import annotations

import numpy as np

__all__ = ["tile_class", "alibi_causal", "sink_merge"]


def tile_class(q0, q1, k0, k1, nq, nk, causal, window):
    """``"full"``, ``"partial"`` or ``"empty"``: how much of the tile of
    queries ``q0 .. q1 - 1`` and keys ``k0 .. k1 - 1`` the band lets through.

    Query i sees key j iff ``lo <= j - c <= hi`` with ``c = i + nk - nq``,
    ``lo = -left`` and ``hi = right`` (0 if causal); over the tile,
    ``j - c`` takes every integer between its bottom-left and top-right
    corners, so those two corners decide.

    Explained in: notebooks/09_real_models.
    Tested in: tests/puzzles/test_variant_puzzles.py.
    """
    left, right = window
    lo = -left if left >= 0 else -np.inf      # -1: unbounded
    hi = right if right >= 0 else np.inf
    if causal:
        hi = min(hi, 0)
    off = nk - nq
    smallest = k0 - (q1 - 1 + off)            # bottom-left corner: j - c
    largest = (k1 - 1) - (q0 + off)           # top-right corner
    if largest < lo or smallest > hi:
        return "empty"                        # the band misses the tile
    if lo <= smallest and largest <= hi:
        return "full"                         # both corners inside the band
    return "partial"


def alibi_causal(q, k, v, slope):
    """Causal attention with ALiBi for one head, by shift invariance: add
    ``slope * j`` (not ``-slope * |c - j|``), then correct the lse by
    ``-slope * c``, the row constant the softmax never saw.

    Explained in: notebooks/09_real_models.
    Tested in: tests/puzzles/test_variant_puzzles.py.
    """
    nq, nk = len(q), len(k)
    c = np.arange(nq)[:, None] + (nk - nq)    # (Nq, 1): query i's own key
    j = np.arange(nk)[None, :]                # (1, Nk)
    s = q.shape[1] ** -0.5 * q @ k.T + slope * j
    s = np.where(j <= c, s, -np.inf)          # the causal mask
    m = s.max(axis=1, keepdims=True)          # (Nq, 1); -inf: sees no key
    e = np.exp(s - np.where(np.isneginf(m), 0.0, m))
    l = e.sum(axis=1, keepdims=True)
    o = np.divide(e @ v, l, out=np.zeros((nq, v.shape[1])), where=l > 0)
    with np.errstate(divide="ignore"):
        lse = (m + np.log(l))[:, 0]           # -inf: the row sees no key
    return o, lse - slope * c[:, 0]           # the true scores' lse


def sink_merge(o, lse, sink):
    """Merge a sink into a finished row block: the sink is a state with
    log-sum-exp ``sink`` and output 0, so only the weight of the keys'
    output changes, ``exp(lse - lse_new)``.

    Explained in: notebooks/09_real_models.
    Tested in: tests/puzzles/test_variant_puzzles.py.
    """
    lse_new = np.logaddexp(lse, sink)         # log(e^lse + e^sink), safely
    weight = np.exp(lse - lse_new)            # 0 where lse = -inf
    return o * weight[:, None], lse_new
