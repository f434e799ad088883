# fa2_bwd_v2.py — FlashAttention-2 backward in Triton, version 2 of the Triton kernels (the default).
# Changed from the NumPy ladder (flashlib.ladder.fa2.backward): three kernels instead of one loop
#   nest.
#   (1) _bwd_preprocess: D = rowsum(dO * O) per query row (Algorithm 2, line 4).
#   (2) _bwd_dkdv: one program per (key block, batch, kv head) holds dK_j, dV_j on chip and loops
#       over the query blocks that can see key block j (and, for GQA, over every query head of the
#       group), recomputing P from the saved LSE (lines 5-18 without line 15).
#   (3) _bwd_dq: one program per (query block, batch, head) holds dQ_i on chip and loops over key
#       blocks, like the forward (line 15, with the loops swapped).
#   The ladder's line 15 adds into dQ from every key block (atomic adds on a GPU: order-dependent,
#   not bitwise reproducible). Splitting dQ into its own kernel recomputes P once more but makes the
#   backward deterministic: every output element is written by exactly one program, no atomics.
#   Causal: query blocks that cannot see a key block are skipped, only the diagonal blocks are
#   masked, with the forward's ranges and masks (flashlib.kernels.triton.kit: key_range,
#   query_range, mask_*); each loop stays one loop that tests its block (kit says why); rows that
#   see no key (lse = -inf, kit.load_lse2) get P = 0, so their gradients are 0, not NaN.
#   The attention variants (issue 24), as the forward's: constexpr switches (WINDOW, SOFTCAP, ALIBI,
#   DROPOUT), each off by default, so that the dense kernels compile exactly as without them (the
#   compile report's rows). Window: the dK/dV kernel visits only the query blocks of its key
#   block's band and the dQ kernel only the key blocks of its query block's (kit.band_query_range,
#   band_key_range), masking the partial ones. Softcap and ALiBi: the scores recomputed as the
#   forward made them, and dS times 1 - tanh^2 of the capped score (ALiBi's slopes get no
#   gradient). Dropout: Z regenerated from the forward's counters (kit.dropout_keep), never stored;
#   dV = (P o Z / (1 - p))^T dO and dP o Z / (1 - p) in dS. Sinks: the saved LSE includes the sink,
#   so P needs nothing; dsinks = -sum exp(sink - lse) D over batch and rows, one torch expression on
#   the host from lse and the preprocess's D.
#   Every grid is flat, as the forward's (flashlib.kernels.triton.flat_grid): program p is block
#   p % n_blocks of (batch, head) — of (batch, kv head) for dK/dV — p // n_blocks (kit.unflatten).
#   Each kernel's KernelSpec (flashlib.kernels.triton.spec), read from its signature, and its config
#   table sit beside it; backward launches the dK/dV spec it is given (dkdv_spec): version 5
#   (fa2_bwd_v5_tma.py) is this backward with its own dK/dV kernel.
#   Ragged batches (issue 25; notebooks/10_serving): the dK/dV and dQ kernels take one more
#   constexpr switch, VARLEN, off by default (the dense kernels compile exactly as before: the
#   compile report's rows), and the arguments CU_Q, CU_K (cu_seqlens, int32) and TQ, TK (the total
#   rows), which a dense call passes unused. On, backward_varlen launches them (DKDV_VARLEN_SPEC,
#   DQ_VARLEN_SPEC) on token-major q, o, do, dq (Tq, H, d) and k, v, dk, dv (Tk, Hkv, d), as
#   (1, H, T, d) views whose row stride is the token stride; lse and D are (H, Tq). The grids are
#   the dense ones with B = the number of sequences and N = max_seqlen: program (b·H + h, block)
#   reads sequence b's rows cu[b]..cu[b+1] (clamped into the tensors: cu_seqlens are never read
#   back on a GPU), exits at once past the sequence's end, and from then on is the dense program on
#   that sequence's pointers and lengths nq_b, nk_b, so every mask, range and variant is per
#   sequence (bottom-right, offset nk_b - nq_b). Only dropout's counters need their own base:
#   sequence b's are the dense ones of its own (1, H, nq_b, nk_b) problem at offset + b·H·max_q·
#   max_k (V25). D = rowsum(dO o O) needs no sequence: the dense preprocess on the (1, H, Tq)
#   view, one program per 64 rows of all sequences. dK/dV stays one program per key block, so the
#   ragged backward is as deterministic as the dense one (no atomics).
# Idea: Dao 2023 (FlashAttention-2), Algorithm 2; the dK/dV + dQ split as in Triton's
#   fused-attention tutorial and flash-attn's deterministic mode (our own code; plain pointers, no
#   block pointers). VARLEN: flash-attn's varlen backward (cu_seqlens, a grid sized by
#   max_seqlen, programs past a sequence's end returning at once).
# Limits: as the forward (head dim <= 256, fp16/bf16/fp32, bf16 needs sm_80+, any B·H, 64-bit
#   offsets: a tensor may hold 2^31 elements or more). The dK/dV configs obey configs.hazard's rule.
#   VARLEN: max_seqlen sizes the grid, so one long sequence among short ones leaves idle programs
#   (they exit at once); the config tables are the dense ones (the compile report of the VARLEN
#   kernels: tests/kernels/triton/test_triton_varlen_bwd.py).
# Run: o = flashlib.attention(q, k, v, backend="triton"); o.backward(do) (kernel=(None, "v2"), the
#   default); interpreted on a CPU. Ragged: flashlib.attention_varlen(q, k, v, cu_q, cu_k, max_q,
#   max_k, backend="triton") and its backward, or fa2_bwd_v2.backward_varlen(q, k, v, o, lse, do,
#   cu_q, cu_k, max_q, max_k, causal=True, scale=d ** -0.5).
"""FlashAttention-2 backward kernels and their launchers (dense and ragged).

Explained in: notebooks/07b_backward_decoding."""
from __future__ import annotations

