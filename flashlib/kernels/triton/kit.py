# kit.py — the pieces every flashlib Triton kernel shares, written once.
# Changed from one copy of each piece per kernel: the online-softmax step, the masking, the
#   flat-grid decode and the constants log2 e and ln 2 live here once, as @triton.jit helpers
#   (Triton inlines them) and named constants (LOG2E, LN2):
#   * unflatten — a flat-grid index into its fastest count and the rest
#     (flashlib.kernels.triton.flat_grid);
#   * key_range / query_range — which key blocks a query block sees fully, in part, or not at all
#     (and which query blocks see a key block in part), bottom-right causal: query i sees key j iff
#     j <= i + Nk - Nq;
#   * load_tile / store_tile — a (rows, BLOCK_D) tile, rows and padded columns masked, with the
#     interpreter's bf16 upcast; load_kv — a key block's K_j, V_j; load_lse2 — saved LSEs in base 2;
#     desc_2d — the tensor descriptor of one (batch, head)'s (N, d) matrix, for the TMA kernels;
#   * for the launchers on the host, plain Python: qk_scale, ceil_div and block_d (triton.cdiv and
#     triton.next_power_of_2 are ConstexprFunctions, microseconds a call on the host);
#   * dkdv_step — one query block's contribution to dK_j, dV_j (Algorithm 2, lines 9-16 without 15),
#     the body of both dK/dV kernels (fa2_bwd's and fa2_bwd_tma's), which differ only in their
#     loads;
#   * softmax_step — one step of the online softmax (Algorithm 1, lines 9-10), in base 2, and
#     finish — its end (lines 12-13): O = acc / l, L = ln 2 (m + log2 l); a row that saw nothing:
#     O = 0, L = -inf;
#   * NaN follows one rule (flashlib's, on every backend): a NaN in q[i], or in k[j] or v[j] at a
#     key j that row i sees, makes row i's O NaN (and its L, except for v); a NaN that row i does
#     not see (causal mask, past NK) changes nothing. finish decides "saw no key" by l == 0, which
#     only a row that saw no key has (l >= 1 after any finite score, NaN after a NaN one; l > 0
#     would be false for NaN). In the MASKED stage of a causal forward, V_j holds keys the mask
#     hides from some rows, where P = 0 and 0 * NaN = NaN would spread; hide_nan_values zeroes V's
#     NaNs there and flags the rows that do see one (their acc becomes NaN). The FULL stage is
#     untouched (every row sees every key of its blocks), and keys past NK load as 0 (no NaN to
#     hide). It finds the block's first NaN key (a row sees it iff it sees any: the keys a row sees
#     are a prefix), not a per-(row, key) matrix, which spilled (compile report, triton 3.9). The
#     backward does not follow the rule: the gradients of a NaN row are not specified.
#   * one masking policy: only the blocks the ranges call partial are masked, by mask_keys (keys
#     past Nk) and mask_causal (keys the causal mask hides); mask_scores applies both. attend, the
#     forward's inner loop, takes a STAGE as Triton's tutorial does: one call with FULL for the key
#     blocks every row sees (no mask at all), one with MASKED for the diagonal / ragged ones. The
#     backward keeps one loop per kernel and tests each block against the same ranges (dQ:
#     key_range, as the forward; dK/dV: query_range for the causal diagonal, and its own ragged key
#     block masked on every query block): split into two stages, dK/dV spills more on sm_90 and
#     begins to spill on sm_75 (compile report, triton 3.9).
#   * Offsets: a tensor may hold 2^31 elements or more (a decode cache of B = 72, Hkv = 8,
#     Nmax = 32768, d = 128 holds 2.4e9, 4.8 GB in fp16), where a 32-bit offset wraps silently or
#     faults.
#     So every index that multiplies a stride — batch b, head h, rows — and every (batch·head) row
#     base of the LSE, D and decode-partial buffers is cast to 64 bits first (.to(tl.int64), as
#     Triton's tutorial casts off_z and off_h), then multiplied. Masks, grid decoding and column
#     offsets (offs_d < BLOCK_D <= 256, stride 1) stay 32-bit. The dK/dV kernels walk their group's
#     head pointers instead of recomputing them (see there).
#     tests/kernels/triton/test_triton_offsets.py checks the TTIR and runs views past 2^31 elements
#     in the interpreter.
# Idea: Triton's fused-attention tutorial (its _attn_fwd_inner with a STAGE argument, exp2 with the
#   scale folded into log2 e; off_z.to(tl.int64) * stride_qz for the head's base); our own code,
#   plain pointer arithmetic (no block pointers).
# Limits: helpers take constexpr flags where the kernels differ (CAUSAL, UPCAST, STAGE), so each
#   kernel compiles only the branch it uses. A helper with four arguments or more is called with
#   keywords, so that a change of its signature fails loudly instead of shifting arguments.
# Run: the kernels call these; flashlib.show(kit.attend) displays one.
"""The shared @triton.jit helpers and named constants of flashlib's Triton kernels.

Explained in: notebooks/07_triton."""
from __future__ import annotations

