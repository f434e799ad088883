"""Reference solutions of the NumPy puzzles (chapters 1-6), one short function
each.

Each is what a reader could write after the chapter, not a copy of the ladder:
the ladder's code counts HBM traffic and takes any leading dims; these take one
head, as the puzzles hand it. Every one passes its checker
(tests/puzzles/test_puzzles.py). Scores are ``tau * Q K^T`` with
``tau = d ** -0.5``; a causal mask is bottom-right aligned (query i sees key j
iff ``j <= i + Nk - Nq``); a row that sees no key has output 0 and
``lse = -inf``.

Explained in: notebooks/01_naive_attention (and each chapter's Puzzles section).
"""
from __future__ import annotations

import numpy as np

__all__ = ["causal_mask", "softmax_rows", "naive_attention", "online_step",
           "merge_states", "chunked_attention", "fa1_update", "block_sizes",
           "block_hidden", "fa2_step", "fa2_finish", "fa2_forward", "rowsum_d",
           "ds_tile", "backward_tile", "split_bounds", "split_partial",
           "combine_splits"]


def _exp_minus(x, m):
    """exp(x - m), with 0 where m = -inf (then x = -inf too): never
    exp(-inf - (-inf)) = NaN."""
    return np.exp(x - np.where(np.isneginf(m), 0.0, m))


# ---- chapter 1 ---------------------------------------------------------------

def causal_mask(nq, nk):
    """``(nq, nk)`` bool, True where query i may see key j: ``j <= i + nk - nq``
    (bottom-right).

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    i = np.arange(nq)[:, None]                   # (nq, 1)
    j = np.arange(nk)[None, :]                   # (1, nk)
    return j <= i + (nk - nq)                    # the last query sees every key


def softmax_rows(s):
    """Softmax of each row of ``s (rows, n)``; a row of -inf (sees no key) gives
    zeros, not NaN.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    m = s.max(axis=1, keepdims=True)   # (rows, 1): subtract it or exp overflows
    e = _exp_minus(s, m)
    l = e.sum(axis=1, keepdims=True)
    return np.divide(e, l, out=np.zeros_like(e), where=l > 0)


def naive_attention(q, k, v, causal):
    """``softmax(tau Q K^T) V`` for one head: q ``(Nq, d)``, k ``(Nk, d)``,
    v ``(Nk, dv)`` -> ``(Nq, dv)``.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    s = q.shape[1] ** -0.5 * q @ k.T                # (Nq, Nk)
    if causal:
        s = np.where(causal_mask(len(q), len(k)), s, -np.inf)
    return softmax_rows(s) @ v


# ---- chapter 2 ---------------------------------------------------------------

def online_step(m, l, x):
    """One step of the online softmax for many rows: fold the next scores
    ``x (rows,)`` into ``(m, l)``.

    Explained in: notebooks/02_online_softmax.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    m_new = np.maximum(m, x)
    # rescale the old sum to the new max
    return m_new, l * _exp_minus(m, m_new) + _exp_minus(x, m_new)


def merge_states(m_a, l_a, m_b, l_b):
    """Merge the ``(m, l)`` states of two disjoint parts of the same rows.

    Explained in: notebooks/02_online_softmax.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    m = np.maximum(m_a, m_b)
    # each sum rescaled to the common max
    return m, l_a * _exp_minus(m_a, m) + l_b * _exp_minus(m_b, m)


def chunked_attention(q, k, v, causal, chunk):
    """Attention over ``chunk`` keys at a time, with a running (m, l, acc) per
    query: no (Nq, Nk) matrix.

    Explained in: notebooks/02_online_softmax.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    nq, nk = len(q), len(k)
    m, l = np.full((nq, 1), -np.inf), np.zeros((nq, 1))
    acc = np.zeros((nq, v.shape[1]))                    # sum_j exp(s_j - m) v_j
    for j in range(0, nk, chunk):
        s = q.shape[1] ** -0.5 * q @ k[j:j + chunk].T   # (Nq, chunk)
        if causal:
            s = np.where(causal_mask(nq, nk)[:, j:j + chunk], s, -np.inf)
        m_new = np.maximum(m, s.max(axis=1, keepdims=True))
        p, alpha = _exp_minus(s, m_new), _exp_minus(m, m_new)
        l = alpha * l + p.sum(axis=1, keepdims=True)
        acc = alpha * acc + p @ v[j:j + chunk]
        m = m_new
    return np.divide(acc, l, out=np.zeros_like(acc), where=l > 0)


