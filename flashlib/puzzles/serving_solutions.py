"""Reference solutions of the puzzles of chapter 10 (serving), one short
function each.

What a reader could write after the chapter, in NumPy, one head. A packed
batch holds sequence b at rows ``cu[b] .. cu[b + 1] - 1``; a paged cache
holds token t of sequence b in page ``block_table[b, t // page_size]``,
row ``t % page_size``; a state over no key is ``(0, -inf)``. Every one
passes its checker (tests/puzzles/test_serving_puzzles.py).

Explained in: notebooks/10_serving.
"""
from __future__ import annotations

import numpy as np

__all__ = ["cu_seqlens", "paged_gather", "merge_attention",
           "varlen_causal"]


def cu_seqlens(lengths):
    """The offsets of a packed batch: ``[0, l0, l0 + l1, ...]``, int32.

    Explained in: notebooks/10_serving.
    Tested in: tests/puzzles/test_serving_puzzles.py.
    """
    cu = np.zeros(len(lengths) + 1, dtype=np.int64)
    cu[1:] = np.cumsum(lengths)
    return cu.astype(np.int32)


def paged_gather(k_cache, block_table, b, n):
    """Sequence ``b``'s first ``n`` keys ``(n, Hkv, d)`` from a paged
    cache: a logical token's page and row, then one gather. Only the
    table entries of those ``n`` tokens are read.

    Explained in: notebooks/10_serving.
    Tested in: tests/puzzles/test_serving_puzzles.py.
    """
    page_size = k_cache.shape[1]
    t = np.arange(n)                          # logical positions
    page = block_table[b, t // page_size]     # physical page of each
    row = t % page_size                       # its row in that page
    return k_cache[page, row]                 # (n, Hkv, d)


def merge_attention(o_a, lse_a, o_b, lse_b):
    """``(o, lse)`` over the union of two disjoint key sets, from their
    states; an empty state (``lse = -inf``) weighs 0, and two empty ones
    give ``(0, -inf)``.

    Explained in: notebooks/10_serving.
    Tested in: tests/puzzles/test_serving_puzzles.py.
    """
    lse = np.logaddexp(lse_a, lse_b)          # (H, N); -inf: both empty
    safe = np.where(np.isneginf(lse), 0.0, lse)
    w_a = np.exp(lse_a - safe)[..., None]     # (H, N, 1); 0 if a empty
    w_b = np.exp(lse_b - safe)[..., None]
    return w_a * o_a + w_b * o_b, lse


def varlen_causal(q, k, v, cu_q, cu_k):
    """Causal attention over a packed batch, one head: each sequence
    against its own keys, the mask aligned bottom-right per sequence.

    Explained in: notebooks/10_serving.
    Tested in: tests/puzzles/test_serving_puzzles.py.
    """
    o = np.zeros((len(q), v.shape[1]))
    lse = np.full(len(q), -np.inf)
    for b in range(len(cu_q) - 1):
        qb = q[cu_q[b]:cu_q[b + 1]]           # (nq, d)
        kb, vb = k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        nq, nk = len(qb), len(kb)
        s = qb @ kb.T * q.shape[1] ** -0.5    # (nq, nk)
        i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
        s = np.where(j <= i + nk - nq, s, -np.inf)  # this sequence's offset
        m = s.max(axis=1, initial=-np.inf)    # (nq,); -inf: sees no key
        safe = np.where(np.isneginf(m), 0.0, m)[:, None]
        p = np.exp(s - safe)
        l = p.sum(axis=1)
        rows = slice(cu_q[b], cu_q[b + 1])
        o[rows] = np.divide(p @ vb, l[:, None], out=np.zeros((nq, v.shape[1])),
                            where=l[:, None] > 0)
        with np.errstate(divide="ignore"):
            lse[rows] = safe[:, 0] + np.log(l)
    return o, lse
