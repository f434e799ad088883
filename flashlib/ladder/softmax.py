"""Softmax three ways, the merge of partial softmax states, and log-sum-exp
helpers.

* :func:`naive_softmax` — ``exp(x) / sum(exp(x))``: one pass, overflows in fp16
  for x > 11.
* :func:`safe_softmax` — three passes over the row: max, sum of
  ``exp(x - max)``, normalize.
* :func:`online_softmax` — two passes (Milakov & Gimelshein 2018, Algorithm 3):
  the first keeps a running max ``m`` and a running sum ``l`` rescaled whenever
  the max grows; the second normalizes.
* :func:`merge` — the operator that combines the ``(m, l)`` states of two parts
  of a row. It is associative and commutative, which is what lets
  FlashAttention process key blocks in any grouping and Flash-Decoding / ring
  attention combine partial results. Carried with the output, as states
  ``(o, lse)`` with ``lse = m + log(l)``, it is
  :func:`flashlib.ladder.serving.merge` (notebooks/10_serving): one operator.

A row whose entries are all ``-inf`` (a query that sees no key) has softmax 0
and lse ``-inf``.
Explained in: notebooks/02_online_softmax.
"""
from __future__ import annotations

import numpy as np

from ._checks import check_real, check_rows, check_states

__all__ = ["naive_softmax", "safe_softmax", "online_softmax", "online_state",
           "merge", "lse_from_state", "logsumexp", "safe_exp_diff",
           "divide_rows"]


def safe_exp_diff(a, b):
    """``exp(a - b)`` with ``exp(-inf - (-inf)) = 0`` instead of NaN (both
    states empty).

    Explained in: notebooks/02_online_softmax.
    Tested in: tests/ladder/test_softmax.py.
    """
    a, b = check_real(a=a, b=b)
    b_safe = np.where(np.isneginf(b), 0.0, b)
    with np.errstate(invalid="ignore"):
        return np.where(np.isneginf(a), 0.0, np.exp(a - b_safe))


def divide_rows(num, l):
    """``num / l``, with 0 where ``l == 0`` (a row that saw no key); NaN still
    propagates.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/ladder/test_softmax.py.
    """
    num, l = check_real(num=num, l=l)
    out = np.zeros(np.broadcast_shapes(num.shape, l.shape),
                   np.result_type(num, l))
    return np.divide(num, l, out=out, where=l != 0)


def naive_softmax(x):
    """``exp(x) / sum(exp(x))`` along the last axis, in ``x``'s dtype — no max
    subtracted.

    Explained in: notebooks/02_online_softmax (it overflows).

    Tested in: tests/ladder/test_softmax.py.
    """
    x = check_rows(x)
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(x)
        return e / e.sum(axis=-1, keepdims=True, dtype=x.dtype)


def safe_softmax(x):
    """Safe softmax in three passes over the last axis.

    Explained in: notebooks/02_online_softmax.

    Tested in: tests/ladder/test_softmax.py.
    """
    x = check_rows(x)
    m = x.max(axis=-1, keepdims=True)           # pass 1: m = max_j x_j
    e = safe_exp_diff(x, m)                     # pass 2: l = sum_j exp(x_j - m)
    l = e.sum(axis=-1, keepdims=True)
    return divide_rows(e, l)                    # pass 3: y_j = exp(x_j - m) / l


def online_state(x):
    """Pass 1 of the online softmax: the running ``(m, l)`` over the last axis,
    one element at a time.

    Milakov & Gimelshein (2018), Algorithm 3, lines 1-6::

        m_0 = -inf, l_0 = 0
        for j in 1..V:
            m_j = max(m_{j-1}, x_j)
            l_j = l_{j-1} * exp(m_{j-1} - m_j) + exp(x_j - m_j)

    Returns ``(m, l)`` shaped like ``x`` without its last axis.

    Explained in: notebooks/02_online_softmax.

    Tested in: tests/ladder/test_softmax.py.
    """
    x = check_rows(x)
    m = np.full(x.shape[:-1], -np.inf, dtype=x.dtype)  # line 1: m_0 = -inf
    l = np.zeros(x.shape[:-1], dtype=x.dtype)          # line 2: d_0 = 0
    for j in range(x.shape[-1]):                       # line 3: for j = 1..V
        m_new = np.maximum(m, x[..., j])               # line 4: m_j
        # line 5: l_j = l_{j-1} exp(m_{j-1} - m_j) + exp(x_j - m_j)
        l = l * safe_exp_diff(m, m_new) + safe_exp_diff(x[..., j], m_new)
        m = m_new
    return m, l


def online_softmax(x):
    """Two-pass online softmax (Milakov & Gimelshein 2018, Algorithm 3).

    Explained in: notebooks/02_online_softmax.

    Tested in: tests/ladder/test_softmax.py.
    """
    m, l = online_state(x)                 # pass 1 (lines 1-6)
    e = safe_exp_diff(x, m[..., None])     # pass 2 (lines 7-9):
    return divide_rows(e, l[..., None])    #   exp(x_j - m_V) / d_V


def merge(m_a, l_a, m_b, l_b):
    """Combine the softmax states ``(m, l)`` of two disjoint parts of a row.

    ``m = max(m_a, m_b)``, ``l = l_a exp(m_a - m) + l_b exp(m_b - m)``.
    Associative and commutative, with identity ``(-inf, 0)``.

    Explained in: notebooks/02_online_softmax.

    Tested in: tests/ladder/test_softmax.py.
    """
    m_a, l_a, m_b, l_b = check_states(m_a=m_a, l_a=l_a, m_b=m_b, l_b=l_b)
    m = np.maximum(m_a, m_b)
    return m, l_a * safe_exp_diff(m_a, m) + l_b * safe_exp_diff(m_b, m)


def lse_from_state(m, l):
    """``log(sum(exp(x))) = m + log(l)``; ``-inf`` for an empty state
    (``l = 0``).

    Explained in: notebooks/02_online_softmax.
    Tested in: tests/ladder/test_softmax.py.
    """
    m, l = check_states(m=m, l=l)
    with np.errstate(divide="ignore"):
        m_safe = np.where(np.isneginf(m), 0.0, m)
        return np.where(l == 0, -np.inf, m_safe + np.log(l))


def logsumexp(x, axis=-1):
    """Stable ``log(sum(exp(x)))`` along ``axis``; ``-inf`` where every entry
    is ``-inf``.

    Explained in: notebooks/02_online_softmax.
    Tested in: tests/ladder/test_softmax.py.
    """
    x = check_rows(x, axis=axis)
    m = x.max(axis=axis, keepdims=True)
    l = safe_exp_diff(x, m).sum(axis=axis, keepdims=True)
    return np.squeeze(lse_from_state(m, l), axis=axis)
