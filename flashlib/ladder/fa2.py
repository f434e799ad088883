"""FlashAttention-2 forward and backward (Dao 2023, Algorithms 1 and 2).

Changed from FlashAttention-1: the loops are swapped — the outer loop runs over
query blocks, so each query block is an independent work item (parallel over
blocks on a GPU) whose O_i, l_i, m_i stay on chip for the whole inner loop; the
division by l is deferred to the end (line 12); the forward saves one
log-sum-exp per row instead of (m, l); key blocks that the causal mask hides
entirely are skipped. The backward recomputes S and P from Q, K and the saved
LSE, and uses D = rowsum(dO * O).

The variants real models use change a line or two each: the sliding window
generalises the skipped tiles (a tile the band hides is skipped, on both sides
of the band: :func:`~flashlib.ladder.masks.tile_class`); softcap and ALiBi
change S (and softcap's backward multiplies dS by 1 - tanh^2); a sink is a
merge with an empty-value state at the end of the row; dropout multiplies P
by Z / (1 - p), Z regenerated from a seed by the forward and the backward
alike (:mod:`flashlib.ladder.dropout`), while l and L use the undropped P.

Explained in: notebooks/04_flashattention2 (forward), notebooks/05_backward
(backward) and notebooks/09_real_models (the variants).
"""
from __future__ import annotations

import numpy as np

from ._checks import (acc_dtype, check_attention, check_block, check_like,
                       check_variants, out_dtype)
from .dropout import keep_mask
from .masks import band_mask, distance, masked_matmul, tile_class
from .softmax import divide_rows, lse_from_state, merge, safe_exp_diff

__all__ = ["forward", "backward"]

DEFAULT_BLOCK_Q = 64
DEFAULT_BLOCK_K = 64


def _masked_scores(q_i, k_j, scale, i, j, nq, nk, var):
    """S_ij = scale * Q_i K_j^T  (..., Br, Bc), softcapped, ALiBi-biased, -inf
    where the band hides a key; the mask (None: a full tile, every key seen);
    and tanh(S / softcap) for the backward (None without softcap)."""
    s_ij = scale * q_i @ np.swapaxes(k_j, -1, -2)
    rows, cols = (i, i + q_i.shape[-2]), (j, j + k_j.shape[-2])
    t_ij = None
    if var.softcap:                          # softcap * tanh(S / softcap)
        t_ij = np.tanh(s_ij / var.softcap)
        s_ij = var.softcap * t_ij
    if var.slopes is not None:               # ALiBi: -slope * |i + off - j|
        s_ij = s_ij - var.slopes * distance(*rows, *cols, nq, nk)
    if tile_class(*rows, *cols, nq, nk, *var.band) == "full":
        return s_ij, None, t_ij
    visible = band_mask(*rows, *cols, nq, nk, *var.band)
    return np.where(visible, s_ij, -np.inf), visible, t_ij


def _keep(p_ij, i, j, nq, nk, var):
    """Dropout's Z / (1 - p) on the tile of P at (i, j), regenerated from the
    seed (:func:`flashlib.ladder.dropout.keep_mask`); 1 without dropout."""
    if not var.dropout_p:
        return 1.0
    *lead, br, bc = p_ij.shape
    z = keep_mask(*var.dropout_seed, (*lead, nq, nk), var.dropout_p,
                  rows=(i, i + br), cols=(j, j + bc))
    return (z / (1.0 - var.dropout_p)).astype(p_ij.dtype)


def _empty(i, j, br, bc, nq, nk, var):
    """True when the band hides tile (i, j) entirely: it is skipped."""
    rows, cols = (i, min(i + br, nq)), (j, min(j + bc, nk))
    return tile_class(*rows, *cols, nq, nk, *var.band) == "empty"