# ---- chapter 3 ---------------------------------------------------------------

def fa1_update(o_i, l_i, m_i, s_ij, v_j):
    """Algorithm 1, lines 10-12: fold one tile of scores ``s_ij (Br, Bc)`` into
    the *normalized* O_i.

    Explained in: notebooks/03_flashattention1.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    m_t = s_ij.max(axis=1, keepdims=True)          # line 10: the tile's own max
    p_t = _exp_minus(s_ij, m_t)
    l_t = p_t.sum(axis=1, keepdims=True)
    m_new = np.maximum(m_i, m_t)                   # line 11
    a, b = _exp_minus(m_i, m_new), _exp_minus(m_t, m_new)
    l_new = a * l_i + b * l_t
    num = l_i * a * o_i + b * (p_t @ v_j)          # line 12: undo the old 1/l_i
    o_new = np.divide(num, l_new, out=np.zeros_like(num), where=l_new > 0)
    return o_new, l_new, m_new


def block_sizes(sram_bytes, d, bytes_per_element):
    """Algorithm 1, line 1: ``Bc = floor(M / 4d)``, ``Br = min(Bc, d)``, M in
    elements; too small: ValueError.

    Explained in: notebooks/03_flashattention1.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    m = sram_bytes // bytes_per_element            # M, in elements
    if m < 4 * d:
        raise ValueError(f"M = {m} elements cannot hold one row each of "
                         f"K_j, V_j, Q_i, O_i (4d = {4 * d})")
    bc = m // (4 * d)                              # floor: the 4 tiles fit in M
    return min(bc, d), bc


def block_hidden(q0, q1, k0, nq, nk):
    """True when the causal mask hides every key from ``k0`` on from all
    queries ``q0 .. q1 - 1``.

    Explained in: notebooks/03_flashattention1.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    # the last query of the block sees the most keys
    return k0 > (q1 - 1) + (nk - nq)


# ---- chapter 4 ---------------------------------------------------------------

def fa2_step(o_i, l_i, m_i, s_ij, v_j):
    """Algorithm 1 of FA2, lines 9-10: fold a tile into the *unnormalized* O_i
    (no division).

    Explained in: notebooks/04_flashattention2.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    m_new = np.maximum(m_i, s_ij.max(axis=1, keepdims=True))    # (Br, 1)
    p = _exp_minus(s_ij, m_new)                                 # (Br, Bc)
    alpha = _exp_minus(m_i, m_new)              # rescale what came before
    o_new = alpha * o_i + p @ v_j
    l_new = alpha * l_i + p.sum(axis=1, keepdims=True)
    return o_new, l_new, m_new


def fa2_finish(o_i, l_i, m_i):
    """Lines 12-13: ``O = O_i / l_i`` once, at the end, and
    ``lse = m_i + log l_i`` (``-inf`` when l = 0).

    Explained in: notebooks/04_flashattention2.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    o = np.divide(o_i, l_i, out=np.zeros_like(o_i), where=l_i > 0)
    with np.errstate(divide="ignore"):
        lse = np.where(l_i > 0, m_i + np.log(l_i), -np.inf)     # (Br, 1)
    return o, lse[:, 0]


def fa2_forward(q, k, v, causal, block_q, block_k):
    """FlashAttention-2 forward for one head: outer loop over query blocks,
    inner over key blocks.

    Explained in: notebooks/04_flashattention2.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    nq, nk = len(q), len(k)
    o, lse = np.zeros((nq, v.shape[1])), np.full(nq, -np.inf)
    for i in range(0, nq, block_q):
        q_i = q[i:i + block_q]                                  # (Br, d)
        o_i = np.zeros((len(q_i), v.shape[1]))
        l_i = np.zeros((len(q_i), 1))
        m_i = np.full((len(q_i), 1), -np.inf)
        for j in range(0, nk, block_k):
            if causal and block_hidden(i, i + len(q_i), j, nq, nk):
                break                   # this block and all later: future
            s = q.shape[1] ** -0.5 * q_i @ k[j:j + block_k].T   # (Br, Bc)
            if causal:
                seen = causal_mask(nq, nk)[i:i + block_q, j:j + block_k]
                s = np.where(seen, s, -np.inf)
            o_i, l_i, m_i = fa2_step(o_i, l_i, m_i, s, v[j:j + block_k])
        o[i:i + block_q], lse[i:i + block_q] = fa2_finish(o_i, l_i, m_i)
    return o, lse