import math

from . import tl, triton

__all__ = ["LOG2E", "LN2", "FULL", "MASKED", "qk_scale", "ceil_div", "block_d", "unflatten", "key_range",
           "query_range", "load_tile", "store_tile", "load_lse2", "load_kv", "softmax_step", "mask_keys",
           "mask_causal", "mask_scores", "hide_nan_values", "attend", "finish", "dkdv_step", "desc_2d"]

# tl.constexpr: Triton reads a global inside a kernel only if it is one (``LOG2E.value`` in Python).
LOG2E = tl.constexpr(math.log2(math.e))   # exp(x) = exp2(x * LOG2E): exp2 is the GPU's native exponential
LN2 = tl.constexpr(math.log(2.0))         # ln(x) = log2(x) * LN2: back from base 2 to the natural log
FULL = tl.constexpr(1)            # attend's STAGE: key blocks every query row sees entirely, no mask
MASKED = tl.constexpr(2)          # attend's STAGE: diagonal and ragged key blocks, masked
_LOG2E = LOG2E.value              # the plain float, for the host (qk_scale runs on every launch)


def qk_scale(scale: float) -> float:
    """The kernels' score multiplier ``scale · log2 e``: S·qk_scale is the scaled score in base 2, so
    exp2(S·qk_scale) = exp(scale·S).  Explained in: notebooks/07_triton.

    Tested in: tests/kernels/triton/test_triton_kit.py.
    """
    return scale * _LOG2E


# Host-side integer helpers for the launchers, in plain Python: triton.cdiv and triton.next_power_of_2
# are Triton ConstexprFunctions (triton 3.9), a few microseconds of wrapping per call on the host.
def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ints, as triton.cdiv.  Explained in: notebooks/07_triton.

    Tested in: tests/kernels/triton/test_triton_host.py.
    """
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1), as triton.next_power_of_2.
    Explained in: notebooks/07_triton.

    Tested in: tests/kernels/triton/test_triton_host.py.
    """
    return 1 << max(n - 1, 0).bit_length()


def block_d(d: int) -> int:
    """The head-dim tile the kernels use for head dim ``d``: the next power of two >= d, at least 16
    (tl.arange and tl.dot need a power of two >= 16; loads mask the padding).

    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_host.py.
    """
    return max(16, next_pow2(d))


@triton.jit
def unflatten(index, n):
    """``(index % n, index // n)``: a flat-grid index split into its fastest
    count and the rest.

    Explained in: notebooks/07_triton."""
    return index % n, index // n


