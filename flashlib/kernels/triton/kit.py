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
#   * The variants of real models (issue 24; notebooks/09_real_models), each a constexpr flag of
#     the kernels that defaults to off, so a dense call compiles the dense kernel exactly as
#     before (the compile report's rows are unchanged):
#     - the band (sliding window, causal folded in): band (host) gives (win_l, win_r), query i
#       sees key j iff i + off - win_l <= j <= i + off + win_r; band_key_range (a query block's key
#       blocks) and band_query_range (a key block's query blocks) split them into empty (never
#       loaded), partial (masked: the left edge, the right edge / diagonal / ragged end) and full
#       (no mask), key_range and query_range generalised; band_visible / mask_band mask a partial
#       block, hide_nan_values_band keeps the NaN rule for any mask;
#     - score_mods: softcap_scores (softcap · tanh(score / softcap), with a tanh of our own:
#       Triton has none that runs everywhere) then alibi_bias (-slope · |i + off - j|, one slope
#       per ROW: decode stacks rows of several query heads), on the scaled base-2 scores, before
#       the mask and the exp2 (softcap and slopes come in base-2 units: x log2 e);
#     - add_sink: a sink merged into finished rows (a merge with an empty-value state,
#       lse' = logaddexp(lse, sink)); a row that saw no key gets o = 0, lse = sink;
#     - dropout_keep: dropout's keep mask from tl.rand on 64-bit counters
#       (flashlib.ladder.dropout's definition), applied to P before P V only (l keeps the
#       undropped P); seed and offset cross as two int32 words each (split32 / join64).
#   * Paged caches (issue 25; notebooks/10_serving), a constexpr PAGED of load_kv and attend that
#     defaults to off (the dense kernels compile as before): page_slots maps logical key rows to
#     (page, slot) through the sequence's row of a block table — one pointer per key row, a
#     gather, so a key block may span pages and any page size works; table entries of rows past
#     NK are not read, page indices are clamped into the cache.
# Idea: Triton's fused-attention tutorial (its _attn_fwd_inner with a STAGE argument, exp2 with the
#   scale folded into log2 e; off_z.to(tl.int64) * stride_qz for the head's base); our own code,
#   plain pointer arithmetic (no block pointers). The variants: flash-attn's semantics.
# Limits: helpers take constexpr flags where the kernels differ (CAUSAL, UPCAST, STAGE, and the
#   variants' WINDOW, SOFTCAP, ALIBI, DROPOUT, and PAGED), so each kernel compiles only the branch
#   it uses. A helper with four arguments or more is called with keywords, so that a change of its
#   signature fails loudly instead of shifting arguments.
# Run: the kernels call these; flashlib.show(kit.attend) displays one.
"""The shared @triton.jit helpers and named constants of flashlib's Triton kernels.

Explained in: notebooks/07_triton."""
from __future__ import annotations

import math

from . import tl, triton

__all__ = ["LOG2E", "LN2", "FULL", "MASKED", "qk_scale", "ceil_div", "block_d", "unflatten", "key_range",
           "query_range", "dkdv_query_range", "load_tile", "store_tile", "load_lse2", "load_kv", "softmax_step", "mask_keys",
           "mask_causal", "mask_scores", "hide_nan_values", "attend", "finish", "dkdv_step", "desc_2d",
           "band", "split32", "band_keys", "band_key_range", "band_query_range", "band_visible",
           "mask_band", "hide_nan_values_band", "tanh", "softcap_scores", "alibi_bias", "score_mods",
           "join64", "dropout_keep", "add_sink", "logaddexp", "page_slots", "sequence"]

# tl.constexpr: Triton reads a global inside a kernel only if it is one (``LOG2E.value`` in Python).
LOG2E = tl.constexpr(math.log2(math.e))   # exp(x) = exp2(x * LOG2E): exp2 is the GPU's native exponential
LN2 = tl.constexpr(math.log(2.0))         # ln(x) = log2(x) * LN2: back from base 2 to the natural log
FULL = tl.constexpr(1)            # attend's STAGE: key blocks every query row sees entirely, no mask
MASKED = tl.constexpr(2)          # attend's STAGE: diagonal and ragged key blocks, masked
_LOG2E = LOG2E.value              # the plain float, for the host (qk_scale runs on every launch)
# Triton's uint_to_uniform_float scale: the largest with (2^31 - 1) x scale < 1 in fp32 (dropout)
TO_UNIFORM = tl.constexpr(4.6566127342e-10)


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


