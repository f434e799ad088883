"""Standard attention: S and P materialized in HBM (Dao et al. 2022,
Algorithms 0 and 3).

The starting point of the ladder. Every N x N intermediate is written to HBM and
read back, so the traffic is Theta(N d + N^2) and the memory N^2 per head.

Explained in: notebooks/01_naive_attention (forward) and notebooks/05_backward
(backward).
"""
from __future__ import annotations

import numpy as np

from ._checks import acc_dtype, check_attention, check_like, out_dtype
from .masks import causal_mask, masked_matmul
from .softmax import divide_rows

__all__ = ["attention", "backward"]


def _tr(x):
    return np.swapaxes(x, -1, -2)


def _scores_and_probs(q, k, causal, scale, io, acc):
    """Algorithm 0, lines 1-2: S = QK^T and P = softmax(S), each written to and
    read from HBM."""
    nq, nk = q.shape[-2], k.shape[-2]
    s = np.empty((*q.shape[:-1], nk), dtype=acc)     # (..., Nq, Nk) in HBM
    # line 1: load Q, K; S = QK^T
    s_ = scale * (io.load(q).astype(acc) @ _tr(io.load(k)).astype(acc))
    if causal:
        s_ = np.where(causal_mask(0, nq, 0, nk, nq, nk), s_, -np.inf)
    io.flops(matmul=2 * s_.size * q.shape[-1])
    io.store(s, ..., s_)                             # line 1: write S to HBM
    s_ = io.load(s)                                  # line 2: read S
    m = s_.max(axis=-1, keepdims=True)               # (..., Nq, 1)
    m = np.where(np.isneginf(m), 0.0, m)             # a row with no visible key
    e = np.exp(s_ - m)
    l = e.sum(axis=-1, keepdims=True)
    io.flops(other=4 * s_.size)                      # max, subtract, exp, sum
    p = np.empty_like(s)
    io.store(p, ..., divide_rows(e, l))              # line 2: write P
    return p


def attention(q, k, v, *, causal=False, scale=None, io=None):
    """Standard attention ``softmax(scale * Q K^T) V`` (FlashAttention paper,
    Algorithm 0).

    Args:
        q: ``(..., Nq, d)``; k: ``(..., Nk, d)``; v: ``(..., Nk, dv)``, any
            floating dtype.
        causal: bottom-right aligned mask (query i sees key j iff
            ``j <= i + Nk - Nq``).
        scale: defaults to ``d ** -0.5``.
        io: an :class:`~flashlib.ladder.iomodel.IOCounter` that receives every
            HBM load and store.

    Returns:
        ``o (..., Nq, dv)`` in the inputs' dtype; rows that see no key are 0;
        NaN follows the rule of :func:`flashlib.ladder.fa2.forward`.

    Explained in: notebooks/01_naive_attention.

    Tested in: tests/ladder/test_naive.py.
    """
    q, k, v, causal, scale, io = check_attention(q, k, v, causal, scale, io)
    acc = acc_dtype(q, k, v)
    p = _scores_and_probs(q, k, causal, scale, io, acc)        # lines 1-2
    o = np.empty((*q.shape[:-1], v.shape[-1]), dtype=out_dtype(q, k, v))
    nq, nk = q.shape[-2], k.shape[-2]
    seen = causal_mask(0, nq, 0, nk, nq, nk) if causal else None
    # line 3: load P, V; O = PV
    o_ = masked_matmul(io.load(p), io.load(v).astype(acc), seen)
    io.flops(matmul=2 * p.size * v.shape[-1])
    io.store(o, ..., o_)                                       # line 3: write O
    return o


def backward(q, k, v, o, do, *, causal=False, scale=None, io=None):
    """Standard attention backward (FlashAttention paper, Algorithm 3): P, dP
    and dS in HBM.

    ``P`` is not an argument, so lines 1-2 of Algorithm 0 run again first
    (counted), as they would have left P in HBM; then Algorithm 3 follows line
    by line, with ``dS = P * (dP - rowsum(P * dP))`` (line 3). ``o`` is checked
    for shape, for the same signature as ``fa2.backward``; the standard
    backward does not need it.

    Returns:
        ``(dq, dk, dv)`` shaped like ``q``, ``k``, ``v``; rows that see no key
        give zero gradients.

    Explained in: notebooks/05_backward.

    Tested in: tests/ladder/test_naive.py.
    """
    q, k, v, causal, scale, io = check_attention(q, k, v, causal, scale, io)
    o = check_like(o, "o", (*q.shape[:-1], v.shape[-1]))
    do = check_like(do, "do", o.shape)
    acc = acc_dtype(q, k, v, do)
    p = _scores_and_probs(q, k, causal, scale, io, acc)  # P, as forward left it
    dq, dk, dv, dp, ds = (np.empty(x.shape, dtype=acc) for x in (q, k, v, p, p))
    # line 1: load P, dO; dV = P^T dO, write dV
    p_, do_ = io.load(p), io.load(do).astype(acc)
    io.store(dv, ..., _tr(p_) @ do_)
    # line 2: load dO, V; dP = dO V^T, write dP
    do_, v_ = io.load(do).astype(acc), io.load(v).astype(acc)
    io.store(dp, ..., do_ @ _tr(v_))
    # line 3: read P, dP; dS = P * (dP - rowsum(P * dP)), write dS
    p_, dp_ = io.load(p), io.load(dp)
    io.store(ds, ..., p_ * (dp_ - (p_ * dp_).sum(axis=-1, keepdims=True)))
    # line 4: load dS, K; dQ = dS K, write dQ
    ds_, k_ = io.load(ds), io.load(k).astype(acc)
    io.store(dq, ..., scale * ds_ @ k_)
    # line 5: load dS, Q; dK = dS^T Q, write dK
    ds_, q_ = io.load(ds), io.load(q).astype(acc)
    io.store(dk, ..., scale * _tr(ds_) @ q_)
    io.flops(matmul=2 * p.size * (2 * v.shape[-1] + 2 * q.shape[-1]),
             other=4 * p.size)
    dt = out_dtype(q, k, v, do)
    return dq.astype(dt), dk.astype(dt), dv.astype(dt)
