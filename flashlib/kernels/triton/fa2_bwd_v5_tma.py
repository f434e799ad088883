# fa2_bwd_v5_tma.py — the FlashAttention-2 backward's dK/dV kernel through tensor descriptors (TMA on
#   Hopper), version 5 of the Triton kernels ("the TMA dK/dV"). Version 2 (fa2_bwd_v2.py) stays the
#   default; the D preprocess and the dQ kernel are version 2's, launched by its backward
#   (fa2_bwd_v2.backward with dkdv_spec=DKDV_SPEC).
# Changed from version 2's _bwd_dkdv: K_j and V_j, every Q_i and dO_i tile, and the stores of dK_j
#   and dV_j go through 2-D descriptors of their (batch, head), as in the TMA forward
#   (fa2_fwd_v4_tma.py, version 4): no address arithmetic and no load masks in the warps; rows past N
#   and columns past d read as 0, and the stores drop them. The loops and the GQA sum over a group's
#   query heads are version 2's, and the step of the inner loop (recomputing P, the masks, dV, dP,
#   dS, dK) is its very function, kit.dkdv_step. DKDV_SPEC is version 2's (arguments, grid, config
#   table, shared memory) with this kernel and scratch=True. The attention variants (issue 24:
#   window, softcap, ALiBi, dropout; sinks on the host) come with them: version 2's band query range
#   and per-head walk, the same step; off, the dense kernel compiles as before.
#   Why this kernel first: it holds two fp32 accumulators (dK_j, dV_j) plus K_j, V_j and the P/dS
#   tiles, and it is the one that spills. Cross-compiled for sm_90 by triton 3.9 at the config an
#   H100 measured fastest and right (M64-N64-w4-s2, d = 128, fp16, causal), version 2 spills 216
#   bytes per thread and this kernel 8 (the compile report's rows;
#   tests/tools/test_compile_report.py checks it).
# Idea: the TMA forward's descriptors applied to Dao 2023 (FlashAttention-2), Algorithm 2, lines
#   5-18 without line 15; FlashAttention-3 (Shah et al. 2024) moves every tile of its backward with
#   TMA.
# Limits: the TMA forward's (fp16/bf16; strides and (batch, head) starts multiples of 16 bytes, so d
#   a multiple of 8 for contiguous tensors: fa2_fwd_v4_tma.supported, given dO too; triton >= 3.4). It
#   runs with the dK/dV config table and configs.hazard's rule, as version 2 does. Measured on no
#   GPU yet, so opt-in, independently of the forward; its determinism on a GPU is a GPU-tier test.
# Run: o = flashlib.attention(q, k, v, backend="triton", kernel=(None, "v5")); o.backward(do) (or
#   FLASHLIB_TRITON_BWD=v5 as the default), or fa2_bwd_v5_tma.backward(q, k, v, o, lse, do,
#   causal=True, scale=d ** -0.5); interpreted on a CPU.
"""The FA2 backward with its dK/dV kernel through tensor descriptors (TMA on sm_90).

Explained in: notebooks/07c_hopper."""
from __future__ import annotations

import dataclasses

import torch

from ...validation import check_flag, check_scale, check_tensors
from . import fa2_bwd_v2, kit, triton, tl
from .configs import Config
from .fa2_fwd_v4_tma import supported

__all__ = ["backward", "DKDV_SPEC"]


