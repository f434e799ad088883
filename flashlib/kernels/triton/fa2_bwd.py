# fa2_bwd.py — FlashAttention-2 backward in Triton, version 2 of the Triton kernels.
# Changed from the NumPy ladder (flashlib.ladder.fa2.backward): three kernels instead of one loop nest.
#   (1) _bwd_preprocess: D = rowsum(dO * O) per query row (Algorithm 2, line 4).
#   (2) _bwd_dkdv: one program per (key block, batch, kv head) holds dK_j, dV_j on chip and loops over
#       the query blocks that can see key block j (and, for GQA, over every query head of the group),
#       recomputing P from the saved LSE (lines 5-18 without line 15).
#   (3) _bwd_dq: one program per (query block, batch, head) holds dQ_i on chip and loops over key
#       blocks, like the forward (line 15, with the loops swapped).
#   The ladder's line 15 adds into dQ from every key block (atomic adds on a GPU: order-dependent,
#   not bitwise reproducible). Splitting dQ into its own kernel recomputes P once more but makes the
#   backward deterministic: every output element is written by exactly one program, no atomics.
#   Causal: query blocks that cannot see a key block are skipped, only the diagonal blocks are masked;
#   rows that see no key (lse = -inf) get P = 0, so their gradients are 0, not NaN.
#   Every grid is flat, as the forward's (flashlib.kernels.triton.flat_grid): program p is block
#   p % n_blocks of (batch, head) — of (batch, kv head) for dK/dV — p // n_blocks.
# Idea: Dao 2023 (FlashAttention-2), Algorithm 2; the dK/dV + dQ split as in Triton's fused-attention
#   tutorial and flash-attn's deterministic mode (our own code; plain pointers, no block pointers).
# Limits: as the forward (head dim <= 256, fp16/bf16/fp32, bf16 needs sm_80+, any B·H, each tensor
#   < 2^31 elements).
# Run: flashlib.attention(q, k, v, backend="triton").backward(do); interpreted on a CPU.
"""FlashAttention-2 backward kernels and their launcher.  Explained in: notebooks/07_triton."""
from __future__ import annotations

import torch

from . import INTERPRET, triton, tl
from .configs import Config, launch
from .fa2_fwd import LOG2E
from .fa2_fwd import grid as fwd_grid

__all__ = ["backward", "grid_preprocess", "grid_dkdv", "grid_dq", "PREPROCESS_BLOCK_M"]

PREPROCESS_BLOCK_M = 64     # query rows per program of the D preprocess (an elementwise reduction)


@triton.jit
def _bwd_preprocess(O, DO, DELTA, stride_ob, stride_oh, stride_on, stride_dob, stride_doh, stride_don,
                    H, NQ, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    n_m = tl.cdiv(NQ, BLOCK_M)                         # flat grid: query block, then batch·head
    pid_m = tl.program_id(0) % n_m
    pid_bh = tl.program_id(0) // n_m
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < NQ) & (offs_d[None, :] < D)
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + pid_bh * NQ + offs_m, tl.sum(o * do, 1), mask=offs_m < NQ)   # line 4: D_i


