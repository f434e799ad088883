"""Reference solutions of the Triton puzzles (chapter 7): four small
``@triton.jit`` kernels.

Imported only when a Triton puzzle's solution is asked for;
:mod:`flashlib.kernels.triton` is imported first, so that on a machine without
a GPU triton starts in its interpreter.

Explained in: notebooks/07_triton.
"""
from __future__ import annotations

from ..kernels.triton import tl, triton

__all__ = ["softmax_kernel", "scores_kernel", "attention_row_kernel",
           "flash_forward_kernel"]


@triton.jit
def softmax_kernel(x_ptr, y_ptr, n_cols, x_row_stride, y_row_stride,
                   BLOCK: tl.constexpr):
    """One program per row: load it masked (as -inf), subtract the max, exp,
    divide by the sum.

    Explained in: notebooks/07_triton.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)              # (BLOCK,) lanes, BLOCK >= n_cols
    inside = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=inside,
                other=float("-inf"))
    m = tl.max(x, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)   # a row of -inf: no -inf - (-inf)
    e = tl.exp(x - m)                          # masked lanes: exp(-inf) = 0
    total = tl.sum(e, axis=0)
    y = tl.where(total > 0, e / total, 0.0)
    tl.store(y_ptr + row * y_row_stride + cols, y, mask=inside)


@triton.jit
def scores_kernel(q_ptr, k_ptr, s_ptr, nq, nk, d, scale, CAUSAL: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """One program per (BLOCK_M x BLOCK_N) tile of ``S = scale Q K^T``,
    bottom-right causal mask.

    Explained in: notebooks/07_triton.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    # (BLOCK_M,) query indices, (BLOCK_N,) key indices, (BLOCK_D,) >= d
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + rows[:, None] * d + dims[None, :],          # (BM, BD)
                mask=(rows[:, None] < nq) & (dims[None, :] < d), other=0.0)
    k = tl.load(k_ptr + cols[:, None] * d + dims[None, :],          # (BN, BD)
                mask=(cols[:, None] < nk) & (dims[None, :] < d), other=0.0)
    s = tl.dot(q, tl.trans(k)) * scale                              # (BM, BN)
    if CAUSAL:
        visible = cols[None, :] <= rows[:, None] + (nk - nq)
        s = tl.where(visible, s, float("-inf"))
    tl.store(s_ptr + rows[:, None] * nk + cols[None, :], s,
             mask=(rows[:, None] < nq) & (cols[None, :] < nk))


@triton.jit
def attention_row_kernel(q_ptr, k_ptr, v_ptr, o_ptr, nq, nk, d, scale,
                         CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    """One program per query: FA2's inner loop over key blocks, the online
    softmax in registers.

    Explained in: notebooks/07_triton.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    i = tl.program_id(0)                         # this program's query
    dims = tl.arange(0, BLOCK_D)                 # (BLOCK_D,), BLOCK_D >= d
    q = tl.load(q_ptr + i * d + dims, mask=dims < d, other=0.0)  # (BLOCK_D,)
    m = float("-inf")                            # running max
    l = 0.0                                      # running sum of exp(s - m)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)  # running sum of exp(s - m) v
    for j in range(0, nk, BLOCK_N):
        cols = j + tl.arange(0, BLOCK_N)         # (BLOCK_N,) key indices
        tile = (cols[:, None] < nk) & (dims[None, :] < d)
        kv_offs = cols[:, None] * d + dims[None, :]
        k = tl.load(k_ptr + kv_offs, mask=tile, other=0.0)  # (BLOCK_N, BLOCK_D)
        v = tl.load(v_ptr + kv_offs, mask=tile, other=0.0)
        visible = cols < nk
        if CAUSAL:
            visible = visible & (cols <= i + nk - nq)        # bottom-right
        s = tl.sum(q[None, :] * k, axis=1) * scale           # (BLOCK_N,)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        # nothing seen yet: no -inf - (-inf)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe)                       # (BLOCK_N,)
        alpha = tl.exp(m - m_safe)                   # rescale what came before
        l = alpha * l + tl.sum(p, axis=0)
        acc = alpha * acc + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    tl.store(o_ptr + i * d + dims, tl.where(l > 0, acc / l, 0.0),
             mask=dims < d)


@triton.jit
def flash_forward_kernel(q_ptr, k_ptr, v_ptr, o_ptr, nq, nk, d, scale,
                         CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per block of BLOCK_M queries: a tiled FlashAttention
    forward, the online softmax over key tiles, S and P never in memory.

    Explained in: notebooks/07_triton.
    Tested in: tests/puzzles/test_puzzles_triton.py.
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)   # (BLOCK_M,)
    dims = tl.arange(0, BLOCK_D)                 # (BLOCK_D,), BLOCK_D >= d
    q_tile = (rows[:, None] < nq) & (dims[None, :] < d)
    q = tl.load(q_ptr + rows[:, None] * d + dims[None, :], mask=q_tile,
                other=0.0)                       # Q_i (BLOCK_M, BLOCK_D)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)   # running max
    l = tl.zeros((BLOCK_M,), tl.float32)                 # running sum
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)       # running P V
    # The inner loop over key blocks (the puzzle):
    for j in range(0, nk, BLOCK_N):
        cols = j + tl.arange(0, BLOCK_N)         # (BLOCK_N,) key indices
        kv_tile = (cols[:, None] < nk) & (dims[None, :] < d)
        kv_offs = cols[:, None] * d + dims[None, :]
        k = tl.load(k_ptr + kv_offs, mask=kv_tile, other=0.0)   # K_j
        v = tl.load(v_ptr + kv_offs, mask=kv_tile, other=0.0)   # V_j
        s = tl.dot(q, tl.trans(k)) * scale       # S_ij (BLOCK_M, BLOCK_N)
        visible = cols[None, :] < nk
        if CAUSAL:                               # bottom-right
            visible = visible & (cols[None, :] <= rows[:, None] + nk - nq)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # a row that has seen nothing yet: no -inf - (-inf)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])          # P~_ij
        alpha = tl.exp(m - m_safe)               # rescale what came before
        l = alpha * l + tl.sum(p, axis=1)
        acc = alpha[:, None] * acc + tl.dot(p, v)
        m = m_new
    # O_i = acc / l; a row that saw no key: 0
    l_safe = tl.where(l > 0, l, 1.0)
    o = tl.where(l[:, None] > 0, acc / l_safe[:, None], 0.0)
    tl.store(o_ptr + rows[:, None] * d + dims[None, :], o, mask=q_tile)