import dataclasses

import torch

from ...hardware import device_facts
from . import kit, triton, tl
from .configs import Config, Tables, refusal
from .fa2_fwd_v1 import grid as fwd_grid, variant_args as fwd_variant_args
from .spec import KernelSpec, staged_bytes

__all__ = ["backward", "backward_varlen", "grid_preprocess", "grid_dkdv", "grid_dq",
           "PREPROCESS_BLOCK_M", "PREPROCESS_SPEC", "DKDV_SPEC", "DQ_SPEC", "DKDV_VARLEN_SPEC",
           "DQ_VARLEN_SPEC", "DKDV_CONFIGS", "DQ_CONFIGS"]

PREPROCESS_BLOCK_M = 64     # query rows per program of the D preprocess (an elementwise reduction)


@triton.jit
def _bwd_preprocess(O, DO, DELTA, stride_ob, stride_oh, stride_on,
                    stride_dob, stride_doh, stride_don,
                    H, NQ, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    # this program's query block, of batch b, head h
    pid_m, pid_bh = kit.unflatten(tl.program_id(0), tl.cdiv(NQ, BLOCK_M))
    h, b = kit.unflatten(pid_bh, H)
    b, h = b.to(tl.int64), h.to(tl.int64)   # offsets in 64 bits (kit: Offsets)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)   # (BLOCK_M,) query rows
    rows = offs_m.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)    # (BLOCK_D,) head dim, padded to 2^k
    row_ok = offs_m < NQ
    o_rows = O + b * stride_ob + h * stride_oh + rows * stride_on
    do_rows = DO + b * stride_dob + h * stride_doh + rows * stride_don
    # O_i, dO_i (BLOCK_M, BLOCK_D), in fp32
    o = kit.load_tile(row_ptrs=o_rows, row_ok=row_ok, offs_d=offs_d, D=D,
                      UPCAST=True)
    do = kit.load_tile(row_ptrs=do_rows, row_ok=row_ok, offs_d=offs_d, D=D,
                       UPCAST=True)
    # line 4: D_i = rowsum(dO_i * O_i)
    tl.store(DELTA + (b * H + h) * NQ + offs_m, tl.sum(o * do, 1), mask=row_ok)


@triton.jit
def _row_slopes(ptr, BLOCK_M: tl.constexpr, ALIBI: tl.constexpr):
    """ALiBi: the slope at ``ptr`` (one query head's) in base 2, once per
    row (BLOCK_M,), as kit.alibi_bias takes it; 0.0 (unused) without."""
    if ALIBI:
        slopes2 = tl.full([BLOCK_M], 0.0, tl.float32) + \
            tl.load(ptr) * kit.LOG2E
    else:
        slopes2 = 0.0
    return slopes2


@triton.jit
def _dropout_counters(seed_lo, seed_hi, drop_lo, drop_hi, b, h, H, NQ, NK,
                      nq, nk, DROPOUT: tl.constexpr, VARLEN: tl.constexpr):
    """Dropout: ``(seed, base)`` for kit.dropout_keep, both 64-bit, the
    forward's counters (flashlib.ladder.dropout) of head h of sequence b:
    from offset + (b·H + h)·Nq·Nk; VARLEN: sequence b's own (1, H, nq, nk)
    problem from offset + b·H·NQ·NK (NQ, NK: the max_seqlens). ``(0, 0)``
    (unused) without dropout."""
    if DROPOUT:
        seed = kit.join64(seed_lo, seed_hi)
        if VARLEN:
            base = kit.join64(drop_lo, drop_hi) + b * H * NQ * NK + h * nq * nk
        else:
            base = kit.join64(drop_lo, drop_hi) + (b * H + h) * NQ * NK
    else:
        seed = 0
        base = 0
    return seed, base


