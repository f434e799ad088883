"""FlashAttention-1 forward (Dao et al. 2022, Algorithm 1): tiling with the
online softmax.

Loop order as in the paper: the outer loop runs over K/V blocks, the inner over
Q blocks, and each inner step reads O_i, l_i, m_i from HBM, rescales and writes
them back. Traffic is Theta(N^2 d^2 / M) (Theorem 2). Key blocks that a causal
mask hides from a whole query block are skipped (the paper's Algorithm 2 masks;
skipping is what its CUDA code does).

Block sizes: given ``sram_bytes`` (M = sram_bytes / bytes_per_element
elements) and no blocks, the paper's Bc = M / 4d and Br = min(Bc, d). The paper
writes ceil(M / 4d); rounding up lets the four d-wide tiles K_j, V_j, Q_i, O_i
exceed M by up to 4d elements, so we round down, which keeps them within M and
changes nothing in the Theta bound.

Explained in: notebooks/03_flashattention1.
"""
from __future__ import annotations

import numpy as np

from ._checks import (acc_dtype, check_attention, check_block, check_blocks,
                       out_dtype)
from .masks import block_hidden, causal_mask, masked_matmul
from .softmax import divide_rows, safe_exp_diff

__all__ = ["forward", "paper_block_sizes"]

DEFAULT_BLOCK = 64


def paper_block_sizes(sram_bytes: int, d: int,
                      bytes_per_element: int = 2) -> tuple[int, int]:
    """``(Br, Bc)`` of Algorithm 1, line 1, for an SRAM of ``sram_bytes``:
    Bc = floor(M/4d), Br = min(Bc, d).

    Raises ValueError when M < 4d: not even one row of K_j, V_j, Q_i and O_i
    fits.

    Explained in: notebooks/03_flashattention1.

    Tested in: tests/ladder/test_fa1.py.
    """
    sram_bytes, d, bytes_per_element = check_blocks(
        sram_bytes=sram_bytes, d=d, bytes_per_element=bytes_per_element)
    m = sram_bytes // bytes_per_element                     # M, in elements
    if m < 4 * d:
        raise ValueError(
            f"sram_bytes={sram_bytes} is too small for one tile: "
            f"FlashAttention needs M >= 4d = {4 * d} elements "
            f"({4 * d * bytes_per_element} bytes) for d={d}")
    bc = m // (4 * d)
    return min(bc, d), bc


def forward(q, k, v, *, causal=False, scale=None, block_q=None, block_k=None,
            sram_bytes=None, io=None):
    """FlashAttention-1 forward, Algorithm 1 of Dao et al. (2022).

    Args:
        q ``(..., Nq, d)``, k ``(..., Nk, d)``, v ``(..., Nk, dv)``: any leading
            dims, float dtypes.
        causal: bottom-right aligned mask. scale: defaults to ``d ** -0.5``.
        block_q, block_k: Br and Bc. Each one not given is the paper's size
            when ``sram_bytes`` is given, else 64.
        sram_bytes: on-chip memory M in bytes; sets the paper's block sizes and
            is enforced by ``io``.
        io: an :class:`~flashlib.ladder.iomodel.IOCounter` receiving every HBM
            load/store.

    Returns:
        ``o (..., Nq, dv)``; rows that see no key are 0; NaN as in
        :func:`flashlib.ladder.fa2.forward`.

    Explained in: notebooks/03_flashattention1.

    Tested in: tests/ladder/test_fa1.py.
    """
    q, k, v, causal, scale, io = check_attention(q, k, v, causal, scale, io)
    acc = acc_dtype(q, k, v)
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    if sram_bytes is not None:
        sram_bytes = check_block(sram_bytes, "sram_bytes")
        paper_br, paper_bc = paper_block_sizes(sram_bytes, d,
                                               io.bytes_per_element)
        # line 1: Br = min(Bc, d), Bc = M/4d
        block_q = paper_br if block_q is None else block_q
        block_k = paper_bc if block_k is None else block_k
    br = check_block(block_q, "block_q", DEFAULT_BLOCK)
    bc = check_block(block_k, "block_k", DEFAULT_BLOCK)
    lead = q.shape[:-2]
    # line 2: O = 0, l = 0, m = -inf in HBM
    o = np.empty((*lead, nq, v.shape[-1]), dtype=acc)
    l = np.empty((*lead, nq, 1), dtype=acc)
    m = np.empty((*lead, nq, 1), dtype=acc)
    io.store(o, ..., 0.0), io.store(l, ..., 0.0), io.store(m, ..., -np.inf)
    for j in range(0, nk, bc):                      # line 5: for 1 <= j <= Tc
        # line 6: load K_j, V_j  (..., Bc, d)
        k_j = io.load(k[..., j:j + bc, :]).astype(acc)
        v_j = io.load(v[..., j:j + bc, :]).astype(acc)
        for i in range(0, nq, br):                  # line 7: for 1 <= i <= Tr
            if causal and block_hidden(i, min(i + br, nq), j, nq, nk):
                continue                 # every key of K_j is in the future
            rows = (..., slice(i, i + br), slice(None))
            # line 8: load Q_i, O_i, l_i, m_i
            q_i = io.load(q[rows]).astype(acc)
            o_i, l_i, m_i = io.load(o[rows]), io.load(l[rows]), io.load(m[rows])
            io.sram(k_j, v_j, q_i, o_i, limit=sram_bytes)
            # line 9: S_ij = Q_i K_j^T  (..., Br, Bc)
            s_ij = scale * q_i @ np.swapaxes(k_j, -1, -2)
            seen = None                              # None: every key is seen
            if causal:
                seen = causal_mask(i, i + q_i.shape[-2], j, j + k_j.shape[-2],
                                   nq, nk)
                s_ij = np.where(seen, s_ij, -np.inf)
            # line 10: m~_ij = rowmax(S_ij), P~_ij = exp(S_ij - m~_ij),
            #          l~_ij = rowsum(P~_ij)
            m_t = s_ij.max(axis=-1, keepdims=True)
            p_t = safe_exp_diff(s_ij, m_t)
            l_t = p_t.sum(axis=-1, keepdims=True)
            # line 11: m_new = max(m_i, m~_ij), l_new = e^(..) l_i + e^(..) l~
            m_new = np.maximum(m_i, m_t)
            a, b = safe_exp_diff(m_i, m_new), safe_exp_diff(m_t, m_new)
            l_new = a * l_i + b * l_t
            # line 12: O_i = diag(l_new)^-1 (l_i e^(..) O_i + e^(..) P~_ij V_j)
            num = l_i * a * o_i + b * masked_matmul(p_t, v_j, seen)
            io.store(o, rows, divide_rows(num, l_new))
            # line 13: write l_i = l_new, m_i = m_new
            io.store(l, rows, l_new), io.store(m, rows, m_new)
            # exp/max/sum of the tile; rescale and divide O_i
            io.flops(matmul=2 * s_ij.size * (d + v.shape[-1]),
                     other=4 * s_ij.size + 4 * num.size)
    return o.astype(out_dtype(q, k, v))                             # line 16