@triton.jit
def key_range(start_m, NQ, NK, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr):
    """``(lo_masked, hi)`` for the query block starting at row ``start_m``:
    the key blocks in [0, lo_masked) are seen by every row of the block (no
    mask needed), those in [lo_masked, hi) are the diagonal and ragged ones
    (masked), keys from hi on are hidden from every row (never loaded).

    Explained in: notebooks/07_triton."""
    if CAUSAL:
        offset = NK - NQ              # query i sees key j iff j <= i + offset
        last_row = tl.minimum(start_m + BLOCK_M, NQ) - 1
        hi = tl.minimum(tl.maximum(last_row + offset + 1, 0), NK)
        seen_by_all = tl.minimum(tl.maximum(start_m + offset + 1, 0), NK)
    else:
        hi = NK
        seen_by_all = NK
    return (seen_by_all // BLOCK_N) * BLOCK_N, hi


@triton.jit
def query_range(start_n, NQ, NK, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """``(lo, hi_masked)`` for the key block starting at key ``start_n``:
    causal, query rows before lo see none of it (skipped; lo is a multiple
    of BLOCK_M), a query block starting before hi_masked sees only part of
    it (the diagonal: causal mask), rows from hi_masked on see all of it.
    (Keys past NK, in a ragged last key block, are the same for every query
    block: masked on each.)

    Explained in: notebooks/07b_backward_decoding."""
    if CAUSAL:
        offset = NK - NQ              # query i sees key j iff j <= i + offset
        lo = (tl.maximum(start_n - offset, 0) // BLOCK_M) * BLOCK_M
        # the first query row that sees key start_n + BLOCK_N - 1
        hi_masked = tl.minimum(
            tl.maximum(start_n + BLOCK_N - 1 - offset, 0), NQ)
    else:
        lo = 0
        hi_masked = 0
    return lo, hi_masked


@triton.jit
def load_tile(row_ptrs, row_ok, offs_d, D, UPCAST: tl.constexpr):
    """The (R, BLOCK_D) tile whose row r starts at ``row_ptrs[r]``: rows
    where ``row_ok`` is False (None: every row is in bounds) and the padding
    columns ``offs_d >= D`` read 0, which changes no dot product. UPCAST:
    returned in fp32 (triton 3.9's interpreter computes bf16 tl.dot wrongly).

    Explained in: notebooks/07_triton."""
    mask = offs_d[None, :] < D
    if row_ok is not None:
        mask = row_ok[:, None] & mask
    tile = tl.load(row_ptrs[:, None] + offs_d[None, :], mask=mask, other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def store_tile(row_ptrs, row_ok, offs_d, D, tile):
    """Store ``tile`` (R, BLOCK_D), converted to the pointers' type, except
    masked rows and padding.

    Explained in: notebooks/07_triton."""
    tl.store(row_ptrs[:, None] + offs_d[None, :],
             tile.to(row_ptrs.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < D))


@triton.jit
def load_lse2(ptrs, row_ok):
    """The rows' saved log-sum-exp, in base 2 (x log2 e) to match the
    kernels' exp2. Rows past the end, and rows that saw no key (lse = -inf),
    get +inf: then P = exp2(S - inf) = 0 for them, not NaN.

    Explained in: notebooks/07b_backward_decoding."""
    lse = tl.load(ptrs, mask=row_ok, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E


@triton.jit
def mask_keys(s, offs_n, NK):
    """Scores S (BLOCK_M, BLOCK_N) of keys past NK (a ragged last key block)
    become -inf.

    Explained in: notebooks/07_triton."""
    return tl.where(offs_n[None, :] < NK, s, float("-inf"))


@triton.jit
def mask_causal(s, offs_m, offs_n, offset):
    """Scores S (BLOCK_M, BLOCK_N) that the causal mask hides become -inf:
    query i sees key j iff j <= i + offset, offset = Nk - Nq (bottom-right
    aligned).

    Explained in: notebooks/07_triton."""
    visible = offs_n[None, :] <= offs_m[:, None] + offset
    return tl.where(visible, s, float("-inf"))


@triton.jit
def mask_scores(s, offs_m, offs_n, NK, offset, CAUSAL: tl.constexpr):
    """The mask of a partial block: :func:`mask_keys`, and
    :func:`mask_causal` if CAUSAL.

    Explained in: notebooks/07_triton."""
    s = mask_keys(s, offs_n, NK)
    if CAUSAL:
        s = mask_causal(s=s, offs_m=offs_m, offs_n=offs_n, offset=offset)
    return s


@triton.jit
def hide_nan_values(v, offs_m, offs_n, offset):
    """For a causal diagonal block: ``(V_j, row_nan)`` with V_j's NaNs
    replaced by 0, so that a key the causal mask hides from row i (P_ij = 0)
    adds 0, not 0 * NaN = NaN, to row i; ``row_nan`` (BLOCK_M,) says which
    rows see a key whose value row holds a NaN: query i sees keys
    j <= i + offset, a prefix, so it sees one iff it sees the first one (no
    (BLOCK_M, BLOCK_N) matrix, kept in registers, needed). The caller makes
    their acc NaN. Keys past NK are loaded as 0 and need nothing.

    Explained in: notebooks/07_triton."""
    is_nan = v != v                                       # (BLOCK_N, BLOCK_D)
    key_nan = tl.max(is_nan.to(tl.int32), 1) > 0   # (BLOCK_N,): V_j has a NaN
    # the first such key (or none)
    first = tl.min(tl.where(key_nan, offs_n, 2147483647), 0)
    # row i sees it iff first <= i + offset
    return tl.where(is_nan, 0.0, v).to(v.dtype), offs_m + offset >= first


@triton.jit
def softmax_step(m_i, l_i, acc, s, v, PRECISION: tl.constexpr,
                 MAY_BE_EMPTY: tl.constexpr):
    """One step of the online softmax (Algorithm 1, lines 9-10, base 2) for a
    block of scores ``s`` (BLOCK_M, BLOCK_N), already scaled by
    scale·log2 e, and its values ``v`` (BLOCK_N, BLOCK_D). Returns the new
    ``(m_i, l_i, acc)``. MAY_BE_EMPTY: some row may have seen only -inf so
    far (masked blocks); it then subtracts 0 instead of -inf, so no
    (-inf) - (-inf) = NaN.

    Explained in: notebooks/07_triton."""
    m_new = tl.maximum(m_i, tl.max(s, 1))             # line 9: m_i^(j)
    m_use = m_new
    if MAY_BE_EMPTY:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_use[:, None])              # P~_ij
    alpha = tl.math.exp2(m_i - m_use)                 # e^(m^(j-1) - m^(j))
    l_i = l_i * alpha + tl.sum(p, 1)                  # l_i^(j)
    # line 10: O_i^(j) = diag(alpha) O_i^(j-1) + P~_ij V_j
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v,
                                        input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def finish(acc, l_i, m_i):
    """Algorithm 1, lines 12-13: ``(O_i, L_i)`` = (acc / l_i,
    ln 2 · (m_i + log2 l_i)), the LSE in the natural log. A row that saw no
    key (l_i = 0 exactly) gets O = 0 and L = -inf; a row that saw a NaN (l_i
    or acc NaN) gets NaN, never the "saw nothing" answer (the test is
    l == 0, not l > 0).

    Explained in: notebooks/07_triton."""
    empty = l_i == 0.0            # NaN == 0 is False: a NaN row is not "empty"
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = (m_i + tl.math.log2(l_safe)) * LN2
    return o, tl.where(empty, float("-inf"), lse)


@triton.jit
def load_kv(k_base, v_base, rows, stride_kn, stride_vn, NK, offs_d, D,
            STAGE: tl.constexpr, UPCAST: tl.constexpr):
    """K_j and V_j (BLOCK_N, BLOCK_D) for key rows ``rows``: bounds-checked
    in the MASKED stage only (a FULL block lies inside [0, NK)).

    Explained in: notebooks/07_triton."""
    offs = rows.to(tl.int64)      # rows x row stride can pass 2^31: 64 bits
    k_rows = k_base + offs * stride_kn
    v_rows = v_base + offs * stride_vn
    if STAGE == MASKED:
        k = load_tile(row_ptrs=k_rows, row_ok=rows < NK, offs_d=offs_d, D=D,
                      UPCAST=UPCAST)
        v = load_tile(row_ptrs=v_rows, row_ok=rows < NK, offs_d=offs_d, D=D,
                      UPCAST=UPCAST)
    else:
        k = load_tile(row_ptrs=k_rows, row_ok=None, offs_d=offs_d, D=D,
                      UPCAST=UPCAST)
        v = load_tile(row_ptrs=v_rows, row_ok=None, offs_d=offs_d, D=D,
                      UPCAST=UPCAST)
    return k, v


@triton.jit
def attend(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
           offs_m, offs_d, lo, hi, NK, offset, D, qk_scale,
           BLOCK_N: tl.constexpr, STAGE: tl.constexpr, CAUSAL: tl.constexpr,
           UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Algorithm 1, lines 6-10, for the key blocks starting in [lo, hi):
    load K_j, V_j, S = Q K_j^T, one online-softmax step. STAGE FULL: blocks
    every row sees entirely — no mask at all; MASKED: diagonal and ragged
    blocks — :func:`mask_scores`, and causal: :func:`hide_nan_values` (a NaN
    in a value row the mask hides from row i leaves row i alone).
    ``k_base``/``v_base`` point at key 0, column 0.

    Explained in: notebooks/07_triton."""
    offs_n = tl.arange(0, BLOCK_N)          # (BLOCK_N,) key offsets in a block
    for start_n in range(lo, hi, BLOCK_N):
        rows = start_n + offs_n
        k, v = load_kv(                                           # line 7
            k_base=k_base, v_base=v_base, rows=rows, stride_kn=stride_kn,
            stride_vn=stride_vn, NK=NK, offs_d=offs_d, D=D, STAGE=STAGE,
            UPCAST=UPCAST)
        # line 8: S_ij, in base 2
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if STAGE == MASKED:
            s = mask_scores(s=s, offs_m=offs_m, offs_n=rows, NK=NK,
                            offset=offset, CAUSAL=CAUSAL)
            if CAUSAL:        # NaN rule: hidden V NaNs must not spread ...
                v, row_nan = hide_nan_values(v=v, offs_m=offs_m, offs_n=rows,
                                             offset=offset)
        m_i, l_i, acc = softmax_step(                     # lines 9-10
            m_i=m_i, l_i=l_i, acc=acc, s=s, v=v, PRECISION=PRECISION,
            MAY_BE_EMPTY=STAGE == MASKED)
        if STAGE == MASKED:
            if CAUSAL:        # ... but a NaN a row sees makes it NaN
                acc = tl.where(row_nan[:, None], float("nan"), acc)
    return acc, l_i, m_i


@triton.jit
def desc_2d(base, N, D, stride_n, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """A tensor descriptor of the (N, D) matrix at ``base`` with row stride
    ``stride_n``, read and written in (ROWS, BLOCK_D) tiles: rows past N and
    columns past D load as 0 and are never stored. On sm_90 its loads and
    stores are TMA copies (the TMA kernels: fa2_fwd_v4_tma, fa2_bwd_v5_tma).

    Explained in: notebooks/07c_hopper."""
    return tl.make_tensor_descriptor(base, shape=[N, D], strides=[stride_n, 1],
                                     block_shape=[ROWS, BLOCK_D])


@triton.jit
def dkdv_step(dk, dv, q, do, k, v, LSE, DELTA, start_m, offs_m, offs_n,
              hi_masked, NQ, NK, qk_scale,
              CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """Algorithm 2, lines 9-16 without line 15: query block ``q``, ``do``
    (BLOCK_M, BLOCK_D), rows ``offs_m`` from ``start_m``, against key block
    ``k``, ``v`` (BLOCK_N, BLOCK_D), keys ``offs_n``; ``LSE``/``DELTA``
    point at the head's row 0. Returns dK_j, dV_j with this block added (dK
    not yet scaled). The causal mask only where the block starts before
    ``hi_masked`` (the diagonal, :func:`query_range`); keys past NK on every
    block.

    Explained in: notebooks/07b_backward_decoding."""
    row_ok = offs_m < NQ
    lse = load_lse2(LSE + offs_m, row_ok)             # line 9: L_i and D_i
    delta = tl.load(DELTA + offs_m, mask=row_ok, other=0.0)
    # line 10: S_ij, in base 2
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if CAUSAL:
        if start_m < hi_masked:           # a diagonal block: the causal mask
            s = mask_causal(s=s, offs_m=offs_m, offs_n=offs_n,
                            offset=NK - NQ)
    s = mask_keys(s, offs_n, NK)          # keys past NK, on every block
    p = tl.math.exp2(s - lse[:, None])                # line 11: P_ij
    # line 12: dV_j += P_ij^T dO_i
    dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
    # line 13: dP_ij = dO_i V_j^T
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])                    # line 14: dS_ij
    # line 16: dK_j += dS_ij^T Q_i
    dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    return dk, dv