@triton.jit
def _bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, SLOPES, CU_Q, CU_K,
              stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn,
              stride_dob, stride_doh, stride_don,
              stride_dkb, stride_dkh, stride_dkn,
              stride_dvb, stride_dvh, stride_dvn,
              qk_scale, scale, H, HKV, GROUP, NQ, NK, D, win_l, win_r,
              softcap2, drop_p, seed_lo, seed_hi, drop_lo, drop_hi, TQ, TK,
              CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              UPCAST: tl.constexpr, PRECISION: tl.constexpr,
              WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
              ALIBI: tl.constexpr = False, DROPOUT: tl.constexpr = False,
              VARLEN: tl.constexpr = False):
    # line 5: this program's key block j, of batch b, kv head hk
    pid_n, pid_bhk = kit.unflatten(tl.program_id(0), tl.cdiv(NK, BLOCK_N))
    hk, b = kit.unflatten(pid_bhk, HKV)
    b, hk = b.to(tl.int64), hk.to(tl.int64)  # offsets in 64 bits (kit: Offsets)
    start_n = pid_n * BLOCK_N
    h = hk * GROUP    # the group's first query head: its Q, dO, LSE, D
    if VARLEN:
        # b is sequence b: query rows q0 .. q0 + nq, keys k0 .. k0 + nk of
        # the token-major tensors (batch strides unused); NQ, NK are the
        # max_seqlens that sized the grid, LSE and D (H, TQ)
        q0, nq = kit.sequence(CU_Q, b, NQ, TQ)
        k0, nk = kit.sequence(CU_K, b, NK, TK)
        if start_n >= nk:               # past the sequence's keys: done
            return
        q_seq = q0.to(tl.int64)
        k_seq = k0.to(tl.int64)
        q_off, do_off = q_seq * stride_qn, q_seq * stride_don
        k_off, v_off = k_seq * stride_kn, k_seq * stride_vn
        dk_off, dv_off = k_seq * stride_dkn, k_seq * stride_dvn
        row0 = h * TQ + q_seq           # the head's row 0 in LSE, D
        width = TQ                      # one head's rows in LSE, D
    else:
        nq = NQ
        nk = NK
        q_off, do_off = b * stride_qb, b * stride_dob
        k_off, v_off = b * stride_kb, b * stride_vb
        dk_off, dv_off = b * stride_dkb, b * stride_dvb
        row0 = (b * H + h) * NQ         # LSE, D (B, H, NQ)
        width = NQ
    offs_n = start_n + tl.arange(0, BLOCK_N)          # (BLOCK_N,) key rows
    keys = offs_n.to(tl.int64)
    offs_m0 = tl.arange(0, BLOCK_M)   # (BLOCK_M,) query offsets in a block
    offs_d = tl.arange(0, BLOCK_D)    # (BLOCK_D,) head dim, padded to 2^k
    key_ok = offs_n < nk
    k_rows = K + k_off + hk * stride_kh + keys * stride_kn
    v_rows = V + v_off + hk * stride_vh + keys * stride_vn
    # line 6: K_j, V_j (BLOCK_N, BLOCK_D), resident for the whole program
    k = kit.load_tile(row_ptrs=k_rows, row_ok=key_ok, offs_d=offs_d, D=D,
                      UPCAST=UPCAST)
    v = kit.load_tile(row_ptrs=v_rows, row_ok=key_ok, offs_d=offs_d, D=D,
                      UPCAST=UPCAST)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)   # line 7: dK_j = dV_j = 0
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)   # on chip, fp32
    # the query blocks that see key block j: the band's, or the causal ones
    lo, lo_full, hi_full, hi, hi_masked = kit.dkdv_query_range(
        start_n=start_n, NQ=nq, NK=nk, win_l=win_l, win_r=win_r,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL, WINDOW=WINDOW)
    q_base = Q + q_off + h * stride_qh
    do_base = DO + do_off + h * stride_doh
    lse_base = LSE + row0
    delta_base = DELTA + row0
    # The variants' per-head values, walked with the head as the pointers
    # are (unused, and compiled out, where their constexpr is off).
    slopes_ptr = SLOPES + b * H + h       # ALiBi: the head's slope
    seed, drop_base = _dropout_counters(seed_lo, seed_hi, drop_lo, drop_hi,
                                        b, h, H, NQ, NK, nq, nk, DROPOUT,
                                        VARLEN)
    for g in range(0, GROUP):       # GQA: every query head reading kv head hk
        slopes2 = _row_slopes(slopes_ptr, BLOCK_M, ALIBI)
        for start_m in range(lo, hi, BLOCK_M):   # line 8: the query blocks i
            offs_m = start_m + offs_m0        # (BLOCK_M,) query rows
            row_ok = offs_m < nq
            m_rows = offs_m.to(tl.int64)
            # line 9: Q_i, dO_i (BLOCK_M, BLOCK_D)
            q = kit.load_tile(row_ptrs=q_base + m_rows * stride_qn,
                              row_ok=row_ok, offs_d=offs_d, D=D,
                              UPCAST=UPCAST)
            do = kit.load_tile(row_ptrs=do_base + m_rows * stride_don,
                               row_ok=row_ok, offs_d=offs_d, D=D,
                               UPCAST=UPCAST)
            # lines 9-16
            dk, dv = kit.dkdv_step(
                dk=dk, dv=dv, q=q, do=do, k=k, v=v, LSE=lse_base,
                DELTA=delta_base, start_m=start_m, offs_m=offs_m,
                offs_n=offs_n, hi_masked=hi_masked, NQ=nq, NK=nk,
                qk_scale=qk_scale, CAUSAL=CAUSAL, PRECISION=PRECISION,
                lo_full=lo_full, hi_full=hi_full, win_l=win_l, win_r=win_r,
                softcap2=softcap2, slopes2=slopes2, seed=seed,
                drop_base=drop_base, drop_p=drop_p, WINDOW=WINDOW,
                SOFTCAP=SOFTCAP, ALIBI=ALIBI, DROPOUT=DROPOUT)
        # The group's next query head: the pointers walk (h·stride in 64
        # bits inside the loop spilled 92 bytes in the TMA twin on sm_90,
        # walking 8; triton 3.9 cross-compiled).
        q_base += stride_qh
        do_base += stride_doh
        lse_base += width
        delta_base += width
        if ALIBI:
            slopes_ptr += 1
        if DROPOUT:
            drop_base += tl.cast(nq, tl.int64) * nk
    dk = dk * scale           # dS = scale * dS: applied once, at the end
    # line 18: write dK_j, dV_j
    dk_rows = DK + dk_off + hk * stride_dkh + keys * stride_dkn
    dv_rows = DV + dv_off + hk * stride_dvh + keys * stride_dvn
    kit.store_tile(row_ptrs=dk_rows, row_ok=key_ok, offs_d=offs_d, D=D,
                   tile=dk)
    kit.store_tile(row_ptrs=dv_rows, row_ok=key_ok, offs_d=offs_d, D=D,
                   tile=dv)