def band(window_size, causal: bool, nq: int, nk: int) -> tuple[int, int]:
    """The kernels' window ``(win_l, win_r)`` for ``window_size = (left, right)`` (-1: unbounded) and
    ``causal``: query i sees key j iff ``i + off - win_l <= j <= i + off + win_r`` (off = Nk - Nq),
    with no -1 left. causal is ``right = 0`` (they combine: the smaller right wins); an unbounded
    side becomes a bound no row reaches (left: Nk, right: Nq), and a larger one is clamped to it,
    so ``i + off +- win`` stays far inside int32.

    Explained in: notebooks/09_real_models.
    Tested in: tests/kernels/triton/test_triton_kit.py.
    """
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    win_l = nk if left < 0 else min(left, nk)
    win_r = nq if right < 0 else min(right, nq)
    return win_l, win_r


def split32(x: int) -> tuple[int, int]:
    """``(lo, hi)``: the 64-bit int ``x``'s low and high 32-bit words, each as a signed int32 (a
    kernel's i32 scalar), for :func:`join64` to put back together in a kernel (dropout's seed and
    offset, which pass 2^31).

    Explained in: notebooks/09_real_models.
    Tested in: tests/kernels/triton/test_triton_kit.py.
    """
    def signed(w):
        return w - (1 << 32) if w >= 1 << 31 else w
    return signed(x & 0xFFFFFFFF), signed((x >> 32) & 0xFFFFFFFF)


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
def band_keys(first_row, last_row, NK, offset, WIN_L, WIN_R):
    """``(lo, hi)``: the keys [lo, hi) that query rows ``first_row`` ..
    ``last_row`` see together under the band (:func:`band`: row i sees key j
    iff i + offset - WIN_L <= j <= i + offset + WIN_R), clipped to [0, NK);
    lo == hi when they see none. (A row's keys are an interval that moves
    one key per row, so the rows' union is one interval too.)

    Explained in: notebooks/09_real_models."""
    lo = tl.minimum(tl.maximum(first_row + offset - WIN_L, 0), NK)
    hi = tl.minimum(tl.maximum(last_row + offset + WIN_R + 1, 0), NK)
    return lo, tl.maximum(hi, lo)