@triton.jit
def _bwd_dkdv_tma(Q, K, V, DO, LSE, DELTA, DK, DV, SLOPES,
                  stride_qb, stride_qh, stride_qn,
                  stride_kb, stride_kh, stride_kn,
                  stride_vb, stride_vh, stride_vn,
                  stride_dob, stride_doh, stride_don,
                  stride_dkb, stride_dkh, stride_dkn,
                  stride_dvb, stride_dvh, stride_dvn,
                  qk_scale, scale, H, HKV, GROUP, NQ, NK, D, win_l, win_r,
                  softcap2, drop_p, seed_lo, seed_hi, drop_lo, drop_hi,
                  CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                  WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
                  ALIBI: tl.constexpr = False,
                  DROPOUT: tl.constexpr = False):
    # line 5: this program's key block j, of batch b, kv head hk
    pid_n, pid_bhk = kit.unflatten(tl.program_id(0), tl.cdiv(NK, BLOCK_N))
    hk, b = kit.unflatten(pid_bhk, HKV)
    b, hk = b.to(tl.int64), hk.to(tl.int64)  # offsets in 64 bits (kit: Offsets)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)          # (BLOCK_N,) key rows
    offs_m0 = tl.arange(0, BLOCK_M)   # (BLOCK_M,) query offsets in a block
    # line 6: K_j, V_j (BLOCK_N, BLOCK_D), one TMA copy each
    k = kit.desc_2d(base=K + b * stride_kb + hk * stride_kh, N=NK, D=D,
                    stride_n=stride_kn, ROWS=BLOCK_N,
                    BLOCK_D=BLOCK_D).load([start_n, 0])
    v = kit.desc_2d(base=V + b * stride_vb + hk * stride_vh, N=NK, D=D,
                    stride_n=stride_vn, ROWS=BLOCK_N,
                    BLOCK_D=BLOCK_D).load([start_n, 0])
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)   # line 7: dK_j = dV_j = 0
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)   # on chip, fp32
    # the query blocks that see key block j: the band's, or the causal ones
    lo, lo_full, hi_full, hi, hi_masked = kit.dkdv_query_range(
        start_n=start_n, NQ=NQ, NK=NK, win_l=win_l, win_r=win_r,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL, WINDOW=WINDOW)
    h = hk * GROUP    # the group's first query head: its Q, dO, LSE, D
    q_base = Q + b * stride_qb + h * stride_qh
    do_base = DO + b * stride_dob + h * stride_doh
    lse_base = LSE + (b * H + h) * NQ
    delta_base = DELTA + (b * H + h) * NQ
    # the variants' per-head values, walked as version 2 walks them
    slopes_ptr = SLOPES + b * H + h
    seed, drop_base = fa2_bwd_v2._dropout_counters(
        seed_lo, seed_hi, drop_lo, drop_hi, b, h, H, NQ, NK, NQ, NK, DROPOUT,
        False)
    for g in range(0, GROUP):       # GQA: every query head reading kv head hk
        slopes2 = fa2_bwd_v2._row_slopes(slopes_ptr, BLOCK_M, ALIBI)
        # descriptors of the head's Q and dO (NQ, D), in (BLOCK_M, BLOCK_D)
        q_desc = kit.desc_2d(base=q_base, N=NQ, D=D, stride_n=stride_qn,
                             ROWS=BLOCK_M, BLOCK_D=BLOCK_D)
        do_desc = kit.desc_2d(base=do_base, N=NQ, D=D, stride_n=stride_don,
                              ROWS=BLOCK_M, BLOCK_D=BLOCK_D)
        for start_m in range(lo, hi, BLOCK_M):   # line 8: the query blocks i
            # line 9: Q_i, dO_i (BLOCK_M, BLOCK_D), one TMA copy each
            q = q_desc.load([start_m, 0])
            do = do_desc.load([start_m, 0])
            if UPCAST:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            # lines 9-16, version 2's own step
            dk, dv = kit.dkdv_step(
                dk=dk, dv=dv, q=q, do=do, k=k, v=v, LSE=lse_base,
                DELTA=delta_base, start_m=start_m, offs_m=start_m + offs_m0,
                offs_n=offs_n, hi_masked=hi_masked, NQ=NQ, NK=NK,
                qk_scale=qk_scale, CAUSAL=CAUSAL, PRECISION=PRECISION,
                lo_full=lo_full, hi_full=hi_full, win_l=win_l, win_r=win_r,
                softcap2=softcap2, slopes2=slopes2, seed=seed,
                drop_base=drop_base, drop_p=drop_p, WINDOW=WINDOW,
                SOFTCAP=SOFTCAP, ALIBI=ALIBI, DROPOUT=DROPOUT)
        # the next query head of the group, as version 2
        q_base += stride_qh
        do_base += stride_doh
        lse_base += NQ
        delta_base += NQ
        if ALIBI:
            slopes_ptr += 1
        if DROPOUT:
            drop_base += tl.cast(NQ, tl.int64) * NK
    dk = dk * scale           # dS = scale * dS: applied once, at the end
    # line 18: rows past NK are dropped
    kit.desc_2d(base=DK + b * stride_dkb + hk * stride_dkh, N=NK, D=D,
                stride_n=stride_dkn, ROWS=BLOCK_N,
                BLOCK_D=BLOCK_D).store([start_n, 0],
                                       dk.to(DK.dtype.element_ty))
    kit.desc_2d(base=DV + b * stride_dvb + hk * stride_dvh, N=NK, D=D,
                stride_n=stride_dvn, ROWS=BLOCK_N,
                BLOCK_D=BLOCK_D).store([start_n, 0],
                                       dv.to(DV.dtype.element_ty))


# Version 2's dK/dV interface (arguments, grid, config table, shared memory), this file's kernel.
DKDV_SPEC = dataclasses.replace(fa2_bwd_v2.DKDV_SPEC, name="fa2_bwd_dkdv_tma", fn=_bwd_dkdv_tma, scratch=True)


def backward(q, k, v, o, lse, do, *, causal: bool, scale: float, config_dkdv: Config | None = None,
             config_dq: Config | None = None, **variants):
    """Version 2's backward (:func:`flashlib.kernels.triton.fa2_bwd_v2.backward`) with this file's dK/dV
    kernel: ``(dq, dk, dv)``, and ``dsinks`` as a fourth with ``sinks``. q, k, v, do are checked as
    flashlib.attention checks them (TypeError / ValueError naming the argument); ValueError if
    :func:`flashlib.kernels.triton.fa2_fwd_v4_tma.supported` refuses q, k, v or do. ``variants``:
    version 2's (window_size, softcap, alibi_slopes, sinks, dropout_p, dropout_seed), passed on as
    given (validated by flashlib.attention): this kernel computes them with version 2's step.

    Explained in: notebooks/07c_hopper.
    Tested in: tests/kernels/triton/test_triton_fa2_bwd_v5_tma.py.
    """
    check_tensors(q, k, v)
    if not isinstance(do, torch.Tensor):
        raise TypeError(f"do must be a torch.Tensor, got {type(do).__name__}")
    if (do.shape, do.dtype, do.device) != (q.shape, q.dtype, q.device):
        raise ValueError(f"do must have q's shape, dtype and device {tuple(q.shape)}, {q.dtype}, {q.device}; "
                         f"got {tuple(do.shape)}, {do.dtype}, {do.device}")
    check_flag(causal, "causal")
    scale = check_scale(scale, q.shape[-1])
    why = supported(q, k, v, do)
    if why is not None:
        raise ValueError(f"fa2_bwd_v5_tma.backward: {why}")
    return fa2_bwd_v2.backward(q, k, v, o, lse, do, causal=causal, scale=scale, config_dkdv=config_dkdv,
                               config_dq=config_dq, dkdv_spec=DKDV_SPEC, **variants)