@triton.jit
def _bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, SLOPES, CU_Q, CU_K,
            stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
            stride_vb, stride_vh, stride_vn,
            stride_dob, stride_doh, stride_don,
            stride_dqb, stride_dqh, stride_dqn,
            qk_scale, scale, H, GROUP, NQ, NK, D, win_l, win_r, softcap2,
            drop_p, seed_lo, seed_hi, drop_lo, drop_hi, TQ, TK,
            CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            UPCAST: tl.constexpr, PRECISION: tl.constexpr,
            WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
            ALIBI: tl.constexpr = False, DROPOUT: tl.constexpr = False,
            VARLEN: tl.constexpr = False):
    # dQ_i of this program's query block i, of batch b, head h
    pid_m, pid_bh = kit.unflatten(tl.program_id(0), tl.cdiv(NQ, BLOCK_M))
    h, b = kit.unflatten(pid_bh, H)
    hk = h // GROUP
    # offsets in 64 bits (kit: Offsets)
    b, h, hk = b.to(tl.int64), h.to(tl.int64), hk.to(tl.int64)
    if VARLEN:
        # b is sequence b (as in _bwd_dkdv): rows q0 .. q0 + nq, keys
        # k0 .. k0 + nk, LSE and D (H, TQ)
        q0, nq = kit.sequence(CU_Q, b, NQ, TQ)
        k0, nk = kit.sequence(CU_K, b, NK, TK)
        if pid_m * BLOCK_M >= nq:       # past the sequence's rows: done
            return
        q_seq = q0.to(tl.int64)
        k_seq = k0.to(tl.int64)
        q_off, do_off, dq_off = (q_seq * stride_qn, q_seq * stride_don,
                                 q_seq * stride_dqn)
        k_off, v_off = k_seq * stride_kn, k_seq * stride_vn
        row_base = h * TQ + q_seq       # the head's row 0 in LSE, D
    else:
        nq = NQ
        nk = NK
        q_off, do_off, dq_off = b * stride_qb, b * stride_dob, b * stride_dqb
        k_off, v_off = b * stride_kb, b * stride_vb
        row_base = (b * H + h) * NQ   # the head's row 0 in LSE, D (B, H, NQ)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)   # (BLOCK_M,) query rows
    rows = offs_m.to(tl.int64)
    offs_n0 = tl.arange(0, BLOCK_N)   # (BLOCK_N,) key offsets in a block
    offs_d = tl.arange(0, BLOCK_D)    # (BLOCK_D,) head dim, padded to 2^k
    row_ok = offs_m < nq
    q_rows = Q + q_off + h * stride_qh + rows * stride_qn
    do_rows = DO + do_off + h * stride_doh + rows * stride_don
    # Q_i, dO_i (BLOCK_M, BLOCK_D), resident for the whole program
    q = kit.load_tile(row_ptrs=q_rows, row_ok=row_ok, offs_d=offs_d, D=D,
                      UPCAST=UPCAST)
    do = kit.load_tile(row_ptrs=do_rows, row_ok=row_ok, offs_d=offs_d, D=D,
                       UPCAST=UPCAST)
    # (BLOCK_M,) L_i in base 2, and D_i
    lse = kit.load_lse2(LSE + row_base + offs_m, row_ok)
    delta = tl.load(DELTA + row_base + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)   # dQ_i, on chip, fp32
    k_base = K + k_off + hk * stride_kh
    v_base = V + v_off + hk * stride_vh
    # The variants (constexprs, off by default: the dense kernel compiles
    # as without them): this head's ALiBi slope and dropout counters.
    slopes2 = _row_slopes(SLOPES + b * H + h, BLOCK_M, ALIBI)
    seed, drop_base = _dropout_counters(seed_lo, seed_hi, drop_lo, drop_hi,
                                        b, h, H, NQ, NK, nq, nk, DROPOUT,
                                        VARLEN)
    if WINDOW:
        # the band's key blocks, as the forward's: [lo, hi) seen, those
        # outside [lo_full, hi_full) in part (masked), the rest never loaded
        lo, lo_full, hi_full, hi = kit.band_key_range(
            start_m=pid_m * BLOCK_M, NQ=nq, NK=nk, WIN_L=win_l, WIN_R=win_r,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    else:
        # the forward's key ranges
        lo_masked, hi = kit.key_range(
            start_m=pid_m * BLOCK_M, NQ=nq, NK=nk, BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N, CAUSAL=CAUSAL)
        lo = 0
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0              # (BLOCK_N,) key rows
        # K_j, V_j (BLOCK_N, BLOCK_D)
        k, v = kit.load_kv(
            k_base=k_base, v_base=v_base, rows=offs_n, stride_kn=stride_kn,
            stride_vn=stride_vn, NK=nk, offs_d=offs_d, D=D, STAGE=kit.MASKED,
            UPCAST=UPCAST)
        # S_ij (BLOCK_M, BLOCK_N), in base 2
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if SOFTCAP:                   # the forward's order: softcap, ALiBi
            s = kit.softcap_scores(s, softcap2)
            t = s / softcap2          # tanh of the score / softcap
        if ALIBI:
            s = kit.alibi_bias(s=s, qpos=offs_m, offs_n=offs_n,
                               offset=nk - nq, slopes2=slopes2)
        if WINDOW:
            if (start_n < lo_full) | (start_n >= hi_full):   # the band
                s = kit.mask_band(s=s, qpos=offs_m, offs_n=offs_n, NK=nk,
                                  offset=nk - nq, WIN_L=win_l, WIN_R=win_r)
        else:
            if start_n >= lo_masked:  # a diagonal or ragged block: kit's mask
                s = kit.mask_scores(s=s, offs_m=offs_m, offs_n=offs_n,
                                    NK=nk, offset=nk - nq, CAUSAL=CAUSAL)
        p = tl.math.exp2(s - lse[:, None])      # P_ij (BLOCK_M, BLOCK_N)
        if SOFTCAP:       # dS's factor 1 - t^2, folded into P (t dies here)
            p = p * (1.0 - t * t)
        if DROPOUT:       # Z regenerated, never stored: P o Z / (1 - p)
            keep = kit.dropout_keep(seed=seed, base=drop_base, qpos=offs_m,
                                    offs_n=offs_n, NK=nk, p=drop_p)
            p_kept = tl.where(keep, p * (1.0 / (1.0 - drop_p)), 0.0)
        # dP_ij = dO_i V_j^T (BLOCK_M, BLOCK_N)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        if DROPOUT:       # dS = P o (dP o Z / (1 - p) - D)
            ds = p_kept * dp - p * delta[:, None]
        else:
            ds = p * (dp - delta[:, None])      # dS_ij (BLOCK_M, BLOCK_N)
        # line 15: dQ_i += dS_ij K_j
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    dq = dq * scale
    dq_rows = DQ + dq_off + h * stride_dqh + rows * stride_dqn
    kit.store_tile(row_ptrs=dq_rows, row_ok=row_ok, offs_d=offs_d, D=D,
                   tile=dq)


def grid_preprocess(B: int, H: int, NQ: int) -> tuple[int]:
    """The D preprocess's grid: one program per (batch·head, block of 64 query rows), flat.

    Explained in: notebooks/07b_backward_decoding.

    Tested in: tests/kernels/triton/test_triton_spec.py.
    """
    return fwd_grid(B, H, NQ, PREPROCESS_BLOCK_M)


def grid_dkdv(B: int, HKV: int, NK: int, block_n: int) -> tuple[int]:
    """The dK/dV kernel's grid: one program per (batch·kv head, key block), flat.

    Explained in: notebooks/07b_backward_decoding.

    Tested in: tests/kernels/triton/test_triton_spec.py.
    """
    return fwd_grid(B, HKV, NK, block_n)


grid_dq = fwd_grid       # the dQ kernel's grid is the forward's: one program per (batch·head, query block)


def smem_dkdv(cfg: Config, block_d: int, elem_bytes: int) -> int:
    """dK/dV's tiles: K, V and the P/dS tile resident; Q and dO streamed per pipeline stage.

    Explained in: notebooks/07b_backward_decoding."""
    return staged_bytes(cfg, elem_bytes, resident=2 * cfg.block_n * block_d + 2 * cfg.block_m * cfg.block_n,
                        streamed=2 * cfg.block_m * block_d)


def smem_dq(cfg: Config, block_d: int, elem_bytes: int) -> int:
    """dQ's tiles: Q, dO and the dS tile resident; K and V streamed per pipeline stage.

    Explained in: notebooks/07b_backward_decoding."""
    return staged_bytes(cfg, elem_bytes, resident=2 * cfg.block_m * block_d + cfg.block_m * cfg.block_n,
                        streamed=2 * cfg.block_n * block_d)


PREPROCESS_SPEC = KernelSpec(
    "fa2_bwd_preprocess", _bwd_preprocess, types=dict(DELTA="fp32"),
    grid=lambda a: grid_preprocess(a["O"].shape[0], a["H"], a["NQ"]),
    fixed=Config(PREPROCESS_BLOCK_M, 0, num_warps=4, num_stages=1), uses_dot=False)
# The candidates per architecture (configs.Tables; how they were chosen: configs' header). block_n is
# the key block a program owns, block_m the query step. dK/dV holds two fp32 (block_n x d) accumulators:
# at d = 128 only 32 x 32 tiles compile without spilling on sm_80 (triton 3.9: M64-N32-w4-s2 spills
# 284 bytes, M64-N64-w4-s2 1216). sm_90: the pair measured fastest among those right on an H100,
# 379 TFLOP/s (B4 H16 N8192 d128 fp16, triton 3.6, 2026-11-23; the sweep: notebooks/
# appendix_verification). At d = 256 the last sm75_fp32 candidate is the one that fits a T4's 64 KB.
DKDV_CONFIGS = Tables(
    sm80=(Config(32, 32, 4, 2), Config(16, 32, 4, 1)),
    sm90=(Config(64, 64, 4, 2), Config(64, 32, 4, 2), Config(32, 32, 4, 2), Config(16, 32, 4, 1)),
    sm75=(Config(16, 32, 4, 1), Config(16, 16, 4, 1)),
    fp32=(Config(16, 32, 8, 1), Config(16, 16, 4, 1)),
    sm75_fp32=(Config(16, 32, 4, 1), Config(16, 16, 4, 1), Config(16, 16, 2, 1)),
    interpreter=Config(16, 32))
# dQ: block_m query rows a program owns, block_n the key step, as in the forward.
DQ_CONFIGS = Tables(
    sm80=(Config(64, 64, 4, 2), Config(64, 32, 4, 2), Config(64, 16, 4, 2), Config(32, 16, 4, 1)),
    sm75=(Config(16, 16, 8, 1),),
    fp32=(Config(32, 16, 8, 1), Config(16, 16, 8, 1)),
    sm75_fp32=(Config(16, 16, 8, 1),),
    interpreter=Config(32, 16))
# The variants' pointer and float scalars (flashlib.kernels.triton.fa2_fwd_v1.variant_args' names).
_VARIANT_TYPES = dict(SLOPES="fp32", softcap2="fp32", drop_p="fp32")
DKDV_SPEC = KernelSpec(
    "fa2_bwd_dkdv", _bwd_dkdv,
    types=dict(LSE="fp32", DELTA="fp32", qk_scale="fp32", scale="fp32", **_VARIANT_TYPES),
    grid=lambda a: grid_dkdv(a["Q"].shape[0], a["HKV"], a["NK"], a["BLOCK_N"]),
    config="bwd_dkdv", tables=DKDV_CONFIGS, smem=smem_dkdv)
DQ_SPEC = KernelSpec(
    "fa2_bwd_dq", _bwd_dq,
    types=dict(LSE="fp32", DELTA="fp32", qk_scale="fp32", scale="fp32", **_VARIANT_TYPES),
    grid=lambda a: grid_dq(a["Q"].shape[0], a["H"], a["NQ"], a["BLOCK_M"]),
    config="bwd_dq", tables=DQ_CONFIGS, smem=smem_dq)
# The ragged (varlen) kernels: the same two with VARLEN=True fixed, cu_seqlens typed int32 (only here:
# the TMA dK/dV copies DKDV_SPEC's types and has no CU_Q), and grids over the sequences, B = len(cu) - 1,
# and blocks of max_seqlen (NQ, NK). Same config tables (the tiles are the dense kernels').
_CU_TYPES = dict(CU_Q="i32", CU_K="i32")
DKDV_VARLEN_SPEC = dataclasses.replace(
    DKDV_SPEC, name="fa2_bwd_dkdv_varlen", types={**DKDV_SPEC.types, **_CU_TYPES},
    grid=lambda a: grid_dkdv(a["CU_K"].shape[0] - 1, a["HKV"], a["NK"], a["BLOCK_N"]),
    constants=dict(VARLEN=True))
DQ_VARLEN_SPEC = dataclasses.replace(
    DQ_SPEC, name="fa2_bwd_dq_varlen", types={**DQ_SPEC.types, **_CU_TYPES},
    grid=lambda a: grid_dq(a["CU_Q"].shape[0] - 1, a["H"], a["NQ"], a["BLOCK_M"]),
    constants=dict(VARLEN=True))


def _variant_args(nq: int, nk: int, unused, *, causal: bool, window_size=(-1, -1), softcap: float = 0.0,
                  alibi_slopes=None, dropout_p: float = 0.0, dropout_seed=None) -> dict:
    """The variant arguments of the dK/dV and dQ kernels by name: the forward's
    (:func:`flashlib.kernels.triton.fa2_fwd_v1.variant_args`, one definition of the band, the
    softcap in base 2 and the dropout seed and offset words) less the sink, which the kernels never
    read (the saved LSE includes it; dsinks is a sum on the host). A dense call gets every flag
    off, so the dense kernels compile as without variants; ``unused`` (a float32 tensor) stands for
    the slopes where there are none."""
    args = fwd_variant_args(nq, nk, unused, causal=causal, window_size=window_size, softcap=softcap,
                            alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed)
    del args["SINK"], args["SINKS"]
    return args


def backward(q, k, v, o, lse, do, *, causal: bool, scale: float, allow_tf32: bool = False,
             config_dkdv: Config | None = None, config_dq: Config | None = None,
             dkdv_spec: KernelSpec = DKDV_SPEC, window_size=(-1, -1), softcap: float = 0.0,
             alibi_slopes=None, sinks=None, dropout_p: float = 0.0, dropout_seed=None):
    """Launch the three backward kernels: ``(dq, dk, dv)`` shaped like ``q``, ``k``, ``v``, and
    ``dsinks`` (H,) float32 as a fourth when ``sinks`` is given.

    ``o`` and ``lse`` come from :func:`flashlib.kernels.triton.fa2_fwd_v1.forward`; ``do`` is dL/dO. For GQA,
    ``dk``/``dv`` are summed over the query heads of each group inside the kernel (no expanded copy).
    ``dkdv_spec``: the dK/dV kernel, this file's or one with its arguments (the TMA dK/dV,
    :mod:`flashlib.kernels.triton.fa2_bwd_v5_tma`).

    The variants, as the forward took them (flash-attn's semantics, validated by flashlib.attention):
    ``window_size`` ``(left, right)`` (the dK/dV kernel's query range and the dQ kernel's key range
    skip the tiles outside the band), ``softcap`` (dS times 1 - tanh^2 of the recomputed score),
    ``alibi_slopes`` float32 ``(B, H)`` (no gradient), ``sinks`` float32 ``(H,)`` (the saved lse
    includes the sink, so P is already right: ``dsinks = -sum exp(sink - lse) D`` over batch and
    rows), ``dropout_p`` with ``dropout_seed=(seed, offset)`` (Z regenerated from the forward's
    counters, never stored). None used: the dense kernels, compiled as before.

    Explained in: notebooks/07b_backward_decoding.
    Tested in: tests/kernels/triton/test_triton_fa2_bwd_v2.py and
    tests/kernels/triton/test_triton_variants_bwd.py.
    """
    B, H, NQ, D = q.shape
    HKV, NK = k.shape[1], k.shape[2]
    block_d = _block_d_allowed(q)
    if do.stride(-1) != 1:
        do = do.contiguous()
    delta = torch.empty((B, H, NQ), device=q.device, dtype=torch.float32)
    PREPROCESS_SPEC.launch(O=o, DO=do, DELTA=delta, H=H, NQ=NQ, D=D, BLOCK_D=block_d)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # every flag off when no variant is used: the dense kernels
    variants = _variant_args(NQ, NK, delta, causal=causal, window_size=window_size, softcap=softcap,
                             alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed)
    args = dict(Q=q, K=k, V=v, DO=do, LSE=lse, DELTA=delta, qk_scale=kit.qk_scale(scale), scale=scale,
                H=H, GROUP=H // HKV, NQ=NQ, NK=NK, D=D, CAUSAL=causal, BLOCK_D=block_d,
                PRECISION="tf32" if allow_tf32 else "ieee", **variants)
    # VARLEN's arguments, off: delta stands for cu_seqlens (never read), the totals unused
    off = dict(CU_Q=delta, CU_K=delta, TQ=0, TK=0)
    dkdv_spec.launch(config_dkdv, **args, DK=dk, DV=dv, HKV=HKV,
                     **(off if "CU_Q" in dkdv_spec.runtime_args else {}))
    DQ_SPEC.launch(config_dq, **args, **off, DQ=dq)
    if sinks is None:
        return dq, dk, dv
    # dsink_h = -sum_{b,i} exp(sink_h - lse_bhi) D_bhi: lse >= sink, so exp <= 1 (no overflow)
    dsinks = -(torch.exp(sinks.to(torch.float32).reshape(1, H, 1) - lse) * delta).sum((0, 2))
    return dq, dk, dv, dsinks


def _block_d_allowed(q) -> int:
    """The head-dim tile of ``q``'s head dim, after configs.refusal's check
    where the tile passes 128 (RuntimeError: the dK/dV kernel on a T4 with
    some Tritons is too big)."""
    block_d = kit.block_d(q.shape[-1])
    # a GPU (or a rehearsed one)
    facts = device_facts(q.device) if block_d > 128 else None
    if facts is not None:
        why = refusal("bwd_dkdv", facts.arch, block_d,
                      str(q.dtype).removeprefix("torch."))
        if why:
            raise RuntimeError(why)
    return block_d


def _heads_major(x):
    """A token-major ``(T, H, d)`` tensor as the kernels' ``(1, H, T, d)``
    view (no copy): its (batch, head, row) strides are then (unused, head,
    token)."""
    return x.transpose(0, 1).unsqueeze(0)


def backward_varlen(q, k, v, o, lse, do, cu_q, cu_k, max_q: int, max_k: int,
                    *, causal: bool, scale: float, allow_tf32: bool = False,
                    config_dkdv: Config | None = None,
                    config_dq: Config | None = None, window_size=(-1, -1),
                    softcap: float = 0.0, alibi_slopes=None, sinks=None,
                    dropout_p: float = 0.0, dropout_seed=None):
    """The backward of a ragged (varlen) batch: ``(dq, dk, dv)`` shaped like
    ``q (Tq, H, d)``, ``k, v (Tk, Hkv, d)`` (token-major), and ``dsinks``
    (H,) float32 as a fourth with ``sinks``.

    Sequence b is query rows ``cu_q[b]:cu_q[b+1]`` and keys
    ``cu_k[b]:cu_k[b+1]`` (``cu_q``, ``cu_k`` int32 ``(B+1,)`` on q's
    device, from 0, non-decreasing; empty sequences allowed); ``max_q``,
    ``max_k`` are host ints at least every length (they size the grids;
    nothing is read back from the device). ``o``, ``do`` like q, ``lse``
    float32 ``(H, Tq)``, as the varlen forward saves them. Masks align
    bottom-right per sequence (offset nk_b - nq_b); rows that see no key
    get zero gradients; dk, dv are summed over each GQA group,
    deterministically (no atomics). Rows outside every sequence get 0.

    The kernels are :func:`backward`'s with ``VARLEN`` on
    (:data:`DKDV_VARLEN_SPEC`, :data:`DQ_VARLEN_SPEC`): program b·H + h of a
    grid over (sequence, head) x (blocks of max_seqlen) reads sequence b's
    bounds from cu_seqlens and exits at once past its end; D = rowsum(dO o O)
    needs no sequence (the dense preprocess on the (1, H, Tq) view). The
    variants as :func:`backward` takes them, per sequence: ``alibi_slopes``
    float32 ``(B, H)``; ``sinks`` ``(H,)`` (dsinks summed over every row of
    every sequence); dropout's counters are those of sequence b's own dense
    ``(1, H, nq_b, nk_b)`` problem at offset ``offset + b·H·max_q·max_k``.

    Explained in: notebooks/10_serving.
    Tested in: tests/kernels/triton/test_triton_varlen_bwd.py.
    """
    TQ, H, D = q.shape
    TK, HKV = k.shape[0], k.shape[1]
    nseq = cu_q.shape[0] - 1
    block_d = _block_d_allowed(q)
    if do.stride(-1) != 1:
        do = do.contiguous()
    lse = lse.to(torch.float32).contiguous()
    delta = torch.empty((H, TQ), device=q.device, dtype=torch.float32)
    if TQ:    # D of all rows at once: the dense preprocess of (1, H, Tq)
        PREPROCESS_SPEC.launch(O=_heads_major(o), DO=_heads_major(do),
                               DELTA=delta, H=H, NQ=TQ, D=D, BLOCK_D=block_d)
    # zeros: the kernels write every row a sequence holds, and no other
    dq, dk, dv = (torch.zeros_like(x) for x in (q, k, v))
    variants = _variant_args(
        max_q, max_k, delta, causal=causal, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
        dropout_seed=dropout_seed)
    args = dict(Q=_heads_major(q), K=_heads_major(k), V=_heads_major(v),
                DO=_heads_major(do), LSE=lse, DELTA=delta, CU_Q=cu_q,
                CU_K=cu_k, qk_scale=kit.qk_scale(scale), scale=scale, H=H,
                GROUP=H // HKV, NQ=max_q, NK=max_k, TQ=TQ, TK=TK, D=D,
                CAUSAL=causal, BLOCK_D=block_d,
                PRECISION="tf32" if allow_tf32 else "ieee", **variants)
    # an empty grid is no launch (flat_grid refuses 0 programs)
    if nseq > 0 and max_k > 0 and TK > 0:
        DKDV_VARLEN_SPEC.launch(config_dkdv, **args, DK=_heads_major(dk),
                                DV=_heads_major(dv), HKV=HKV)
    if nseq > 0 and max_q > 0 and TQ > 0:
        DQ_VARLEN_SPEC.launch(config_dq, **args, DQ=_heads_major(dq))
    if sinks is None:
        return dq, dk, dv
    # dsink_h = -sum over every row t of exp(sink_h - lse_ht) D_ht
    # (lse >= sink: exp <= 1)
    sink = sinks.to(torch.float32).reshape(H, 1)
    dsinks = -(torch.exp(sink - lse) * delta).sum(1)
    return dq, dk, dv, dsinks