@triton.jit
def band_key_range(start_m, NQ, NK, WIN_L, WIN_R, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """``(lo, lo_full, hi_full, hi)`` for the query block starting at row
    ``start_m`` under the band (:func:`band`; offset Nk - Nq): key blocks
    starting in [lo, lo_full) are partial (the band's left edge: masked),
    those in [lo_full, hi_full) are full (every row of the block sees every
    key, all below NK: no mask), those in [hi_full, hi) partial again (the
    right edge, the diagonal, the ragged end: masked); keys outside [lo, hi)
    are seen by no row (empty: never loaded). lo, lo_full, hi_full are
    multiples of BLOCK_N (hi is not: loops run ``range(lo_full, hi_full,
    BLOCK_N)`` and so on). A block whose rows see no key gets all four 0.
    :func:`key_range` is its causal-only special case (lo = 0).

    Explained in: notebooks/09_real_models."""
    offset = NK - NQ
    last_row = tl.minimum(start_m + BLOCK_M, NQ) - 1
    lo_key, hi = band_keys(start_m, last_row, NK, offset, WIN_L, WIN_R)
    empty = hi <= lo_key
    # keys every row sees: from the last row's left edge to the first row's
    # right edge (clipped at 0 first: // of a negative differs in Triton)
    full_lo = tl.maximum(last_row + offset - WIN_L, 0)
    full_hi = tl.maximum(tl.minimum(start_m + offset + WIN_R + 1, NK), 0)
    lo = tl.where(empty, 0, (lo_key // BLOCK_N) * BLOCK_N)
    hi = tl.where(empty, 0, hi)
    end = tl.cdiv(hi, BLOCK_N) * BLOCK_N      # the end of the last block
    lo_full = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, lo),
                         end)
    hi_full = tl.minimum(tl.maximum((full_hi // BLOCK_N) * BLOCK_N, lo_full),
                         end)
    return lo, lo_full, hi_full, hi


@triton.jit
def band_query_range(start_n, NQ, NK, WIN_L, WIN_R, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """``(lo, lo_full, hi_full, hi)`` for the key block starting at key
    ``start_n`` under the band (:func:`band`): query blocks starting in
    [lo, lo_full) see it in part (masked), those in [lo_full, hi_full) see
    every key of it below NK (no band mask), those in [hi_full, hi) in part;
    rows outside [lo, hi) see none of it (never visited). lo, lo_full and
    hi_full are multiples of BLOCK_M; all four 0 if no row sees the block.
    Keys past NK (a ragged last key block) are not counted: the caller masks
    them on every query block, as :func:`dkdv_step` does. The backward's
    dK/dV loop: :func:`query_range` generalised.

    Explained in: notebooks/09_real_models."""
    # row i sees key j iff j - offset - WIN_R <= i <= j - offset + WIN_L
    offset = NK - NQ
    last_key = tl.minimum(start_n + BLOCK_N, NK) - 1
    first = tl.minimum(tl.maximum(start_n - offset - WIN_R, 0), NQ)
    hi = tl.minimum(tl.maximum(last_key - offset + WIN_L + 1, 0), NQ)
    empty = hi <= first
    # rows that see every key of the block: [full_lo, full_hi)
    full_lo = tl.maximum(last_key - offset - WIN_R, 0)
    full_hi = tl.maximum(tl.minimum(start_n - offset + WIN_L + 1, NQ), 0)
    lo = tl.where(empty, 0, (first // BLOCK_M) * BLOCK_M)
    hi = tl.where(empty, 0, hi)
    end = tl.cdiv(hi, BLOCK_M) * BLOCK_M
    lo_full = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_M) * BLOCK_M, lo),
                         end)
    # a block is full if its rows below NQ are: the last block may be short
    hi_full = tl.where(full_hi >= NQ, end, (full_hi // BLOCK_M) * BLOCK_M)
    hi_full = tl.minimum(tl.maximum(hi_full, lo_full), end)
    return lo, lo_full, hi_full, hi


@triton.jit
def dkdv_query_range(start_n, NQ, NK, win_l, win_r, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                     WINDOW: tl.constexpr):
    """``(lo, lo_full, hi_full, hi, hi_masked)``: the query blocks a dK/dV
    kernel visits for the key block starting at ``start_n`` (both dK/dV
    kernels, fa2_bwd_v2's and fa2_bwd_v5_tma's). WINDOW: the band's
    (:func:`band_query_range`; hi_masked 0). Else causal or dense:
    :func:`query_range`'s (lo, hi_masked), every block from lo to NQ visited
    (lo_full = hi_full = 0: :func:`dkdv_step` masks by hi_masked).

    Explained in: notebooks/09_real_models."""
    if WINDOW:
        lo, lo_full, hi_full, hi = band_query_range(
            start_n=start_n, NQ=NQ, NK=NK, WIN_L=win_l, WIN_R=win_r,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
        hi_masked = 0
    else:
        # Causal: query blocks before lo see none of key block j; those
        # starting before hi_masked see part of it.
        lo, hi_masked = query_range(
            start_n=start_n, NQ=NQ, NK=NK, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            CAUSAL=CAUSAL)
        lo_full, hi_full, hi = 0, 0, NQ
    return lo, lo_full, hi_full, hi, hi_masked


@triton.jit
def sequence(CU, b, N, T):
    """Ragged batches: ``(start, n)`` of sequence ``b``, rows ``CU[b]`` ..
    ``CU[b+1]`` of cu_seqlens ``CU``, clamped so that a bad CU on a GPU
    (never read back to check) reads nothing out of bounds: start in
    [0, T] (T: the total rows), n in [0, min(N, T - start)] (N: the
    max_seqlen that sized the grid).

    Explained in: notebooks/10_serving."""
    start = tl.minimum(tl.maximum(tl.load(CU + b), 0), T)
    n = tl.minimum(tl.maximum(tl.load(CU + b + 1) - start, 0),
                   tl.minimum(N, T - start))
    return start, n


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
def band_visible(qpos, offs_n, offset, WIN_L, WIN_R):
    """(BLOCK_M, BLOCK_N) bool: query ``qpos[r]`` sees key ``offs_n[c]``
    under the band (:func:`band`): qpos + offset - WIN_L <= key <=
    qpos + offset + WIN_R. (Keys past NK: :func:`mask_keys`.)

    Explained in: notebooks/09_real_models."""
    diag = qpos[:, None] + offset
    keys = offs_n[None, :]
    return (keys >= diag - WIN_L) & (keys <= diag + WIN_R)


@triton.jit
def mask_band(s, qpos, offs_n, NK, offset, WIN_L, WIN_R):
    """The mask of a partial block under the band: scores of keys past NK
    and of keys outside :func:`band_visible` become -inf.

    Explained in: notebooks/09_real_models."""
    s = mask_keys(s, offs_n, NK)
    visible = band_visible(qpos=qpos, offs_n=offs_n, offset=offset,
                           WIN_L=WIN_L, WIN_R=WIN_R)
    return tl.where(visible, s, float("-inf"))


@triton.jit
def hide_nan_values_band(v, visible):
    """:func:`hide_nan_values` for any mask ``visible`` (BLOCK_M, BLOCK_N),
    such as the band's, whose rows need not see a prefix: ``(V_j, row_nan)``
    with V_j's NaNs replaced by 0 and ``row_nan`` (BLOCK_M,) the rows that
    see a key whose value row holds a NaN (the caller makes their acc NaN).

    Explained in: notebooks/09_real_models."""
    is_nan = v != v                                       # (BLOCK_N, BLOCK_D)
    key_nan = tl.max(is_nan.to(tl.int32), 1) > 0   # (BLOCK_N,): V_j has a NaN
    seen_nan = (visible & key_nan[None, :]).to(tl.int32)
    return tl.where(is_nan, 0.0, v).to(v.dtype), tl.max(seen_nan, 1) > 0


@triton.jit
def tanh(x):
    """tanh, elementwise, in fp32 (Triton has no portable one): odd, from
    ``e = exp(-2|x|)`` as (1 - e) / (1 + e), which is -> 1 without overflow
    for large |x|, and from its Taylor series where |x| < 0.125 (there
    1 - e would cancel). NaN stays NaN.

    Explained in: notebooks/09_real_models."""
    a = tl.abs(x)
    e = tl.math.exp2(a * (-2.0 * LOG2E))
    big = (1.0 - e) / (1.0 + e)
    a2 = a * a    # a (1 - a^2/3 + 2 a^4/15 - 17 a^6/315): error < 1e-10 here
    small = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0
                                               + a2 * (-17.0 / 315.0))))
    t = tl.where(a < 0.125, small, big)
    return tl.where(x < 0, -t, t)


@triton.jit
def softcap_scores(s, softcap2):
    """Softcapping in the kernels' base-2 units: ``softcap2 · tanh(s /
    softcap2)`` with ``softcap2 = softcap · log2 e`` (s = score · log2 e, so
    this is softcap · tanh(score / softcap) · log2 e). Its derivative is
    ``1 - t²`` with ``t = result / softcap2`` (the backward's).

    Explained in: notebooks/09_real_models."""
    return softcap2 * tanh(s / softcap2)


@triton.jit
def alibi_bias(s, qpos, offs_n, offset, slopes2):
    """ALiBi: ``s - slopes2[r] · |qpos[r] + offset - key|`` for scores s
    (BLOCK_M, BLOCK_N) of rows at query positions ``qpos`` and keys
    ``offs_n``; ``slopes2`` (BLOCK_M,) one slope per ROW in base-2 units
    (slope · log2 e), so stacked rows of different query heads (decode's
    GQA) each get their own head's.

    Explained in: notebooks/09_real_models."""
    dist = tl.abs(qpos[:, None] + offset - offs_n[None, :]).to(tl.float32)
    return s - slopes2[:, None] * dist


@triton.jit
def score_mods(s, qpos, offs_n, offset, softcap2, slopes2,
               SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """The score variants, in flash-attn's order, on scaled base-2 scores:
    :func:`softcap_scores` if SOFTCAP, then :func:`alibi_bias` if ALIBI
    (both before the mask and the exp2). Neither: ``s`` unchanged.

    Explained in: notebooks/09_real_models."""
    if SOFTCAP:
        s = softcap_scores(s, softcap2)
    if ALIBI:
        s = alibi_bias(s=s, qpos=qpos, offs_n=offs_n, offset=offset,
                       slopes2=slopes2)
    return s


@triton.jit
def join64(lo, hi):
    """The 64-bit int whose 32-bit words :func:`split32` gave as ``(lo,
    hi)`` (signed int32 scalars; either may be a constexpr where the JIT
    specialised a 1).

    Explained in: notebooks/09_real_models."""
    lo64 = tl.cast(lo, tl.int64)
    lo64 = tl.where(lo64 < 0, lo64 + 4294967296, lo64)    # + 2^32
    return tl.cast(hi, tl.int64) * 4294967296 + lo64


@triton.jit
def dropout_keep(seed, base, qpos, offs_n, NK, p):
    """Dropout's keep mask Z (BLOCK_M, BLOCK_N) of rows ``qpos`` and keys
    ``offs_n`` (flashlib.ladder.dropout's definition): counter ``c = base +
    qpos · NK + key`` (64 bits; ``base = offset + (b·H + h)·Nq·NK``), ``u``
    = Philox4x32-10 of ``(lo(c), hi(c), 0, 0)`` with key ``seed`` (int64),
    first word, as ``tl.rand(seed, c)`` on triton 3.6+; kept iff ``u >= p``
    (fp32). The words are made here, in 32 bits (a carry from the low word),
    not left to ``tl.rand``: triton 3.2 and 3.3 run a 64-bit Philox on an
    int64 counter (other bits), and a (BLOCK_M, BLOCK_N) int64 block costs
    registers.

    Explained in: notebooks/09_real_models."""
    row = base + qpos.to(tl.int64) * NK          # (BLOCK_M,) counter of key 0
    row_lo = row.to(tl.uint32)
    row_hi = (row >> 32).to(tl.uint32)
    lo = row_lo[:, None] + offs_n.to(tl.uint32)[None, :]       # mod 2^32
    hi = row_hi[:, None] + (lo < row_lo[:, None]).to(tl.uint32)  # + carry
    zero = lo * 0
    word, _, _, _ = tl.philox(seed, lo, hi, zero, zero)
    # Triton's uint_to_uniform_float: int32 bits, x < 0 -> ~x, x 2^-31
    x = word.to(tl.int32, bitcast=True)
    x = tl.where(x < 0, ~x, x)
    return x.to(tl.float32) * TO_UNIFORM >= p


@triton.jit
def logaddexp(a, b):
    """``ln(e^a + e^b)`` elementwise, natural log, through exp2/log2: -inf if
    both are -inf, +inf if either is, NaN if either is NaN.

    Explained in: notebooks/09_real_models."""
    m = tl.maximum(a, b)
    m_use = tl.where(tl.abs(m) == float("inf"), 0.0, m)   # no inf - inf
    total = (tl.math.exp2((a - m_use) * LOG2E)
             + tl.math.exp2((b - m_use) * LOG2E))
    return m_use + tl.math.log2(total) * LN2


@triton.jit
def add_sink(o, lse, sink):
    """A sink merged into finished rows (:func:`finish`'s ``o``, ``lse``):
    the merge with an empty-value state of log-sum-exp ``sink`` (BLOCK_M,),
    natural log: ``lse' = logaddexp(lse, sink)``, ``o' = o · exp(lse -
    lse')``. A row that saw no key (o = 0, lse = -inf) gets o = 0,
    lse = sink; never NaN unless the row is.

    Explained in: notebooks/09_real_models."""
    new = logaddexp(lse, sink)
    w = tl.where(lse == float("-inf"), 0.0,
                 tl.math.exp2((lse - new) * LOG2E))
    return o * w[:, None], new


@triton.jit
def softmax_step(m_i, l_i, acc, s, v, PRECISION: tl.constexpr,
                 MAY_BE_EMPTY: tl.constexpr, keep=None,
                 DROPOUT: tl.constexpr = False):
    """One step of the online softmax (Algorithm 1, lines 9-10, base 2) for a
    block of scores ``s`` (BLOCK_M, BLOCK_N), already scaled by
    scale·log2 e, and its values ``v`` (BLOCK_N, BLOCK_D). Returns the new
    ``(m_i, l_i, acc)``. MAY_BE_EMPTY: some row may have seen only -inf so
    far (masked blocks); it then subtracts 0 instead of -inf, so no
    (-inf) - (-inf) = NaN. DROPOUT: only the kept P (``keep``,
    :func:`dropout_keep`) multiplies V; l sums the undropped P (the caller
    scales O by 1 / (1 - p)).

    Explained in: notebooks/07_triton."""
    m_new = tl.maximum(m_i, tl.max(s, 1))             # line 9: m_i^(j)
    m_use = m_new
    if MAY_BE_EMPTY:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_use[:, None])              # P~_ij
    alpha = tl.math.exp2(m_i - m_use)                 # e^(m^(j-1) - m^(j))
    l_i = l_i * alpha + tl.sum(p, 1)                  # l_i^(j)
    if DROPOUT:                       # P~ o Z: dropped entries add nothing
        p = tl.where(keep, p, 0.0)
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
def page_slots(table, rows, row_ok, page_size, num_pages):
    """``(page, slot)`` int64 of logical key rows ``rows`` in a paged cache:
    row t lives in page ``table[t // page_size]`` (``table``: the sequence's
    row of the block table, contiguous), at slot ``t % page_size``. Only the
    entries of rows where ``row_ok`` are read (a table entry past the
    sequence's length may be garbage: page 0 is returned, never loaded by
    the caller); a page index is clamped into [0, num_pages - 1], so a bad
    table reads inside the cache (no host check on a GPU).

    Explained in: notebooks/10_serving."""
    page = tl.load(table + rows // page_size, mask=row_ok, other=0)
    page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
    return page, (rows % page_size).to(tl.int64)


@triton.jit
def load_kv(k_base, v_base, rows, stride_kn, stride_vn, NK, offs_d, D,
            STAGE: tl.constexpr, UPCAST: tl.constexpr, table=None,
            page_size=1, num_pages=1, stride_kp=0, stride_vp=0,
            PAGED: tl.constexpr = False):
    """K_j and V_j (BLOCK_N, BLOCK_D) for key rows ``rows``: bounds-checked
    in the MASKED stage only (a FULL block lies inside [0, NK)).

    PAGED (off by default: off, it compiles to nothing): ``rows`` are
    logical keys of a paged cache, gathered row by row (:func:`page_slots`:
    one page per row from ``table``, the sequence's row of the block table)
    at ``page · stride_kp + slot · stride_kn`` from ``k_base`` (likewise V).

    Explained in: notebooks/07_triton."""
    if PAGED:         # a gather: one pointer per key row, any page size
        page, slot = page_slots(table=table, rows=rows, row_ok=rows < NK,
                                page_size=page_size, num_pages=num_pages)
        k_rows = k_base + page * stride_kp + slot * stride_kn
        v_rows = v_base + page * stride_vp + slot * stride_vn
    else:
        offs = rows.to(tl.int64)  # rows x row stride can pass 2^31: 64 bits
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
           UPCAST: tl.constexpr, PRECISION: tl.constexpr, win_l=0, win_r=0,
           softcap2=1.0, slopes2=0.0, seed=0, drop_base=0, drop_p=0.0,
           skip_lo=0, skip_hi=0,
           WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
           ALIBI: tl.constexpr = False, DROPOUT: tl.constexpr = False,
           table=None, page_size=1, num_pages=1, stride_kp=0, stride_vp=0,
           PAGED: tl.constexpr = False):
    """Algorithm 1, lines 6-10, for the key blocks starting in [lo, hi):
    load K_j, V_j, S = Q K_j^T, one online-softmax step. STAGE FULL: blocks
    every row sees entirely — no mask at all; MASKED: diagonal and ragged
    blocks — :func:`mask_scores`, and causal: :func:`hide_nan_values` (a NaN
    in a value row the mask hides from row i leaves row i alone).
    ``k_base``/``v_base`` point at key 0, column 0.

    The variants (each off by default, a constexpr: off, it compiles to
    nothing): SOFTCAP, ALIBI (:func:`score_mods`, on every block, with
    ``softcap2`` and per-row ``slopes2``); WINDOW: the MASKED stage masks
    the band ``win_l``, ``win_r`` (:func:`band`, causal folded in) instead
    of the causal mask, rows at query positions ``offs_m``;
    DROPOUT: P~ = P o Z (:func:`dropout_keep`, counters from ``drop_base``
    with row width NK, ``seed``, ``drop_p``) multiplies V. WINDOW's MASKED
    stage skips the full blocks [skip_lo, skip_hi) (multiples of BLOCK_N;
    :func:`band_key_range`'s lo_full, hi_full): one loop for both edges.
    PAGED: the keys are logical rows of a paged cache, gathered through
    ``table`` (:func:`load_kv`; ``page_size``, ``num_pages``, the page
    strides ``stride_kp``, ``stride_vp``).

    Explained in: notebooks/07_triton."""
    offs_n = tl.arange(0, BLOCK_N)          # (BLOCK_N,) key offsets in a block
    stop = hi
    if WINDOW:
        if STAGE == MASKED:   # the left edge, then (jumping) the right one
            stop = hi - (skip_hi - skip_lo)
    for i in range(lo, stop, BLOCK_N):
        start_n = i
        if WINDOW:
            if STAGE == MASKED:
                start_n = tl.where(i >= skip_lo, i + (skip_hi - skip_lo), i)
        rows = start_n + offs_n
        k, v = load_kv(                                           # line 7
            k_base=k_base, v_base=v_base, rows=rows, stride_kn=stride_kn,
            stride_vn=stride_vn, NK=NK, offs_d=offs_d, D=D, STAGE=STAGE,
            UPCAST=UPCAST, table=table, page_size=page_size,
            num_pages=num_pages, stride_kp=stride_kp, stride_vp=stride_vp,
            PAGED=PAGED)
        # line 8: S_ij, in base 2
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = score_mods(s=s, qpos=offs_m, offs_n=rows, offset=offset,
                       softcap2=softcap2, slopes2=slopes2, SOFTCAP=SOFTCAP,
                       ALIBI=ALIBI)
        if STAGE == MASKED:
            if WINDOW:        # the band, and its hidden V NaNs (NaN rule)
                visible = band_visible(qpos=offs_m, offs_n=rows,
                                       offset=offset, WIN_L=win_l,
                                       WIN_R=win_r)
                s = tl.where(visible, mask_keys(s, rows, NK), float("-inf"))
                v, row_nan = hide_nan_values_band(v, visible)
            else:
                s = mask_scores(s=s, offs_m=offs_m, offs_n=rows, NK=NK,
                                offset=offset, CAUSAL=CAUSAL)
                if CAUSAL:    # NaN rule: hidden V NaNs must not spread ...
                    v, row_nan = hide_nan_values(v=v, offs_m=offs_m,
                                                 offs_n=rows, offset=offset)
        if DROPOUT:
            keep = dropout_keep(seed=seed, base=drop_base, qpos=offs_m,
                                offs_n=rows, NK=NK, p=drop_p)
            m_i, l_i, acc = softmax_step(                 # lines 9-10
                m_i=m_i, l_i=l_i, acc=acc, s=s, v=v, PRECISION=PRECISION,
                MAY_BE_EMPTY=STAGE == MASKED, keep=keep, DROPOUT=True)
        else:
            m_i, l_i, acc = softmax_step(                 # lines 9-10
                m_i=m_i, l_i=l_i, acc=acc, s=s, v=v, PRECISION=PRECISION,
                MAY_BE_EMPTY=STAGE == MASKED)
        if STAGE == MASKED:
            if WINDOW or CAUSAL:    # ... but a NaN a row sees makes it NaN
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
              CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
              lo_full=0, hi_full=0, win_l=0, win_r=0, softcap2=1.0,
              slopes2=0.0, seed=0, drop_base=0, drop_p=0.0,
              WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
              ALIBI: tl.constexpr = False, DROPOUT: tl.constexpr = False):
    """Algorithm 2, lines 9-16 without line 15: query block ``q``, ``do``
    (BLOCK_M, BLOCK_D), rows ``offs_m`` from ``start_m``, against key block
    ``k``, ``v`` (BLOCK_N, BLOCK_D), keys ``offs_n``; ``LSE``/``DELTA``
    point at the head's row 0. Returns dK_j, dV_j with this block added (dK
    not yet scaled). The causal mask only where the block starts before
    ``hi_masked`` (the diagonal, :func:`query_range`); keys past NK on every
    block.

    The variants (constexprs, each off by default: off, it compiles to
    nothing), recomputing the forward's scores: SOFTCAP, ALIBI
    (:func:`softcap_scores`, :func:`alibi_bias` with ``softcap2`` and the
    rows' ``slopes2``), and dS times 1 - t^2 (t = tanh of the capped
    score); WINDOW: instead of the causal mask, the band ``win_l``,
    ``win_r`` where the query block is partial, outside [lo_full, hi_full)
    (:func:`band_query_range`); DROPOUT: Z regenerated, never stored
    (:func:`dropout_keep`: ``seed``, counters from ``drop_base``,
    ``drop_p``), dV_j += (P o Z / (1 - p))^T dO_i and dP o Z / (1 - p) in
    dS. A sink needs nothing here: the saved LSE includes it.

    Explained in: notebooks/07b_backward_decoding."""
    row_ok = offs_m < NQ
    lse = load_lse2(LSE + offs_m, row_ok)             # line 9: L_i and D_i
    delta = tl.load(DELTA + offs_m, mask=row_ok, other=0.0)
    # line 10: S_ij, in base 2
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if SOFTCAP:                       # the forward's order: softcap, ALiBi
        s = softcap_scores(s, softcap2)
        t = s / softcap2              # tanh of the score / softcap
    if ALIBI:
        s = alibi_bias(s=s, qpos=offs_m, offs_n=offs_n, offset=NK - NQ,
                       slopes2=slopes2)
    if WINDOW:
        if (start_m < lo_full) | (start_m >= hi_full):   # partial: the band
            visible = band_visible(qpos=offs_m, offs_n=offs_n,
                                   offset=NK - NQ, WIN_L=win_l, WIN_R=win_r)
            s = tl.where(visible, s, float("-inf"))
    elif CAUSAL:
        if start_m < hi_masked:           # a diagonal block: the causal mask
            s = mask_causal(s=s, offs_m=offs_m, offs_n=offs_n,
                            offset=NK - NQ)
    s = mask_keys(s, offs_n, NK)          # keys past NK, on every block
    p = tl.math.exp2(s - lse[:, None])                # line 11: P_ij
    # line 12: dV_j += P_ij^T dO_i (dropout: P~ = P o Z / (1 - p))
    if DROPOUT:
        keep = dropout_keep(seed=seed, base=drop_base, qpos=offs_m,
                            offs_n=offs_n, NK=NK, p=drop_p)
        p_kept = tl.where(keep, p * (1.0 / (1.0 - drop_p)), 0.0)
        dv += tl.dot(tl.trans(p_kept.to(do.dtype)), do,
                     input_precision=PRECISION)
    else:
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
    if SOFTCAP:           # dS's factor 1 - t^2, folded into P (t dies here)
        p = p * (1.0 - t * t)
    # line 13: dP_ij = dO_i V_j^T
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    if DROPOUT:           # dP o Z / (1 - p)
        dp = tl.where(keep, dp * (1.0 / (1.0 - drop_p)), 0.0)
    ds = p * (dp - delta[:, None])                    # line 14: dS_ij
    # line 16: dK_j += dS_ij^T Q_i
    dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    return dk, dv