def forward(q, k, v, *, causal=False, scale=None, block_q=None, block_k=None,
            io=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
            sinks=None, dropout_p=0.0, dropout_seed=None):
    """FlashAttention-2 forward, Algorithm 1 of Dao (2023).

    Args:
        q ``(..., Nq, d)``, k ``(..., Nk, d)``, v ``(..., Nk, dv)``: any
            leading dims, float dtypes.
        causal: bottom-right aligned mask. scale: defaults to ``d ** -0.5``.
        block_q, block_k: Br and Bc (default 64 and 64).
        io: an :class:`~flashlib.ladder.iomodel.IOCounter` receiving every
            HBM load/store and every tile processed.
        window_size, softcap, alibi_slopes, sinks, dropout_p, dropout_seed:
            the variants of notebooks/09_real_models (flash-attn's
            semantics): a ``(left, right)`` window (-1: unbounded), a softcap
            (0: off), ALiBi slopes and sink logits (arrays broadcastable to
            q's leading dims), dropout with ``dropout_seed=(seed, offset)``
            (its mask: :func:`flashlib.ladder.dropout.keep_mask`). Tiles the
            band hides are skipped.

    Returns:
        ``(o, lse)``: ``o (..., Nq, dv)``, ``lse (..., Nq)`` the natural-log
        log-sum-exp of the scaled scores, sink included (``-inf`` and
        ``o = 0`` for a row that sees no key and has no sink). NaN (flashlib's
        one rule): a NaN in ``q[i]``, or in ``k[j]`` of a key row i sees,
        makes row i's o and lse NaN; one in ``v[j]`` its o; a NaN behind the
        mask changes nothing.

    Explained in: notebooks/04_flashattention2 and notebooks/09_real_models.

    Tested in: tests/ladder/test_fa2.py, tests/ladder/test_fa2_variants.py.
    """
    q, k, v, causal, scale, io = check_attention(q, k, v, causal, scale, io)
    acc = acc_dtype(q, k, v)
    var = check_variants(q, causal, window_size, softcap, alibi_slopes, sinks,
                         dropout_p, dropout_seed, dtype=acc)
    br = check_block(block_q, "block_q", DEFAULT_BLOCK_Q)
    bc = check_block(block_k, "block_k", DEFAULT_BLOCK_K)
    nq, nk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    # line 2: O, L in HBM
    o = np.empty((*q.shape[:-1], dv), dtype=out_dtype(q, k, v))
    lse = np.empty(q.shape[:-1], dtype=acc)
    for i in range(0, nq, br):                       # line 3: for 1 <= i <= Tr
        rows = slice(i, i + br)
        q_i = io.load(q[..., rows, :]).astype(acc)   # line 4: Q_i (..., Br, d)
        # line 5: O_i = 0, l_i = 0, m_i = -inf (on chip)
        o_i = np.zeros((*q_i.shape[:-1], dv), dtype=acc)
        l_i = np.zeros((*q_i.shape[:-1], 1), dtype=acc)
        m_i = np.full_like(l_i, -np.inf)
        for j in range(0, nk, bc):                   # line 6: for 1 <= j <= Tc
            if _empty(i, j, br, bc, nq, nk, var):
                continue                     # the band hides the whole tile
            io.tile(i, j)
            # line 7: load K_j, V_j  (..., Bc, d)
            k_j = io.load(k[..., j:j + bc, :]).astype(acc)
            v_j = io.load(v[..., j:j + bc, :]).astype(acc)
            io.sram(q_i, k_j, v_j, o_i)
            # line 8: S_ij
            s_ij, seen, _ = _masked_scores(q_i, k_j, scale, i, j, nq, nk, var)
            # line 9: m_i^(j), P~ = exp(S - m_i^(j)), l_i^(j)
            m_new = np.maximum(m_i, s_ij.max(axis=-1, keepdims=True))
            p_ij = safe_exp_diff(s_ij, m_new)
            alpha = safe_exp_diff(m_i, m_new)        # e^(m^(j-1) - m^(j))
            l_i = alpha * l_i + p_ij.sum(axis=-1, keepdims=True)
            # line 10: O_i^(j), unnormalized (dropout: P o Z / (1 - p))
            z_ij = _keep(p_ij, i, j, nq, nk, var)
            o_i = alpha * o_i + masked_matmul(p_ij * z_ij, v_j, seen)
            m_i = m_new
            io.flops(matmul=2 * s_ij.size * (d + dv),
                     other=4 * s_ij.size + 2 * o_i.size)
        if var.sinks is not None:
            # a sink: merge with the state (m, l, O) = (sink, 1, 0)
            m_s, l_i = merge(m_i, l_i, var.sinks, 1.0)
            o_i, m_i = safe_exp_diff(m_i, m_s) * o_i, m_s
        o_i = divide_rows(o_i, l_i)                  # line 12: diag(l)^-1 O_i
        io.flops(other=o_i.size)
        io.store(o, (..., rows, slice(None)), o_i)   # line 14: write O_i
        # lines 13, 15: write L_i = m_i + log(l_i)
        io.store(lse, (..., rows), lse_from_state(m_i, l_i)[..., 0])
    return o, lse                                    # line 17


