"""The memory-efficient precursors of FlashAttention: exact attention without an
N x N matrix.

* :func:`lse_first` — two passes over the keys: pass 1 computes each query's
  log-sum-exp tile by tile with a safe logaddexp; pass 2, with the LSE known,
  accumulates ``exp(S - lse) V`` one tile at a time. Memory O(N d + N * block);
  the keys are read twice.
* :func:`chunked` — Rabe & Staats (2021), Section 3 and Figure 1: split queries
  into chunks and, for each, keys into chunks; each key chunk yields
  ``(values, sum of weights, max score)`` which are then combined by rescaling
  to the global max. In a framework each chunk is a separate kernel launch, so
  it saves memory but not time.

Explained in: notebooks/02_online_softmax.
"""
from __future__ import annotations

import numpy as np

from ._checks import acc_dtype, check_attention, check_block, out_dtype
from .masks import causal_mask, masked_matmul
from .softmax import divide_rows, lse_from_state, merge, safe_exp_diff

__all__ = ["lse_first", "chunked"]


def _scores(q, k_j, scale, causal, q0, k0, nq, nk):
    """scale * Q K_j^T for queries [q0, ...) and keys [k0, ...), future keys
    -inf  (..., Nq, Bc); and the mask (None when not causal)."""
    s = scale * q @ np.swapaxes(k_j, -1, -2)
    if not causal:
        return s, None
    visible = causal_mask(q0, q0 + q.shape[-2], k0, k0 + k_j.shape[-2], nq, nk)
    return np.where(visible, s, -np.inf), visible


def lse_first(q, k, v, *, causal=False, scale=None, block_k=64, io=None):
    """Two-pass attention: the log-sum-exp first, then
    ``sum_j exp(S_j - lse) V_j``.

    Returns ``(o, lse)`` as :func:`flashlib.ladder.fa2.forward`.

    Explained in: notebooks/02_online_softmax.

    Tested in: tests/ladder/test_memeff.py.
    """
    q, k, v, causal, scale, io = check_attention(q, k, v, causal, scale, io)
    acc = acc_dtype(q, k, v)
    bc = check_block(block_k, "block_k")
    nq, nk = q.shape[-2], k.shape[-2]
    q_ = io.load(q).astype(acc)                        # (..., Nq, d)
    # pass 1: lse over key tiles
    lse = np.full(q.shape[:-1], -np.inf, dtype=acc)
    for j in range(0, nk, bc):
        k_j = io.load(k[..., j:j + bc, :]).astype(acc)
        s, _ = _scores(q_, k_j, scale, causal, 0, j, nq, nk)
        with np.errstate(invalid="ignore"):            # NaN input stays NaN
            # logaddexp(-inf, -inf) = -inf
            lse = np.logaddexp(lse, lse_from_state(*_tile_state(s)))
    # pass 2: accumulate exp(S - lse) V
    o = np.zeros((*q.shape[:-1], v.shape[-1]), dtype=acc)
    for j in range(0, nk, bc):
        k_j = io.load(k[..., j:j + bc, :]).astype(acc)
        v_j = io.load(v[..., j:j + bc, :]).astype(acc)
        s, seen = _scores(q_, k_j, scale, causal, 0, j, nq, nk)
        p = safe_exp_diff(s, lse[..., None])       # normalized: no rescaling
        o += masked_matmul(p, v_j, seen)
    out = np.empty(o.shape, dtype=out_dtype(q, k, v))
    io.store(out, ..., o)
    return out, lse


def _tile_state(s):
    """``(m, l)`` of each row of a score tile: its max and ``sum exp(s - m)``.
    (..., Nq) each"""
    m = s.max(axis=-1)
    return m, safe_exp_diff(s, m[..., None]).sum(axis=-1)


def chunked(q, k, v, *, causal=False, scale=None, query_chunk=1024,
            key_chunk=4096, io=None):
    """Rabe & Staats (2021) chunked attention: query chunks, and per key chunk a
    summarized result.

    For each query chunk, each key chunk j gives
    ``(exp_values_j, exp_weights_j, max_score_j)`` (``summarize_chunk`` in their
    Figure 1); the chunk results are rescaled to the global max and summed
    (their ``chunk_scanner``/combination step). Returns ``(o, lse)``.

    Explained in: notebooks/02_online_softmax.

    Tested in: tests/ladder/test_memeff.py.
    """
    q, k, v, causal, scale, io = check_attention(q, k, v, causal, scale, io)
    acc = acc_dtype(q, k, v)
    qc = check_block(query_chunk, "query_chunk")
    kc = check_block(key_chunk, "key_chunk")
    nq, nk = q.shape[-2], k.shape[-2]
    o = np.empty((*q.shape[:-1], v.shape[-1]), dtype=out_dtype(q, k, v))
    lse = np.empty(q.shape[:-1], dtype=acc)
    for i in range(0, nq, qc):                  # query chunks
        q_i = io.load(q[..., i:i + qc, :]).astype(acc)
        values, weights, maxes = [], [], []
        for j in range(0, nk, kc):              # summarize_chunk per key chunk
            k_j = io.load(k[..., j:j + kc, :]).astype(acc)
            v_j = io.load(v[..., j:j + kc, :]).astype(acc)
            s, seen = _scores(q_i, k_j, scale, causal, i, j, nq, nk)
            m_j, l_j = _tile_state(s)
            p = safe_exp_diff(s, m_j[..., None])
            values.append(masked_matmul(p, v_j, seen))   # exp_values
            weights.append(l_j)                 # exp_weights  (..., Qc)
            maxes.append(m_j)                   # max_score    (..., Qc)
        m, l = -np.inf, 0.0                     # combine: rescale to global max
        for m_j, l_j in zip(maxes, weights):
            m, l = merge(m, l, m_j, l_j)
        all_values = sum(safe_exp_diff(m_j, m)[..., None] * val
                         for m_j, val in zip(maxes, values))
        o_i = divide_rows(all_values, np.asarray(l)[..., None])
        io.store(o, (..., slice(i, i + qc), slice(None)), o_i)
        io.store(lse, (..., slice(i, i + qc)), lse_from_state(m, l))
    return o, lse