@triton.jit
def _bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV,
              stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
              stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
              qk_scale, scale, H, HKV, GROUP, NQ, NK, D,
              CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    n_n = tl.cdiv(NK, BLOCK_N)                         # key blocks per kv head (flat grid: axis 0)
    pid_n = tl.program_id(0) % n_n                     # line 5: this program owns key block j ...
    pid_bhk = tl.program_id(0) // n_n                  # ... of batch b, kv head hk
    b = pid_bhk // HKV
    hk = pid_bhk % HKV
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)           # (BLOCK_N,) key rows
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < D
    kv_mask = (offs_n[:, None] < NK) & d_ok
    k = tl.load(K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
                mask=kv_mask, other=0.0)               # line 6: K_j, V_j  (BLOCK_N, BLOCK_D)
    v = tl.load(V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :],
                mask=kv_mask, other=0.0)
    if UPCAST:                                         # interpreter + bf16: dots in fp32 (see fwd)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)      # line 7: dK_j = dV_j = 0 on chip
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    key_ok = offs_n[None, :] < NK                      # the ragged last key block

    # Query rows that see key block j: i >= start_n - offset; rows that see all of it:
    # i >= start_n + BLOCK_N - 1 - offset. Between the two: the diagonal blocks, masked.
    offset = NK - NQ
    if CAUSAL:
        lo = tl.maximum(start_n - offset, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
        hi_masked = tl.minimum(tl.maximum(start_n + BLOCK_N - 1 - offset, 0), NQ)
    else:
        lo = 0
        hi_masked = 0
    for g in range(0, GROUP):                          # GQA: every query head reading kv head hk
        h = hk * GROUP + g
        q_base = Q + b * stride_qb + h * stride_qh + offs_d[None, :]
        do_base = DO + b * stride_dob + h * stride_doh + offs_d[None, :]
        row_base = (b * H + h) * NQ
        for start_m in range(lo, NQ, BLOCK_M):         # line 8: for the query blocks i
            offs_m = start_m + offs_m0
            row_ok = offs_m < NQ
            q = tl.load(q_base + offs_m[:, None] * stride_qn, mask=row_ok[:, None] & d_ok, other=0.0)
            do = tl.load(do_base + offs_m[:, None] * stride_don, mask=row_ok[:, None] & d_ok, other=0.0)
            # line 9: L_i and D_i. Rows past NQ, and rows that saw no key (lse = -inf), get
            # lse = +inf, so that P = exp2(S - inf) = 0 for them: no -inf - -inf = NaN.
            lse = tl.load(LSE + row_base + offs_m, mask=row_ok, other=float("inf"))
            lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
            delta = tl.load(DELTA + row_base + offs_m, mask=row_ok, other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale   # line 10: S_ij, base 2
            if CAUSAL:
                if start_m < hi_masked:                # a diagonal block: apply the causal mask
                    s = tl.where(offs_n[None, :] <= offs_m[:, None] + offset, s, float("-inf"))
            s = tl.where(key_ok, s, float("-inf"))     # the ragged last key block
            p = tl.math.exp2(s - lse[:, None])                                  # line 11: P_ij
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)   # line 12
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)                # line 13: dP_ij
            ds = p * (dp - delta[:, None])                                         # line 14: dS_ij
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)   # line 16
    dk = dk * scale                                    # dS = scale * dS: applied once, at the end
    tl.store(DK + b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=kv_mask)                              # line 18
    tl.store(DV + b * stride_dvb + hk * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq(Q, K, V, DO, LSE, DELTA, DQ,
            stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
            stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
            stride_dqb, stride_dqh, stride_dqn,
            qk_scale, scale, H, GROUP, NQ, NK, D,
            CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    n_m = tl.cdiv(NQ, BLOCK_M)                         # query blocks per head (flat grid: axis 0)
    pid_m = tl.program_id(0) % n_m                     # this program owns dQ_i of query block i ...
    pid_bh = tl.program_id(0) // n_m                   # ... of batch b, head h
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < D
    row_ok = offs_m < NQ
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :],
                mask=row_ok[:, None] & d_ok, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :],
                 mask=row_ok[:, None] & d_ok, other=0.0)
    lse = tl.load(LSE + pid_bh * NQ + offs_m, mask=row_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634   # as in _bwd_dkdv
    delta = tl.load(DELTA + pid_bh * NQ + offs_m, mask=row_ok, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + b * stride_kb + hk * stride_kh + offs_d[None, :]
    v_base = V + b * stride_vb + hk * stride_vh + offs_d[None, :]

    offset = NK - NQ                                   # the same key range as the forward
    if CAUSAL:
        last_row = tl.minimum(pid_m * BLOCK_M + BLOCK_M, NQ) - 1
        hi = tl.minimum(tl.maximum(last_row + offset + 1, 0), NK)
        seen_by_all = tl.minimum(tl.maximum(pid_m * BLOCK_M + offset + 1, 0), NK)
    else:
        hi = NK
        seen_by_all = NK
    lo_masked = (seen_by_all // BLOCK_N) * BLOCK_N
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        kv_mask = (offs_n[:, None] < NK) & d_ok
        k = tl.load(k_base + offs_n[:, None] * stride_kn, mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if start_n >= lo_masked:                       # diagonal or ragged block: mask
            visible = offs_n[None, :] < NK
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + offset)
            s = tl.where(visible, s, float("-inf"))
        p = tl.math.exp2(s - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)          # line 15: dQ_i += dS K_j
    dq = dq * scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqn + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok)


def grid_preprocess(B: int, H: int, NQ: int) -> tuple[int]:
    """The D preprocess's grid: one program per (batch·head, block of 64 query rows), flat.

    Explained in: notebooks/07_triton."""
    return fwd_grid(B, H, NQ, PREPROCESS_BLOCK_M)


def grid_dkdv(B: int, HKV: int, NK: int, block_n: int) -> tuple[int]:
    """The dK/dV kernel's grid: one program per (batch·kv head, key block), flat.

    Explained in: notebooks/07_triton."""
    return fwd_grid(B, HKV, NK, block_n)


grid_dq = fwd_grid       # the dQ kernel's grid is the forward's: one program per (batch·head, query block)


def backward(q, k, v, o, lse, do, *, causal: bool, scale: float, allow_tf32: bool = False,
             config_dkdv: Config | None = None, config_dq: Config | None = None):
    """Launch the three backward kernels: ``(dq, dk, dv)`` shaped like ``q``, ``k``, ``v``.

    ``o`` and ``lse`` come from :func:`flashlib.kernels.triton.fa2_fwd.forward`; ``do`` is dL/dO. For GQA,
    ``dk``/``dv`` are summed over the query heads of each group inside the kernel (no expanded copy).
    """
    B, H, NQ, D = q.shape
    HKV, NK = k.shape[1], k.shape[2]
    block_d = max(16, triton.next_power_of_2(D))
    es = q.element_size()
    flags = dict(CAUSAL=causal, BLOCK_D=block_d, UPCAST=INTERPRET and q.dtype == torch.bfloat16,
                 PRECISION="tf32" if allow_tf32 else "ieee")
    if do.stride(-1) != 1:
        do = do.contiguous()
    delta = torch.empty((B, H, NQ), device=q.device, dtype=torch.float32)
    _bwd_preprocess[grid_preprocess(B, H, NQ)](
        o, do, delta, o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1), do.stride(2),
        H, NQ, D, BLOCK_M=PREPROCESS_BLOCK_M, BLOCK_D=block_d)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2))

    def run_dkdv(cfg):
        _bwd_dkdv[grid_dkdv(B, HKV, NK, cfg.block_n)](
            q, k, v, do, lse, delta, dk, dv, *strides,
            dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
            scale * LOG2E, scale, H, HKV, H // HKV, NQ, NK, D,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **flags,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def run_dq(cfg):
        _bwd_dq[grid_dq(B, H, NQ, cfg.block_m)](
            q, k, v, do, lse, delta, dq, *strides, dq.stride(0), dq.stride(1), dq.stride(2),
            scale * LOG2E, scale, H, H // HKV, NQ, NK, D,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **flags,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    launch("bwd_dkdv", q.device, block_d, es, run_dkdv, config_dkdv)
    launch("bwd_dq", q.device, block_d, es, run_dq, config_dq)
    return dq, dk, dv