def backward(q, k, v, o, lse, do, *, causal=False, scale=None, block_q=None,
             block_k=None, io=None, window_size=(-1, -1), softcap=0.0,
             alibi_slopes=None, sinks=None, dropout_p=0.0, dropout_seed=None):
    """FlashAttention-2 backward, Algorithm 2 of Dao (2023): recompute P from
    the saved LSE.

    Args:
        q, k, v and the variants: as for :func:`forward`; o ``(..., Nq, dv)``
            and lse ``(..., Nq)`` from the forward;
        do ``(..., Nq, dv)``: the gradient of the loss with respect to o.

    Returns:
        ``(dq, dk, dv)`` shaped like ``q``, ``k``, ``v``; rows with
        ``lse = -inf`` contribute nothing. With ``sinks``, a fourth:
        ``dsinks`` shaped like q's leading dims (not summed over a batch),
        ``-sum_i exp(sink - lse_i) D_i``.

    Explained in: notebooks/05_backward and notebooks/09_real_models.

    Tested in: tests/ladder/test_fa2.py, tests/ladder/test_fa2_variants.py.
    """
    q, k, v, causal, scale, io = check_attention(q, k, v, causal, scale, io)
    o = check_like(o, "o", (*q.shape[:-1], v.shape[-1]))
    lse = check_like(lse, "lse", q.shape[:-1])
    do = check_like(do, "do", o.shape)
    acc = acc_dtype(q, k, v, do)
    var = check_variants(q, causal, window_size, softcap, alibi_slopes, sinks,
                         dropout_p, dropout_seed, dtype=acc)
    br = check_block(block_q, "block_q", DEFAULT_BLOCK_Q)
    bc = check_block(block_k, "block_k", DEFAULT_BLOCK_K)
    nq, nk = q.shape[-2], k.shape[-2]
    dq = np.empty(q.shape, dtype=acc)                # line 3: dQ = 0 in HBM
    dk, dv = np.empty(k.shape, dtype=acc), np.empty(v.shape, dtype=acc)
    io.store(dq, ..., 0.0)
    # line 4: D = rowsum(dO * O), written to HBM
    big_d = np.empty((*q.shape[:-1], 1), dtype=acc)
    do_o = io.load(do).astype(acc) * io.load(o).astype(acc)
    io.store(big_d, ..., do_o.sum(-1, keepdims=True))
    lse_col = lse[..., None].astype(acc)             # L as (..., Nq, 1)
    for j in range(0, nk, bc):                       # line 5: for 1 <= j <= Tc
        # line 6: load K_j, V_j  (..., Bc, d)
        k_j = io.load(k[..., j:j + bc, :]).astype(acc)
        v_j = io.load(v[..., j:j + bc, :]).astype(acc)
        # line 7: dK_j = dV_j = 0 on chip
        dk_j, dv_j = np.zeros_like(k_j), np.zeros_like(v_j)
        for i in range(0, nq, br):                   # line 8: for 1 <= i <= Tr
            rows = (..., slice(i, i + br), slice(None))
            if _empty(i, j, br, bc, nq, nk, var):
                continue                     # the band hides the whole tile
            io.tile(i, j)
            # line 9: load Q_i, dO_i, L_i, D_i (O_i is not needed: D is saved)
            q_i = io.load(q[rows]).astype(acc)
            do_i = io.load(do[rows]).astype(acc)
            l_i, d_i = io.load(lse_col[rows]), io.load(big_d[rows])
            # line 10: S_ij
            s_ij, _, t_ij = _masked_scores(q_i, k_j, scale, i, j, nq, nk, var)
            p_ij = safe_exp_diff(s_ij, l_i)          # line 11: exp(S_ij - L_i)
            z_ij = _keep(p_ij, i, j, nq, nk, var)    # dropout: Z / (1 - p)
            # line 12: dV_j += P^T dO_i  (P o Z / (1 - p) with dropout)
            dv_j += np.swapaxes(p_ij * z_ij, -1, -2) @ do_i
            # line 13: dP_ij = dO_i V_j^T  (times Z / (1 - p) with dropout)
            dp_ij = (do_i @ np.swapaxes(v_j, -1, -2)) * z_ij
            ds_ij = p_ij * (dp_ij - d_i)             # line 14: P * (dP - D_i)
            if t_ij is not None:                     # softcap: * (1 - tanh^2)
                ds_ij = ds_ij * (1.0 - t_ij ** 2)
            # line 15: dQ_i += dS_ij K_j  (read, add, write back to HBM)
            dq_i = io.load(dq[rows])
            io.store(dq, rows, dq_i + scale * ds_ij @ k_j)
            # line 16: dK_j += dS^T Q_i
            dk_j += scale * np.swapaxes(ds_ij, -1, -2) @ q_i
            io.sram(k_j, v_j, dk_j, dv_j, q_i, do_i, dq_i)
            # matmuls: S, dQ, dK (width d); dV, dP (width dv)
            io.flops(matmul=2 * s_ij.size * (3 * q.shape[-1] + 2 * v.shape[-1]),
                     other=5 * s_ij.size)
        # line 18: write dK_j, dV_j
        io.store(dk, (..., slice(j, j + bc), slice(None)), dk_j)
        io.store(dv, (..., slice(j, j + bc), slice(None)), dv_j)
    dt = out_dtype(q, k, v, do)
    grads = dq.astype(dt), dk.astype(dt), dv.astype(dt)  # line 20
    if var.sinks is None:
        return grads
    # a sink's gradient: d sink = -sum_i exp(sink - L_i) D_i
    share = safe_exp_diff(var.sinks, lse_col) * big_d
    return (*grads, -share.sum(axis=(-2, -1)))