# ---- chapter 5 ---------------------------------------------------------------

def rowsum_d(do, o):
    """``D = rowsum(dO * O)``, shape ``(Nq,)``: equal to ``rowsum(P * dP)``
    without P.

    Explained in: notebooks/05_backward.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    return (do * o).sum(axis=1)


def ds_tile(p, dp, d_rows):
    """``dS = P * (dP - D)``, D broadcast along each row: the softmax's
    Jacobian applied to dP.

    Explained in: notebooks/05_backward.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    return p * (dp - d_rows[:, None])


def backward_tile(q_i, k_j, v_j, do_i, lse_i, d_i, scale, mask):
    """FA2 backward, lines 10-16, for one tile: the tile's contributions
    ``(dQ_i, dK_j, dV_j)``.

    Explained in: notebooks/05_backward.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    s = np.where(mask, scale * q_i @ k_j.T, -np.inf)    # line 10: S_ij (Br, Bc)
    # line 11: P = exp(S - L), 0 if L = -inf
    p = _exp_minus(s, lse_i[:, None])
    dp = do_i @ v_j.T                                         # line 13
    ds = ds_tile(p, dp, d_i)                                  # line 14
    return scale * ds @ k_j, scale * ds.T @ q_i, p.T @ do_i   # lines 15, 16, 12


# ---- chapter 6 ---------------------------------------------------------------

def split_bounds(nk, num_splits):
    """``num_splits`` contiguous key ranges ``[(start, stop), ...]`` covering
    ``0 .. nk``, sizes within 1.

    Explained in: notebooks/06_flash_decoding.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    edges = [s * nk // num_splits for s in range(num_splits + 1)]
    return list(zip(edges[:-1], edges[1:]))


def split_partial(q, k_s, v_s, k0, nk, causal):
    """One split's normalized ``(o_s (Nq, dv), lse_s (Nq,))`` against keys
    ``k0 .. k0 + len(k_s)`` of nk.

    Explained in: notebooks/06_flash_decoding.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    nq = len(q)
    s = q.shape[1] ** -0.5 * q @ k_s.T                        # (Nq, chunk)
    if causal:                                        # global key indices
        seen = causal_mask(nq, nk)[:, k0:k0 + len(k_s)]
        s = np.where(seen, s, -np.inf)
    # (Nq, 1); an empty split: -inf
    m = s.max(axis=1, keepdims=True, initial=-np.inf)
    p = _exp_minus(s, m)
    # normalized, and its lse
    return fa2_finish(p @ v_s, p.sum(axis=1, keepdims=True), m)


def combine_splits(o_parts, lse_parts):
    """Merge ``(o_parts (S, Nq, dv), lse_parts (S, Nq))``: weights
    ``exp(LSE_s - lse)``, max first.

    Explained in: notebooks/06_flash_decoding.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    m = lse_parts.max(axis=0)                     # (Nq,): no exp(1000) overflow
    w = _exp_minus(lse_parts, m)                  # (S, Nq)
    l = w.sum(axis=0)
    o = (w[..., None] * o_parts).sum(axis=0)
    return fa2_finish(o, l[:, None], m[:, None])
